"""What holding an answer to an expression costs per token as the answer grows: the
incremental machine (pattern_machine.py, the default) against asking the ``regex`` module
about the whole text again (``PatternConstraint(..., incremental=False)``, the way before
it), same answers, same tokenizer, same run.

    python benchmarks/pattern_matching.py [--bytes 256 1024 4096 8192] [--tokens 8]

Three expressions: a GBNF JSON grammar (recursive, as llama-server's clients send), a JSON
schema's (an array of objects, as structured outputs send) and JSON mode's (any object, at
any depth: the array under one key). The answer is a valid JSON text of the expression,
tokenized by SmolLM2's tokenizer; the constraint walks it token by token.
At each checkpoint (answer bytes so far) it times, with the machine's remembered steps
dropped first (cold; a server asked the same schema again remembers them), over the next
--tokens tokens:
  step   accepts(the next token) + advance: the cost when the model's first choice holds;
  mask   candidates(vocabulary): the cost when it is refused and the sampler asks which
         tokens may come (up to 256 prefix questions the regex module's way).
Printed: ms per token each way and the ratio regex / machine (above 1: the machine is
faster). Both ways must accept every token of the answer (asserted).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream.hf.grammar import gbnf_pattern  # noqa: E402
from kvstream.hf.json_schema import JSON_OBJECT, compile_schema  # noqa: E402
from kvstream.hf.loader import load_model  # noqa: E402
from kvstream.hf.pattern_constraint import PatternConstraint, compile_pattern  # noqa: E402
from kvstream.hf.token_bytes import TokenBytes, first_byte_mask  # noqa: E402

# JSON as a GBNF grammar, recursive through value (written for this benchmark from RFC 8259).
JSON_GRAMMAR = r'''
root    ::= value
value   ::= object | array | string | number | "true" | "false" | "null"
object  ::= "{" ws ( member ( "," ws member )* )? "}" ws
member  ::= string ":" ws value
array   ::= "[" ws ( value ( "," ws value )* )? "]" ws
string  ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number  ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )? ws
ws      ::= [ \t\n]*
'''

ITEMS_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "price": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
    "in_stock": {"type": "boolean"}}}}


def answer(size: int) -> str:
    """A JSON array of product objects, at least ``size`` bytes, valid for both expressions."""
    items, text = [], "[]"
    while len(text.encode()) < size:
        i = len(items)
        items.append({"name": f"Product n\u00b0{i} \u2014 caf\u00e9", "price": round(3.5 * i + 0.99, 2),
                      "tags": ["kitchen", f"batch-{i % 7}"], "in_stock": i % 3 != 0})
        text = json.dumps(items, ensure_ascii=False)
    return text


def walk(constraint: PatternConstraint, tokens: list[int], checkpoints: list[int], spell, vocab: int, per: int):
    """(checkpoint bytes, step ms per token, mask ms) along the answer."""
    results, done_bytes, i = [], 0, 0
    for point in checkpoints:
        while i < len(tokens) and done_bytes < point:
            assert constraint.accepts(tokens[i]), (i, spell(tokens[i]))
            constraint.advance(tokens[i])
            done_bytes += len(spell(tokens[i]))
            i += 1
        if i + per > len(tokens):
            break
        if constraint.machine is not None:
            constraint.machine.forget()  # timed cold: no step remembered from the answer so far
        probe = constraint.copy()
        start = time.perf_counter()
        probe.candidates(vocab)
        mask_ms = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        for token in tokens[i : i + per]:
            assert constraint.accepts(token)
            constraint.advance(token)
        step_ms = (time.perf_counter() - start) * 1000 / per  # (the mask's steps are remembered by now)
        done_bytes += sum(len(spell(t)) for t in tokens[i : i + per])
        i += per
        results.append((point, step_ms, mask_ms))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    parser.add_argument("--tokens", type=int, default=8, help="tokens timed at each checkpoint")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tokenizer = load_model(None, device="cpu").tokenizer
    spell = TokenBytes(tokenizer)
    vocab = len(tokenizer)
    first_byte_mask(spell, [], vocab)  # each token's first byte, read once for both ways
    array = answer(max(args.bytes) + 512)
    expressions = {"GBNF JSON grammar": (compile_pattern(gbnf_pattern(JSON_GRAMMAR)), array),
                   "JSON schema (array of objects)": (compile_schema(ITEMS_SCHEMA), array),
                   "JSON mode (any object)": (compile_schema(JSON_OBJECT), '{"items": ' + array + "}")}
    print(f"answer: {len(array.encode())} bytes; {args.tokens} tokens timed per checkpoint")
    for name, (pattern, text) in expressions.items():
        assert pattern.fullmatch(text), name
        tokens = tokenizer(text, add_special_tokens=False).input_ids
        machine = walk(PatternConstraint(pattern, spell, ()), tokens, args.bytes, spell, vocab, args.tokens)
        rescan = walk(PatternConstraint(pattern, spell, (), incremental=False), tokens, args.bytes, spell, vocab,
                      args.tokens)
        print(f"\n{name}")
        print(f"{'bytes':>7} {'step ms machine':>16} {'step ms regex':>14} {'ratio':>7} "
              f"{'mask ms machine':>16} {'mask ms regex':>14} {'ratio':>7}")
        for (point, m_step, m_mask), (_, r_step, r_mask) in zip(machine, rescan, strict=True):
            print(f"{point:>7} {m_step:>16.3f} {r_step:>14.3f} {r_step / m_step:>6.1f}x "
                  f"{m_mask:>16.3f} {r_mask:>14.3f} {r_mask / m_mask:>6.1f}x")


if __name__ == "__main__":
    main()
