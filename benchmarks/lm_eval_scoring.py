"""lm-evaluation-harness scores texts through ``kvstream serve --backend hf`` (its
``local-completions`` model: token-id prompts, ``echo``, ``logprobs``) and in-process with
its own transformers model (``HFLM``), on the same weights (SmolLM2-135M fp32), the same
requests and the same timer. Nobody here wrote either client: the scores must agree, and
the ratio is the time.

    pip install 'lm_eval[api]' && python benchmarks/lm_eval_scoring.py [--concurrency 8] [--client-batch 1] [--batch-size 8] [--rounds 4] [--repeats 3] [--few-shot 0]

Requests: multiple-choice items in HellaSwag's shape (a context, four endings, each scored as
``loglikelihood``: the sum of the ending tokens' log-probabilities and whether each was the
most likely) and ``loglikelihood_rolling`` over longer texts (a perplexity), the whole set
``--rounds`` times, each round's contexts behind a different one-line preamble (no two
requests are the same). ``--few-shot N`` puts N solved items before every question, the
shape of few-shot evaluation: a long prefix every request shares. KVStream keeps the scores
of the prompt blocks it has scored, as its prefix cache keeps their KV, so a shared prefix is
computed once; HFLM computes every request whole. lm-eval's
``local-completions`` sends ``--client-batch`` prompts per request, ``num_concurrent`` at once; ``HFLM``
runs its own batches (``--batch-size``, its best mode on this CPU; batch 1 once, for
reference). The two take turns ``--repeats`` times, each turn on requests of its own (so no
repeat finds the last one's prompts cached), and the ratio is the median of the per-turn
ratios: this machine is shared and its speed drifts. The server is idle while HFLM runs; both
use torch's default threads.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

from _util import PYTHON, free_port, spawn, stop, wait_http

os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's progress bars

CONTEXTS = [
    ("A man is standing on a ladder next to a house. He", [
        " begins to paint the window frame white.", " eats a sandwich made of clouds.",
        " turns into a bicycle and rides away.", " sings the alphabet to a cat."]),
    ("The chef cracks two eggs into a hot pan and", [
        " stirs them gently with a wooden spoon.", " throws the pan out of the window.",
        " reads a newspaper to the eggs.", " plants the shells in the garden."]),
    ("To change a flat tire, first loosen the lug nuts, then", [
        " raise the car with a jack.", " call the tire to apologize.",
        " paint the wheel bright blue.", " fill the trunk with water."]),
    ("The students open their notebooks as the teacher", [
        " writes the date on the board.", " flies out through the ceiling.",
        " melts into a puddle of ink.", " orders a pizza for the desks."]),
    ("She ties her running shoes, stretches her legs, and", [
        " starts jogging down the street.", " folds herself into an envelope.",
        " swims across the living room.", " knits a sweater for the road."]),
    ("The orchestra tunes their instruments while the conductor", [
        " raises his baton.", " bakes a loaf of bread.",
        " climbs into the piano.", " mows the concert hall."]),
    ("To make tea, boil the water, put a tea bag in a cup, and", [
        " pour the hot water over it.", " bury the cup in the yard.",
        " freeze the tea bag overnight.", " mail the water to a friend."]),
    ("The dog hears the doorbell ring and", [
        " runs barking to the door.", " answers the phone politely.",
        " starts doing the dishes.", " writes a letter to the mailman."]),
]

TEXTS = [
    "The river wound through the valley, past farms and quiet villages, until it reached the sea. "
    "Fishermen had lived along its banks for centuries, and every spring they repaired their boats "
    "and mended their nets before the first run of salmon. " * 3,
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n" * 2,
]


def few_shot_header(shots: int) -> str:
    """A few-shot header in lm-eval's way: ``shots`` solved items before each question."""
    if not shots:
        return ""
    examples = [context + endings[0] for context, endings in (CONTEXTS * 2)[:shots]]
    return "Finish each story in the most sensible way.\n\n" + "\n\n".join(examples) + "\n\n"


def requests(rounds: int, shots: int = 0, first_round: int = 0):
    from lm_eval.api.instance import Instance

    scored, rolling = [], []
    header = few_shot_header(shots)
    for r in range(first_round, first_round + rounds):
        preamble = f"{header}Story {r + 1}. "
        scored += [Instance("loglikelihood", {}, (preamble + context, ending), i)
                   for context, endings in CONTEXTS for i, ending in enumerate(endings)]
        rolling += [Instance("loglikelihood_rolling", {}, (preamble + text,), 0) for text in TEXTS]
    return scored, rolling


