"""`kvstream bench` arithmetic, datasets and a real comparison run; `kvstream status`
rendering, the unreachable case and --watch, headless."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from kvstream.bench import datasets
from kvstream.bench.metrics import RequestResult, calculate, percentile, tpot, ttft_by_turn
from kvstream.bench.runner import Load
from kvstream.cli import bench as bench_cli
from kvstream.cli import status as status_cli
from tests.conftest import free_port, wait_http

VLLM_KEYS = {
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", *[f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p99")],
}


def test_metrics_arithmetic_on_recorded_timelines():
    a = RequestResult(True, 200, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.2], prompt_tokens=10, output_tokens=4)
    b = RequestResult(True, 200, ttft=0.3, latency=0.3, itl=[], prompt_tokens=20, output_tokens=1)
    c = RequestResult(False, 429, error="http 429")
    assert tpot(a) == pytest.approx((0.5 - 0.1) / 3) and tpot(b) is None
    m = calculate([a, b, c], duration=2.0)
    assert VLLM_KEYS <= set(m)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == {"429": 1}
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.0) and m["output_throughput"] == pytest.approx(2.5)
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert m["mean_itl_ms"] == pytest.approx(400 / 3)
    assert m["mean_e2el_ms"] == pytest.approx(400)
    for r in (a, b):
        assert r.ttft <= r.latency
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert ttft_by_turn([RequestResult(True, ttft=0.1, turn=0), RequestResult(True, ttft=0.3, turn=0), RequestResult(True, ttft=0.2, turn=1)]) == {0: 200.0, 1: 200.0}


def test_datasets_are_seeded_and_shaped():
    assert datasets.random_dataset(5, 50, 8, seed=1) == datasets.random_dataset(5, 50, 8, seed=1)
    assert datasets.random_dataset(5, 50, 8, seed=1) != datasets.random_dataset(5, 50, 8, seed=2)
    rep = datasets.prefix_repetition_dataset(12, 3, 40, 8, 8, seed=0)
    assert len({r.messages[0]["content"] for r in rep}) == 3 and len({r.messages[1]["content"] for r in rep}) == 12
    convs = datasets.multi_turn_dataset(2, 4, 30, 10, 8, seed=0)
    assert len(convs) == 2 and all(len(c.user_turns) == 4 for c in convs)


def _prompt(item) -> str:
    return item.system if isinstance(item, datasets.Conversation) else json.dumps(item.messages)


def test_compared_servers_get_their_own_copies_in_alternating_rounds():
    """Two servers in front of one runtime: neither may be served the other's prompts from the
    runtime's cache, and neither may always follow itself (its slots warm for it alone)."""
    items = datasets.prefix_repetition_dataset(8, 2, 40, 8, 8, seed=0)
    before = json.dumps([r.messages for r in items])
    plan = bench_cli.rounds(items, 2, False, Load(concurrency=4))
    assert [i for i, _, _ in plan] == [0, 1, 0, 1]
    assert all(load.total_requests is None and load.concurrency == 4 for _, _, load in plan)
    sent = {i: [r for j, chunk, _ in plan if j == i for r in chunk] for i in (0, 1)}
    for i, marker in enumerate(bench_cli.MARKERS):
        assert len(sent[i]) == len(items)
        assert [r.messages[0]["content"] for r in sent[i]] == [marker + r.messages[0]["content"] for r in items]
        assert [r.messages[1:] for r in sent[i]] == [r.messages[1:] for r in items]
    assert not {_prompt(r) for r in sent[0]} & {_prompt(r) for r in sent[1]}
    assert json.dumps([r.messages for r in items]) == before  # the workload itself is left as it was
    assert len(set(map(len, bench_cli.MARKERS))) == 1

    # --total-requests is split over the rounds, not dropped; a duration runs each copy whole.
    plan = bench_cli.rounds(items, 2, False, Load(concurrency=4, total_requests=12))
    assert [len(chunk) for _, chunk, _ in plan] == [6, 6, 6, 6]
    plan = bench_cli.rounds(items, 2, False, Load(duration=5.0))
    assert [(i, len(chunk), load.duration) for i, chunk, load in plan] == [(0, 8, 5.0), (1, 8, 5.0)]
    # Conversations and content parts are marked too; one server gets the workload as it is.
    convs = datasets.multi_turn_dataset(2, 3, 30, 10, 8, seed=0)
    plan = bench_cli.rounds(convs, 2, True, Load())
    assert [c.system for _, chunk, _ in plan for c in chunk] == [m + c.system for m in bench_cli.MARKERS for c in convs[:1]] + \
        [m + c.system for m in bench_cli.MARKERS for c in convs[1:]]
    parts = [datasets.BenchRequest([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], 4)]
    assert datasets.marked(parts, "[A] ")[0].messages[0]["content"] == [{"type": "text", "text": "[A] "}, {"type": "text", "text": "hi"}]
    assert bench_cli.rounds(items, 1, False, Load()) == [(0, items, Load())]


