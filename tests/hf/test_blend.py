"""Blend reuse of moved chunks on the real model: RoPE re-rotation is exact, repair measurably
helps, exact prefix hits are untouched, and approximate KV never enters the exact cache."""

from __future__ import annotations


from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf import compat  # noqa: E402
from kvstream.hf.attention import AttentionPlan  # noqa: E402
from kvstream.hf.blend import BlendParams, RotaryShift, find_moved_chunks  # noqa: E402
from kvstream.hf.model_runner import RunnerConfig, ModelRunner  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402

DOCS = [
    "Document A. The Rhine rises in the Swiss Alps, flows through Lake Constance and along the "
    "French-German border, and reaches the North Sea in the Netherlands after 1,230 kilometres.",
    "Document B. Photosynthesis turns light, water and carbon dioxide into glucose and oxygen; it "
    "happens in chloroplasts, whose chlorophyll absorbs mostly red and blue light.",
    "Document C. The Apollo 11 crew, Armstrong, Aldrin and Collins, launched on 16 July 1969; the "
    "lunar module Eagle landed in the Sea of Tranquility four days later.",
    "Document D. Rust's ownership rules give every value a single owner; borrowing lends access "
    "without moving it, and the borrow checker rejects dangling references at compile time.",
]


def engine_for(smollm2, **overrides) -> ModelRunner:
    config = dict(block_size=8, num_blocks=512, num_cpu_blocks=0, max_num_seqs=4, debug_invariants=True)
    config.update(overrides)
    return ModelRunner(smollm2[0], smollm2[2], RunnerConfig(**config))


def rag_prompt(tokenizer, order: list[int], question: str = "Question: when did Apollo 11 launch? Answer:") -> list[int]:
    return list(tokenizer("\n\n".join(DOCS[i] for i in order) + "\n\n" + question).input_ids)