def timed(model, scored, rolling) -> tuple[float, list, list]:
    start = time.perf_counter()
    pairs = model.loglikelihood(scored, disable_tqdm=True)
    totals = model.loglikelihood_rolling(rolling, disable_tqdm=True)
    return time.perf_counter() - start, pairs, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8, help="local-completions' num_concurrent")
    parser.add_argument("--client-batch", type=int, default=1, help="local-completions' batch_size (prompts per request)")
    parser.add_argument("--batch-size", type=int, default=8, help="HFLM's batch size (batch 1 runs too)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="turns each system takes, on fresh requests")
    parser.add_argument("--few-shot", type=int, default=0, help="solved items before every question (shared by all)")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from lm_eval.models.huggingface import HFLM
        from lm_eval.models.openai_completions import LocalCompletionsAPI
    except ImportError:
        sys.exit("lm-evaluation-harness is not installed: pip install 'lm_eval[api]'")
    import torch
    from transformers import AutoTokenizer

    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu")  # the embedded model's plain folder (converted once, cached)
    folder = loaded.model.config._name_or_path
    del loaded
    scored, rolling = requests(args.rounds, args.few_shot)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = sum(len(tokenizer(i.args[0] + i.args[1]).input_ids) for i in scored)
    tokens += sum(len(tokenizer(i.args[0]).input_ids) for i in rolling)

    # Each repeat scores its own requests (other preambles): nothing one repeat computed is
    # cached for the next. The systems take turns within a repeat, so the machine's drift
    # (it is shared) reaches both; the ratio is taken per repeat and its median reported.
    sets = [requests(args.rounds, args.few_shot, first_round=k * args.rounds) for k in range(args.repeats)]
    scored, rolling = sets[0]
    hflm = HFLM(pretrained=folder, dtype="float32", batch_size=args.batch_size, device="cpu")
    timed(hflm, scored[:4], rolling[:1])  # warm
    port = free_port()
    proc = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--port", str(port)],
                 log=f"/tmp/kvstream-lm-eval-{port}.log")
    kv_runs, hf_runs = [], []
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=300, proc=proc)
        served = LocalCompletionsAPI(
            base_url=f"http://127.0.0.1:{port}/v1/completions", model="SmolLM2-135M-Instruct", tokenizer=folder,
            tokenizer_backend="huggingface", num_concurrent=args.concurrency, batch_size=args.client_batch,
            max_retries=1, timeout=600)
        timed(served, *requests(1, args.few_shot, first_round=10_000))  # warm the server's kernels
        for repeat_scored, repeat_rolling in sets:  # (the server idles while HFLM runs)
            kv_runs.append(timed(served, repeat_scored, repeat_rolling))
            hf_runs.append(timed(hflm, repeat_scored, repeat_rolling))
    finally:
        stop(proc)
    del hflm
    # Batch 1 once, for reference (HFLM's slowest mode).
    single = HFLM(pretrained=folder, dtype="float32", batch_size=1, device="cpu")
    timed(single, scored[:4], rolling[:1])
    single_seconds = timed(single, scored, rolling)[0]
    del single
    kv_pairs, kv_totals = kv_runs[0][1], kv_runs[0][2]
    ref_pairs, ref_totals = hf_runs[0][1], hf_runs[0][2]

    print(f"SmolLM2-135M fp32 on CPU, {torch.get_num_threads()} threads: {len(scored)} loglikelihood requests "
          f"({len(CONTEXTS)} items x 4 endings x {args.rounds}, {args.few_shot}-shot) + {len(rolling)} rolling texts, "
          f"{tokens} tokens scored, {args.repeats} repeats")
    pair_error = max(abs(a[0] - b[0]) for a, b in zip(kv_pairs, ref_pairs, strict=True))
    greedy_same = sum(a[1] == b[1] for a, b in zip(kv_pairs, ref_pairs, strict=True))
    rolling_error = max(abs(a - b) for a, b in zip(kv_totals, ref_totals, strict=True))

    def choices(pairs):
        return [max(range(4), key=lambda i, k=k: pairs[4 * k + i][0]) for k in range(len(pairs) // 4)]

    print(f"scores: max |loglikelihood difference| {pair_error:.2e}, is_greedy equal {greedy_same}/{len(scored)}, "
          f"rolling max difference {rolling_error:.2e}; endings chosen equal: {choices(kv_pairs) == choices(ref_pairs)} "
          f"(correct {sum(c == 0 for c in choices(kv_pairs))}/{len(kv_pairs) // 4})")
    kv_seconds = [run[0] for run in kv_runs]
    hf_seconds = [run[0] for run in hf_runs]
    ratios = sorted(h / k for h, k in zip(hf_seconds, kv_seconds, strict=True))
    name = f"local-completions -> kvstream serve --backend hf (c={args.concurrency}, batch {args.client_batch})"
    print(f"{'system':<66} {'seconds (median, per repeat)':>30}")
    print(f"{name:<66} {statistics.median(kv_seconds):>6.2f}  {' '.join(f'{t:.2f}' for t in kv_seconds)}")
    print(f"{'HFLM (transformers) batch ' + str(args.batch_size):<66} {statistics.median(hf_seconds):>6.2f}  "
          f"{' '.join(f'{t:.2f}' for t in hf_seconds)}")
    print(f"{'HFLM (transformers) batch 1 (first set, once)':<66} {single_seconds:>6.2f}")
    print(f"KVStream vs HFLM batch {args.batch_size}, same repeat: median {statistics.median(ratios):.2f}x "
          f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}x; > 1: KVStream faster)")


if __name__ == "__main__":
    sys.exit(main())