def test_a_comparison_table_says_each_server_ran_its_own_copy():
    metrics = calculate([RequestResult(True, 200, ttft=0.1, latency=0.2, itl=[0.1], prompt_tokens=5, output_tokens=2)], 1.0)

    def rendered(named) -> str:
        console = Console(width=200, file=io.StringIO())
        console.print(bench_cli.summary_table(named))
        return console.file.getvalue()

    assert "its own copy of the workload" in rendered([("a", metrics), ("b", metrics)])
    assert "its own copy" not in rendered([("a", metrics)])


def test_file_dataset_reads_openai_and_sharegpt_lines(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 3}) + "\n"
        + json.dumps({"prompt": "b"}) + "\n\n"
        + json.dumps({"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}) + "\n"
    )
    reqs = datasets.file_dataset(path, None, 16)
    assert [r.messages[0]["content"] for r in reqs] == ["a", "b", "c"] and reqs[0].max_tokens == 3 and reqs[1].max_tokens == 16
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="not JSON"):
        datasets.file_dataset(tmp_path / "bad.jsonl", None, 16)


SNAPSHOT = {
    "backend": {"type": "llamacpp", "url": "http://127.0.0.1:9931", "model": "smol", "ready": True,
                "hard_inject": {"enabled": True, "restores": 3, "restore_failures": 1, "saves": 2, "files": 2, "bytes_on_disk": 30_000_000}},
    "uptime_s": 120.0,
    "queue": {"waiting": 5, "running": 2, "swapped": 0, "max_batch_size": 2, "max_queue_size": 256, "oldest_wait_s": 1.5},
    "kv": {"estimated": True, "block_size": 16, "blocks_total": 256, "blocks_used": 64, "blocks_free": 192, "blocks_cached": 10,
           "usage_ratio": 0.25, "cpu_blocks_total": 0, "cpu_blocks_free": 0},
    "prefix_cache": {"enabled": True, "hit_tokens": 500, "query_tokens": 1000, "hit_ratio": 0.5},
    "requests": {"total": 40, "finished": 30, "failed": 2, "cancelled": 1, "rejected": {"queue_full": 3}, "prompt_tokens": 9000, "generation_tokens": 900},
    "preemption": {"preemptions": 0, "swap_outs": 0, "swap_ins": 0},
    "model_context": 2048,
    "recent": {"window_s": 60.0, "requests": 12, "ttft_p50_s": 0.25, "ttft_p90_s": 0.9, "e2e_p50_s": 1.2, "decode_tokens_per_s_p50": 88.0},
}


def test_status_renders_a_recorded_snapshot():
    console = Console(record=True, width=140, file=io.StringIO())
    history = status_cli.History()
    for used in (10, 40, 64):
        history.add(SNAPSHOT | {"kv": SNAPSHOT["kv"] | {"blocks_used": used}})
    console.print(status_cli.render(SNAPSHOT, history, "http://127.0.0.1:8080"))
    text = console.export_text()
    for expected in ("llamacpp", "ready", "2 / 2", "waiting 5", "64/256 used", "(estimated)", "hit ratio 50.0%",
                     "TTFT p50 250 ms", "2 failed", "queue_full 3", "3 restores", "1 failed", "history"):
        assert expected in text, expected
    assert status_cli.sparkline([0, 1, 2, 4]) == "▁▂▄█"
    assert "responses" not in text and "retained" not in text  # none stored, none retained: not shown
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(status_cli.render(SNAPSHOT | {"kv": SNAPSHOT["kv"] | {"blocks_retained": 6}}, None, "http://127.0.0.1:8080"))
    assert "10 cached (6 retained)" in console.export_text()
    # Hard inject's slot waits, and whether llama-server's own prompt cache is still trusted.
    assert "0 slot waits" in text and "runtime's cache" not in text  # a KVStream that does not report it
    missed = SNAPSHOT["backend"] | {"hard_inject": SNAPSHOT["backend"]["hard_inject"] | {"slot_waits": 4, "runtime_cache_trusted": False}}
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(status_cli.render(SNAPSHOT | {"backend": missed}, None, "http://127.0.0.1:8080"))
    text = console.export_text()
    assert "4 slot waits" in text and "runtime's cache missed: files restore" in text
    trusted = SNAPSHOT["backend"] | {"hard_inject": SNAPSHOT["backend"]["hard_inject"] | {"runtime_cache_trusted": True}}
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(status_cli.render(SNAPSHOT | {"backend": trusted}, None, "http://127.0.0.1:8080"))
    assert "runtime's cache trusted" in console.export_text()
    # Never on: why, not a row of zeros; turned off after failures: why, with its counters.
    never = SNAPSHOT["backend"] | {"hard_inject": {"enabled": False, "off_reason": "llama-server was started without --slot-save-path",
                                                   "restores": 0, "saves": 0, "slot_waits": 0, "runtime_cache_trusted": True}}
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(status_cli.render(SNAPSHOT | {"backend": never}, None, "http://127.0.0.1:8080"))
    text = console.export_text()
    assert "off  llama-server was started without --slot-save-path" in text and "restores" not in text and "cache trusted" not in text
    stopped = SNAPSHOT["backend"] | {"hard_inject": SNAPSHOT["backend"]["hard_inject"] | {
        "enabled": False, "off_reason": "5 restores in a row failed or did nothing"}}
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(status_cli.render(SNAPSHOT | {"backend": stopped}, None, "http://127.0.0.1:8080"))
    assert "off: 5 restores in a row failed or did nothing  3 restores" in console.export_text()