def run(engine: ModelRunner, prompt: list[int], blend: BlendParams | None = None, max_tokens: int = 12):
    """(token ids, first-token logits, request) of one greedy generation."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    params.keep_first_logits = True
    events: list = []
    req = engine.add_request(Sequence(prompt, max_tokens), params, events.extend, blend=blend)
    while engine.has_work():
        engine.step()
    tokens = [e for e in events if e.kind == "token"]
    return [e.token_id for e in tokens], tokens[0].logits, req


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def test_keys_moved_by_rotation_equal_keys_computed_at_the_new_position(smollm2):
    """A chunk computed alone at position p, re-rotated to q, equals the chunk computed at q:
    in isolation its pre-rotation keys do not depend on where it sits, at any layer."""
    engine = engine_for(smollm2, block_size=16, num_blocks=8)
    ids = torch.tensor([list(smollm2[2](DOCS[0]).input_ids)[:32]])
    n = ids.shape[1]
    keys = []
    for blocks, offset in (([0, 1], 5), ([2, 3], 301)):
        plan = AttentionPlan.build(engine.cache, [(blocks, 0, n)], "sdpa")
        with torch.inference_mode():
            compat.forward_logits(engine.model, ids, torch.arange(offset, offset + n)[None], plan, torch.tensor([n - 1]))
        keys.append(engine.cache.k[:, blocks].reshape(engine.cache.k.shape[0], -1, *engine.cache.k.shape[3:])[:, :n].clone())
    moved = RotaryShift(engine.model).shift(keys[0], torch.full((n,), 301 - 5))
    assert torch.allclose(moved, keys[1], atol=2e-4, rtol=1e-4)
    assert not torch.allclose(keys[0], keys[1], atol=1e-2)  # the positions really differ


def test_moved_documents_are_found_at_any_alignment(smollm2):
    engine = engine_for(smollm2)
    tok = smollm2[2]
    run(engine, rag_prompt(tok, [0, 1, 2, 3]), max_tokens=1)  # computes and caches the documents
    prompt = rag_prompt(tok, [3, 1, 0, 2])
    plan = find_moved_chunks(engine.scheduler.bm.pool, prompt, 0, engine.config.block_size)
    assert plan.moved_tokens >= 0.6 * len(prompt)  # most of the documents, wherever they start
    for dst, slot, start in plan.copies:  # every copy really holds the same tokens
        block = engine.scheduler.bm.pool.blocks[slot // engine.config.block_size]
        assert tuple(prompt[dst : dst + engine.config.block_size]) == block.token_ids and block.start == start
    assert len(plan.run_starts) >= 3  # one seam per moved document at least


def test_repair_beats_no_repair_and_approximate_blocks_never_become_exact_hits(smollm2):
    tok = smollm2[2]
    warm_order, orders = [0, 1, 2, 3], [[3, 1, 0, 2], [2, 3, 1, 0], [1, 0, 3, 2]]
    kl_repaired, kl_moved_only, agree_repaired, agree_moved_only = [], [], [], []
    for order in orders:
        prompt = rag_prompt(tok, order)
        full_tokens, full_logits, _ = run(engine_for(smollm2, enable_prefix_caching=False), prompt)
        results = {}
        for ratio in (0.15, 0.0):
            engine = engine_for(smollm2)
            run(engine, rag_prompt(tok, warm_order), max_tokens=1)
            tokens, logits, req = run(engine, prompt, BlendParams(blend_ratio=ratio, min_tokens=16))
            assert req.moved_tokens > 0.4 * len(prompt), "the blend must really move the documents"
            results[ratio] = (tokens, logits)
            # The blended sequence's approximate blocks were not cached as exact: the same
            # prompt with exact reuse only hits blocks before the first moved token.
            again = run(engine, prompt, max_tokens=1)[2]
            assert req.approx_from is not None and again.seq.num_cached_tokens <= req.approx_from
        kl_repaired.append(kl(full_logits, results[0.15][1]))
        kl_moved_only.append(kl(full_logits, results[0.0][1]))
        agree_repaired.append(sum(a == b for a, b in zip(full_tokens, results[0.15][0])) / len(full_tokens))
        agree_moved_only.append(sum(a == b for a, b in zip(full_tokens, results[0.0][0])) / len(full_tokens))
    # Measured, not assumed perfect: repair must bring the first-token distribution closer.
    assert sum(kl_repaired) < sum(kl_moved_only), (kl_repaired, kl_moved_only)
    assert sum(agree_repaired) >= sum(agree_moved_only), (agree_repaired, agree_moved_only)


def test_exact_hits_are_untouched_by_blend(smollm2):
    tok = smollm2[2]
    prompt = rag_prompt(tok, [0, 1, 2, 3])
    expected = run(engine_for(smollm2, enable_prefix_caching=False), prompt)[0]
    engine = engine_for(smollm2)
    run(engine, prompt, max_tokens=1)
    tokens, _, req = run(engine, prompt, BlendParams(min_tokens=16))
    assert req.seq.num_cached_tokens >= len(prompt) - 8  # the whole prompt was an exact hit
    assert req.moved_tokens == 0 and engine.counters.blends == 0
    assert tokens == expected


def test_the_cost_model_skips_chunks_too_short_to_pay(smollm2):
    tok = smollm2[2]
    engine = engine_for(smollm2)
    run(engine, rag_prompt(tok, [0, 1, 2, 3]), max_tokens=1)
    _, _, req = run(engine, rag_prompt(tok, [3, 1, 0, 2]), BlendParams(min_tokens=10_000))
    assert req.moved_tokens == 0 and engine.counters.blends == 0
    engine.blend_costs.prefill_s_per_token = 1e-9  # recomputing is (said to be) free: never blend
    engine.blend_costs.move_s_per_token = 1.0
    _, _, req = run(engine, rag_prompt(tok, [2, 0, 3, 1]), BlendParams(min_tokens=16))
    assert req.moved_tokens == 0
