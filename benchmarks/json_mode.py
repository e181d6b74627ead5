"""What JSON output costs the in-process engine: the same prompts generated with
``response_format`` ``json_object`` (JSON mode) and ``json_schema`` (a structured output),
as a forced tool call (``tool_choice`` naming a function: its call's schema), under a GBNF
JSON grammar (llama-server's ``grammar``), waiting for a model's own call to begin (the lazy
hold of a Hermes ``<tool_call>``, call_grammar.py, which these answers never open: what the
wait costs), as a call in Qwen3-Coder's XML (that syntax's hold, from the first token: raw
string values, typed ones), and without, the same number of tokens each, same run.

    python benchmarks/json_mode.py [--concurrency 1 8] [--new-tokens 128] [--rounds 3] [--modes ...]

For each concurrency c and each mode, c chats asking for JSON are generated greedily under
the constraint (the answer ends where the object closes, or at --new-tokens); then the same
prompts run unconstrained with ``ignore_eos`` for exactly as many tokens as the constrained
run produced for each, so both do the same forwards and only the constrained choice
differs. The ratio is unconstrained time / constrained time (1.0: free). Best of --rounds
per side. Also prints how many answers parse (as a JSON object; as the schema's object).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvstream.hf.call_grammar import call_hold  # noqa: E402
from kvstream.hf.grammar import gbnf_pattern  # noqa: E402
from kvstream.hf.json_schema import compile_schema  # noqa: E402
from kvstream.hf.loader import chat_token_ids, load_model  # noqa: E402
from kvstream.hf.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.hf.pattern_constraint import compile_pattern  # noqa: E402
from kvstream.hf.tool_call_syntax import CallReading  # noqa: E402
from kvstream.hf.tool_calls import forced_call_schema  # noqa: E402
from pattern_matching import JSON_GRAMMAR  # noqa: E402

# A structured output of the kind apps ask for (nested objects, arrays, an enum, a nullable).
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "kind": {"enum": ["animal", "place", "thing"]},
        "facts": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "value": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}},
        "verified": {"type": "boolean"},
    },
}

# A tool of the kind agents call; a forced call naming it holds the answer to its arguments schema.
TOOL = {"type": "function", "function": {"name": "search_products", "parameters": {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 40}, "category": {"enum": ["books", "electronics", "food", "clothing"]},
    "max_price": {"type": "number"}, "in_stock": {"type": "boolean"}}}}}
TOOL_SCHEMA = forced_call_schema([TOOL], {"type": "function", "function": {"name": "search_products"}})

QUESTIONS = [
    "Describe a cat as JSON with its name, age and favourite food.",
    "Give three European capitals and their countries as a JSON object.",
    "A JSON object for a book: title, author, year.",
    "Return the weather in Paris as JSON.",
    "List two programming languages with their creators, as JSON.",
    "A JSON object describing a car.",
    "Summarize the plot of Hamlet as JSON with keys characters and ending.",
    "Make a JSON shopping list with quantities.",
]


MODES = ("json_object", "json_schema", "tool_call", "grammar", "lazy_wait", "xml_call")


def timed(engine: ModelRunner, prompts: list[list[int]], params: list[SamplingParams], rounds: int) -> tuple[float, list[list[int]]]:
    best, outs = float("inf"), []
    for _ in range(rounds):
        start = time.perf_counter()
        outs = engine.generate_sync(prompts, params)
        best = min(best, time.perf_counter() - start)
    return best, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    loaded = load_model(None, device="cpu")
    tokenizer = loaded.tokenizer
    engine = ModelRunner(loaded.model, tokenizer, RunnerConfig(
        block_size=16, num_blocks=2048, num_cpu_blocks=0, max_num_seqs=max(args.concurrency), enable_prefix_caching=False))
    print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, attention {engine.attention.name}, greedy, "
          f"up to {args.new_tokens} tokens, best of {args.rounds}")
    print(f"{'mode':>12} {'c':>3} {'tokens':>7} {'constrained ms/tok':>19} {'plain ms/tok':>13} {'plain/constrained':>18} {'parsed':>9}")
    grammar = gbnf_pattern(JSON_GRAMMAR)
    patterns = {"json_schema": compile_schema(SCHEMA), "tool_call": compile_schema(TOOL_SCHEMA), "grammar": compile_pattern(grammar)}
    hold = call_hold(CallReading("hermes"), [TOOL], None, {})
    xml = call_hold(CallReading("qwen3_xml", single_call=True), [TOOL], None, {})  # held from the first token: a call
    patterns["xml_call"] = compile_pattern(xml.pattern)
    modes = {"json_object": {"json_object": True}, "json_schema": {"json_schema": SCHEMA}, "tool_call": {"json_schema": TOOL_SCHEMA},
             "grammar": {"pattern": grammar}, "lazy_wait": {"pattern": hold.pattern, "triggers": hold.triggers},
             "xml_call": {"pattern": xml.pattern}}
    modes = {mode: modes[mode] for mode in args.modes}
    for c in args.concurrency:
        chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(c)]
        prompts = [chat_token_ids(tokenizer, chat) for chat in chats]
        for mode, fields in modes.items():
            constrained = [SamplingParams(max_tokens=args.new_tokens, temperature=0, **fields) for _ in prompts]
            constrained_s, outs = timed(engine, prompts, constrained, args.rounds)
            counts = [len(o) for o in outs]
            plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in counts]
            plain_s, plain_outs = timed(engine, prompts, plain, args.rounds)
            assert [len(o) for o in plain_outs] == counts
            texts = [tokenizer.decode(out, skip_special_tokens=True) for out in outs]
            if mode == "lazy_wait":  # free text: the same tokens as unheld greedy, and no hold begun
                parsed = sum(out == plain_out[: len(out)] for out, plain_out in zip(outs, plain_outs, strict=True))
            else:
                parsed = sum(patterns[mode].fullmatch(t) is not None if mode in patterns else _is_object(t) for t in texts)
            tokens = sum(counts)
            print(f"{mode:>12} {c:>3} {tokens:>7} {constrained_s / tokens * 1000:>19.2f} {plain_s / tokens * 1000:>13.2f} "
                  f"{plain_s / constrained_s:>18.2f} {parsed:>4} of {c}")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


if __name__ == "__main__":
    main()