@pytest.mark.parametrize("width", [60, 80])
def test_status_on_a_narrow_terminal_moves_whole_parts_to_the_next_line(width):
    """Each row's value flows onto more lines under its own start; no part ("TTFT p50 250
    ms, p90 900 ms") is broken in two, and no line is wider than the terminal."""
    console = Console(record=True, width=width, file=io.StringIO())
    backend = {"type": "hf", "model": "SmolLM2-135M-Instruct", "ready": True, "device": "cpu", "dtype": "float32",
               "kv_dtype": "float32", "steps": 1234, "attention_backend": "native", "matmul_backend": "native",
               "weights": {"format": "dense", "resident_bytes": 538_060_288}}
    console.print(status_cli.render(SNAPSHOT | {"backend": backend}, None, "http://127.0.0.1:8080"))
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    for part in ("TTFT p50 250 ms, p90 900 ms", "e2e p50 1,200 ms", "decode p50 88 tok/s", "oldest wait 1.5s",
                 "64/256 used", "500 of 1,000 prompt tokens", "cpu float32, KV float32", "attention native",
                 "matmul native", "1,234 steps", "513 MB resident", "rejected queue_full 3", "● ready", "up 120s"):
        assert any(part in line for line in lines), (part, lines)
    value_column = lines[[i for i, line in enumerate(lines) if line.startswith("last 60s")][0]].index("12 requests")
    wrapped = [line for line in lines if line[:value_column].strip() == "" and line.strip()]
    assert wrapped and all(line[value_column] != " " for line in wrapped)  # continued under the value's start


def test_status_shows_the_stored_and_background_responses():
    console = Console(record=True, width=140, file=io.StringIO())
    snap = SNAPSHOT | {"responses": {"stored": 12, "bytes": 3 * 2**20, "running": 2, "evicted": 0},
                       "conversations": {"stored": 3, "bytes": 900, "evicted": 0}}
    console.print(status_cli.render(snap, None, "http://127.0.0.1:8080"))
    text = console.export_text()
    for expected in ("12 stored (3 MB)", "2 running in the background", "3 conversations"):
        assert expected in text, expected



def test_status_shows_the_replicas():
    console = Console(record=True, width=140, file=io.StringIO())
    backend = SNAPSHOT["backend"] | {"routing": "cache_aware", "replicas": [
        {"url": "http://a:1", "healthy": True, "in_flight": 1, "slots": 2, "requests": 12, "failures": 0},
        {"url": "http://b:2", "healthy": False, "in_flight": 0, "slots": 2, "requests": 3, "failures": 3},
    ]}
    console.print(status_cli.render(SNAPSHOT | {"backend": backend}, None, "http://127.0.0.1:8080"))
    text = console.export_text()
    for expected in ("replicas (cache_aware)", "http://a:1", "1 / 2 in flight", "12 requests", "http://b:2", "3 failures"):
        assert expected in text, expected


def test_status_shows_the_in_process_engine_and_its_streamed_weights():
    console = Console(record=True, width=160, file=io.StringIO())
    backend = {"type": "hf", "url": "in-process", "model": "./smollm2-awq", "ready": True, "device": "cpu", "dtype": "float32",
               "kv_dtype": "float32", "steps": 1234, "attention_backend": "native", "matmul_backend": "native",
               "prefill_pacing": {"step_ms": 500, "tokens_per_s": 312.4, "tokens_beside_decodes": 156},
               "weights": {"format": "awq", "kernel": "native", "mode": "partial_resident", "resident_bytes": 7_771_392,
                           "streamed_bytes": 49_600_512, "mapped_bytes": 56_623_104, "mapped_bytes_per_forward": 56_623_104,
                           "staging": "mapped", "keep_first_k": 2, "keep_last_k": 2, "bytes_staged_per_token": 49_600_512,
                           "stall_seconds_total": 0.25}}
    console.print(status_cli.render(SNAPSHOT | {"backend": backend}, None, "http://127.0.0.1:8080"))
    text = console.export_text()
    for expected in ("cpu float32, KV float32", "attention native", "matmul native", "1,234 steps", "awq (native kernel)",
                     "7 MB resident", "54 MB embeddings mapped", "partial_resident, mapped, K 2+2", "47 MB streamed a forward",
                     "47 MB a token", "stalls 0.25s", "paced to 500 ms steps while decoding", "156 prompt tokens a step",
                     "312 tok/s"):
        assert expected in text, (expected, text)
    dense = {"type": "hf", "model": "smol", "ready": True, "weights": {"format": "dense", "resident_bytes": 538_060_288}}
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(status_cli.render(SNAPSHOT | {"backend": dense}, None, ""))
    text = console.export_text()
    assert "dense" in text and "513 MB resident" in text and "streamed" not in text
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(status_cli.render(SNAPSHOT, None, ""))  # a proxied runtime: no engine rows
    assert "resident" not in console.export_text()


def test_status_unreachable_and_json(capsys):
    console = Console(record=True, width=100, file=io.StringIO())
    port = free_port()
    assert status_cli.run(f"http://127.0.0.1:{port}", False, 1, False, None, console) == 1
    assert "unreachable" in console.export_text()
    assert status_cli.run(f"http://127.0.0.1:{port}", False, 1, True, None, console) == 1
    assert "unreachable" in json.loads(capsys.readouterr().out)["error"]
    # --watch keeps retrying an unreachable proxy instead of failing.
    assert status_cli.run(f"http://127.0.0.1:{port}", True, 0.01, False, None, console, iterations=3) == 0


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_bench_compares_kvstream_with_llama_server_directly(llama_server, tmp_path):
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "kvstream.cli.main", "serve", "--backend", "llamacpp", "--backend-url", llama_server.url, "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        # Unknown model names get a 404 here (checked below) instead of the single model's fallback.
        env={**os.environ, "KVSTREAM_BACKEND__MODEL_FALLBACK": "false"},
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", proxy, what="kvstream serve")
        out = tmp_path / "bench.json"
        cmd = [sys.executable, "-m", "kvstream.cli.main", "bench", "--url", f"http://127.0.0.1:{port}", "--compare", llama_server.url,
               "--dataset", "prefix-repetition", "--num-prompts", "8", "--prompt-len", "64", "--output-len", "8",
               "--concurrency", "4", "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Serving Benchmark Result" in done.stdout
        result = json.loads(out.read_text())
        assert VLLM_KEYS <= set(result)
        assert result["completed"] == 8 and result["failed"] == 0 and result["compare"]["completed"] == 8
        assert result["total_output_tokens"] > 0 and result["mean_queue_ms"] is not None
        assert result["compare"]["mean_queue_ms"] is None  # llama-server sends no KVStream headers
        # Each server ran its own copy of the workload ([A] / [B] prompts): the same size in tokens.
        assert result["total_input_tokens"] == result["compare"]["total_input_tokens"]
        # Failures are reported, not hidden: an unknown model through KVStream is a 404 each time.
        bad = subprocess.run(cmd[:6] + ["--model", "no-such-model", "--num-prompts", "3", "--json", str(out)],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1
        assert json.loads(out.read_text())["errors"] == {"404": 3}
        status = subprocess.run([sys.executable, "-m", "kvstream.cli.main", "status", "--url", f"http://127.0.0.1:{port}", "--json"],
                                capture_output=True, text=True, timeout=30)
        assert json.loads(status.stdout)["requests"]["finished"] >= 8
    finally:
        proxy.terminate()
        proxy.wait(20)


def test_plot_draws_cdfs_and_ttft_per_turn(tmp_path):
    from kvstream.cli.bench import plot

    results = [RequestResult(True, 200, ttft=0.1 * (i % 5 + 1), latency=1.0 + 0.1 * i, turn=i % 3) for i in range(12)]
    out = tmp_path / "bench.png"
    plot(out, [("kvstream", results), ("direct", results[::2])], multi_turn=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
