"""A model's own tool calls (``tool_choice: "auto"``): the Hermes ``<tool_call>`` syntax,
Qwen3-Coder's XML in the same tags, Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``, Granite's
``<|tool_call|>`` and DeepSeek's tags read out of the text as it streams, in any split, and
end to end through the official clients with SmolLM2 under templates that show it each
syntax (tests/fixtures/*_tools.jinja)."""

from __future__ import annotations

import copy
import json
import keyword
from pathlib import Path

import pytest
import regex
from hypothesis import given
from hypothesis import strategies as st

from kvstream.hf.tool_call_syntax import (
    CallReading,
    JsonCallScanner,
    MarkedCallScanner,
    ToolCallScanner,
    call_syntax,
    template_messages,
)
from kvstream.hf.xml_calls import parameter_schemas, typed_value
from tests.hf.conftest import templated_proxy

FIXTURES = Path(__file__).parent.parent / "fixtures"
HERMES_TEMPLATE = (FIXTURES / "hermes_tools.jinja").read_text()
LLAMA3_TEMPLATE = (FIXTURES / "llama3_json_tools.jinja").read_text()
MISTRAL_TEMPLATE = (FIXTURES / "mistral_tools.jinja").read_text()
QWEN3_XML_TEMPLATE = (FIXTURES / "qwen3_xml_tools.jinja").read_text()
GRANITE_TEMPLATE = (FIXTURES / "granite_tools.jinja").read_text()
DEEPSEEK_TEMPLATE = (FIXTURES / "deepseek_tools.jinja").read_text()
PYTHONIC_TEMPLATE = (FIXTURES / "pythonic_tools.jinja").read_text()
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE,
             "qwen3_xml": QWEN3_XML_TEMPLATE, "granite": GRANITE_TEMPLATE, "pythonic": PYTHONIC_TEMPLATE}
WHOLE_CALLS = ("pythonic",)  # syntaxes whose calls go out whole, each once read (the others' arguments stream)

ANSWER = ('Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "parameters": {"timezone": "CET"}}\n</tool_call>\n')


def scan(text: str, step: int, scanner=None) -> list[tuple[str, dict | None]]:
    """The scanner's pieces for ``text`` fed ``step`` characters at a time, adjacent texts
    merged, and each call's deltas joined as a client joins them (the first carries the
    call's id and name, the others only more of its arguments)."""
    scanner, pieces = scanner or ToolCallScanner(), []
    for start in range(0, len(text), step):
        pieces += scanner.feed(text[start:start + step])
    pieces += scanner.finish()
    merged: list[tuple[str, dict | None]] = []
    for piece in pieces:
        if piece.call is None and merged and merged[-1][1] is None:
            merged[-1] = (merged[-1][0] + piece.text, None)
        elif piece.call is not None and "id" not in piece.call:
            call = merged[-1][1]
            assert call is not None and call["index"] == piece.call["index"] and set(piece.call) == {"index", "function"}
            call["function"]["arguments"] += piece.call["function"]["arguments"]
        else:
            merged.append((piece.text, copy.deepcopy(piece.call)))
    return merged


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 1000])
def test_calls_and_content_come_out_the_same_in_any_split(step):
    [(content, _), (_, first), (_, second)] = scan(ANSWER, step)
    assert content == "Let me look that up."  # the whitespace before a call is layout
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    assert json.loads(first["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert second["index"] == 1 and second["id"] != first["id"]
    assert second["function"] == {"name": "get_time", "arguments": '{"timezone": "CET"}'}  # "parameters" read too


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_text_that_only_looks_like_a_tag_is_content_unchanged(step):
    for text in ("Use <tool> or <tool_cal and <b>bold</b>.", "x < y <", "  indented\n\n", "a\n<tool_call>{not json}</tool_call> b",
                 '<tool_call>["a list"]</tool_call>'):
        assert scan(text, step) == [(text, None)], text


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_a_call_cut_short_is_partial_and_a_cut_tag_is_text(step):
    [(_, call)] = scan('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', step)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    [(_, call)] = scan('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', step)  # ended before its close tag
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    cut = 'Sure. <tool_call>\n{"name": "get_w'  # not even the name: the text as it was
    assert scan(cut, step) == [(cut, None)]


def sent_after_each(text: str, scanner) -> list[str]:
    """A call's arguments as a client has them after each character of ``text``."""
    joined, seen = "", []
    for char in text:
        for piece in scanner.feed(char):
            if piece.call is not None:
                joined += piece.call["function"]["arguments"]
        seen.append(joined)
    for piece in scanner.finish():
        joined += piece.call["function"]["arguments"] if piece.call else ""
    return seen + [joined]


def test_a_json_calls_arguments_stream_as_written_to_their_closing_brace():
    """Once the name is read and the arguments object has begun, its text goes out as it is
    written (braces and quotes inside strings followed), never the call's own closing brace."""
    arguments = '{"path": "a.py", "code": "def f():\\n    return {\\"x\\": [1, 2]}  # }", "opts": {"mode": [1, {}]}}'
    text = '<tool_call>\n{"name": "write_file", "arguments": ' + arguments + '}\n</tool_call>'
    seen = sent_after_each(text, ToolCallScanner())
    begins = text.index('"arguments": ') + len('"arguments": ')
    assert seen[begins] == "{"  # the header went out with the object's first character
    for at in range(begins, begins + len(arguments)):
        assert seen[at] == text[begins:at + 1]  # every character as it comes
    assert seen[-1] == arguments and json.loads(seen[-1])["opts"] == {"mode": [1, {}]}


def test_an_xml_calls_string_values_stream_and_typed_values_go_out_whole():
    text = ("<tool_call>\n<function=plan_trip>\n<parameter=days>\n12\n</parameter>\n<parameter=note>\n"
            "line one\nline </two>\n</parameter>\n</function>\n</tool_call>")
    seen = sent_after_each(text, xml_scanner())
    assert seen[text.index("<parameter=days>")] == ""  # nothing before its first parameter opens
    assert seen[text.index("\n</parameter>")] == "{"  # the call is certain once a parameter opens; 12 goes out whole
    assert all('"days"' not in part or '"days": 12' in part for part in seen)
    note = text.index("<parameter=note>\n") + len("<parameter=note>\n")
    assert seen[note + len("line one") - 1] == '{"days": 12, "note": "line one'
    def after(written: str) -> str:
        return seen[note + len(written) - 1]

    assert after("line one\nline </") == '{"days": 12, "note": "line one\\nline '  # "</" may close the value
    assert after("line one\nline </t") == '{"days": 12, "note": "line one\\nline '  # "</t" the call
    assert after("line one\nline </tw") == '{"days": 12, "note": "line one\\nline </tw'
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))
    assert json.loads(seen[-1]) == {"days": 12, "note": "line one\nline </two>"}


@pytest.mark.parametrize("step", [1, 1000])
def test_a_body_that_breaks_after_its_call_began_stands_as_far_as_it_went(step):
    """What went out cannot be taken back: a call whose body stops reading as one after its
    arguments began is a call cut short (streamed or not, the same)."""
    [(_, call)] = scan('<tool_call>{"name": "f", "arguments": {"x": 1} oops</tool_call>', step)
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    [(_, call)] = scan("<tool_call><function=f>\n<parameter=x>\n1\n</parameter>\nprose</function></tool_call>", step,
                       xml_scanner())
    assert call["function"] == {"name": "f", "arguments": '{"x": "1"'}
    # Never begun as a call (no arguments object, no parameter): the text as it was.
    for text in ('<tool_call>{"name": "f", "arguments": "x"} oops</tool_call>', "<tool_call><function=f> oops</tool_call>"):
        assert scan(text, step, xml_scanner()) == [(text, None)], text


def test_text_after_a_call_loses_its_leading_layout():
    assert [(text, call and call["function"]["name"]) for text, call in scan(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.', 3)] == [("", "f"), ("Done.", None)]
    # Nothing but a call: no content at all.
    assert [call is not None for _, call in scan('\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n', 1)] == [True]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_llama3_answer_that_is_json_is_read_as_its_calls(step):
    [(_, call)] = scan(' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', step, JsonCallScanner())
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    two = scan('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', step, JsonCallScanner())
    assert [(c["index"], c["function"]["name"]) for _, c in two] == [(0, "a"), (1, "b")]
    [(_, cut)] = scan('{"name": "get_weather", "parameters": {"city": "Pa', step, JsonCallScanner())
    assert cut["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    # Text, JSON that is not a call, a call cut before its name: text as it was.
    for text in ("The answer is {4}.", '{"answer": 4}', '{"name": "get_w', '{"name": "f", "parameters": "x"} no',
                 "<|python", "  4"):
        assert scan(text, step, JsonCallScanner()) == [(text, None)], text
    # A call with text after it: once its parameters began it is a call (it streamed); the text is content.
    [(_, call), (rest, _)] = scan('{"name": "f", "parameters": {"x": [1]}} and more', step, JsonCallScanner())
    assert call["function"] == {"name": "f", "arguments": '{"x": [1]}'} and rest == "and more"


def test_a_llama3_calls_parameters_stream_as_written():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    seen = sent_after_each(text, JsonCallScanner())
    begins = text.index('"parameters": ') + len('"parameters": ')
    assert seen[begins - 1] == "" and seen[begins] == "{"
    assert seen[begins + len('{"city": "Par') - 1] == '{"city": "Par' and seen[-1] == '{"city": "Paris", "days": 3}'


def test_llama3_calls_joined_by_semicolons_each_stream_as_written():
    """The second call's id and name go out once its parameters begin, and its arguments as
    they are written, before the answer ends (they were read at the end)."""
    scanner = JsonCallScanner()
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"city": "Paris"}}'
    second = text.index('{"name": "b"')
    pieces = [(at, piece) for at, char in enumerate(text) for piece in scanner.feed(char)]
    firsts = [(at, piece.call["function"]["name"]) for at, piece in pieces if piece.call and "id" in piece.call]
    assert firsts[0] == (text.index('{"x"'), "a") and firsts[1][1] == "b" and second < firsts[1][0] < len(text) - 1

    def second_arguments(until: int) -> str:
        return "".join(p.call["function"]["arguments"] for at, p in pieces if p.call and p.call["index"] == 1 and at <= until)

    assert second_arguments(text.index("Paris") + 1) == '{"city": "Pa'
    assert second_arguments(len(text) - 2) == '{"city": "Paris"}'  # whole before the call's own closing brace
    assert not [p for p in scanner.finish() if p.text]
    # A first object whose parameters are no object is a call only when no prose follows it.
    calls = scan('{"name": "a", "parameters": "x"}; {"name": "b", "parameters": {}}', 1, JsonCallScanner())
    assert [(c["index"], c["function"]["name"]) for _, c in calls] == [(0, "a"), (1, "b")]
    # Prose where a later call should be: content, the calls before it kept.
    [(_, first), (rest, _)] = scan('{"name": "a", "parameters": {}}; then I stop', 2, JsonCallScanner())
    assert first["function"]["name"] == "a" and rest == "then I stop"


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_mistral_calls_after_the_mark_in_either_form(step):
    listed = scan('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', step, MarkedCallScanner())
    marked = scan('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', step, MarkedCallScanner())
    for calls in (listed, marked):
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for _, c in calls] == [
            (0, "a", {"x": 1}), (1, "b", {})]
    [(text, _), (_, call)] = scan('Checking. [TOOL_CALLS][{"name": "f", "arguments": {}}]', step, MarkedCallScanner())
    assert text == "Checking." and call["function"]["name"] == "f"
    [(_, cut)] = scan('[TOOL_CALLS]f[ARGS]{"x": "Pa', step, MarkedCallScanner())
    assert cut["function"] == {"name": "f", "arguments": '{"x": "Pa'}
    for text in ("Plain [TOOL answer.", "[TOOL_CALLS] not a call", '[TOOL_CALLS] [{"name": "f", "argu'):
        assert scan(text, step, MarkedCallScanner()) == [(text, None)], text


def test_marked_calls_stream_as_written_in_either_form():
    """After the mark, each call's arguments go out as the model writes them: a JSON list's
    elements one after another (Mistral v0.3, Granite), or ``name[ARGS]{...}`` per mark."""
    code = '{"path": "a.py", "code": "x = [1, {\\"k\\": \\"]\\"}]"}'
    listed = '[TOOL_CALLS] [{"name": "write", "arguments": ' + code + '}, {"name": "b", "arguments": {"y": 2}}]'
    marked = "[TOOL_CALLS]write[ARGS]" + code + '[TOOL_CALLS]b[ARGS]{"y": 2}'
    for text in (listed, marked):
        scanner = MarkedCallScanner()
        seen = sent_after_each(text, scanner)
        begins = text.index(code)
        assert seen[begins - 1] == "" and seen[begins] == "{"
        for at in range(begins, begins + len(code)):
            written = text[begins:at + 1]  # every character as it comes (in the marked form, less a "[" that may begin a mark)
            assert seen[at] in (written, written.removesuffix("[") if text is marked else written)
        assert seen[-1] == code + '{"y": 2}' and scanner.calls == 2  # (both calls' arguments, joined)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_what_follows_marked_calls_or_breaks_them_is_content(step):
    [(_, call), (rest, _)] = scan('[TOOL_CALLS][{"name": "f", "arguments": {}}]\nThat is all.', step, MarkedCallScanner())
    assert call["function"] == {"name": "f", "arguments": "{}"} and rest == "That is all."
    [(_, call), (rest, _)] = scan('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"not": "a call"}]', step, MarkedCallScanner())
    assert call["function"]["arguments"] == '{"x": 1}' and rest == '{"not": "a call"}]'  # what went out stands
    [(_, a), (_, b)] = scan('[TOOL_CALLS][{"arguments": {"x": 1}, "name": "a"}, {"name": "b", "arguments": "{}"}]', step,
                            MarkedCallScanner())
    assert (a["function"], b["function"]) == ({"name": "a", "arguments": '{"x": 1}'}, {"name": "b", "arguments": "{}"})


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_granite_calls_after_its_mark(step):
    granite = CallReading("granite").scanner
    [(text, _), (_, a), (_, b)] = scan('Let me see. <|tool_call|>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", '
                                       '"arguments": {}}]', step, granite())
    assert text == "Let me see." and [(c["index"], c["function"]["name"]) for c in (a, b)] == [(0, "a"), (1, "b")]
    for text in ("Use <|tool", "<|tool_call|> no list", "[TOOL_CALLS] [] is Mistral's"):
        assert scan(text, step, granite()) == [(text, None)], text


CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP = (
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")


def deepseek_v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def deepseek_scanner() -> ToolCallScanner:
    return CallReading("deepseek").scanner()


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_deepseek_calls_in_v3s_fenced_form_and_v31s_bare_one(step):
    """DeepSeek-V3 / R1 write ``function<sep>name``, then the arguments in a JSON fence;
    V3.1 ``name<sep>{...}``: both read, the marks around the calls neither content nor call."""
    v3 = (f"Let me check.\n{CALLS_BEGIN}" + deepseek_v3_call("get_weather", '{"city": "Paris"}') + "\n"
          + deepseek_v3_call("get_time", '{"zone": "CET", "opts": {"h24": true}}') + CALLS_END)
    v31 = f'Let me check.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Paris"}}{CALL_END}{CALL_BEGIN}get_time{SEP}' \
          f'{{"zone": "CET", "opts": {{"h24": true}}}}{CALL_END}{CALLS_END}'
    for text in (v3, v31):
        [(content, _), (_, a), (_, b)] = scan(text, step, deepseek_scanner())
        assert content == "Let me check."
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in (a, b)] == [
            (0, "get_weather", '{"city": "Paris"}'), (1, "get_time", '{"zone": "CET", "opts": {"h24": true}}')]
        assert a["id"] != b["id"] and a["type"] == "function"
    # Text after the calls is content; a call alone leaves none.
    assert [(t, c and c["function"]["name"]) for t, c in scan(
        CALLS_BEGIN + deepseek_v3_call("f", "{}") + CALLS_END + "\nDone.", step, deepseek_scanner())] == [("", "f"), ("Done.", None)]
    assert [c is not None for _, c in scan(CALLS_BEGIN + deepseek_v3_call("f", "{}") + CALLS_END, step, deepseek_scanner())] == [True]


def test_a_deepseek_calls_arguments_stream_as_written_and_never_its_fence():
    arguments = '{"path": "a.py", "code": "x = {\\"k\\": [1]}\\n"}'
    text = CALLS_BEGIN + deepseek_v3_call("write_file", arguments) + CALLS_END
    seen = sent_after_each(text, deepseek_scanner())
    begins = text.index("```json\n") + len("```json\n")
    assert seen[begins - 1] == "" and seen[begins] == "{"  # certain once the object opens
    for at in range(begins, begins + len(arguments)):
        written = text[begins:at + 1]
        assert seen[at] in (written, written.rstrip())  # (whitespace between values: with what follows it)
    assert seen[-1] == arguments and json.loads(seen[-1])["code"] == 'x = {"k": [1]}\n'


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_deepseek_calls_cut_short_and_bodies_that_are_not_calls(step):
    [(_, cut)] = scan(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"city": "Pa', step, deepseek_scanner())
    assert cut["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}  # as far as it went
    [(_, unclosed)] = scan(CALL_BEGIN + "function" + SEP + 'f\n```json\n{"x": 1\n```' + CALL_END, step, deepseek_scanner())
    assert unclosed["function"] == {"name": "f", "arguments": '{"x": 1'}  # never closed: as far as it went, less the fence
    for text in ("Plain <｜tool answer.", CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_wea",
                 CALL_BEGIN + "no separator" + CALL_END, CALL_BEGIN + "function" + SEP + "f\nnot fenced" + CALL_END):
        assert scan(text, step, deepseek_scanner()) == [(text, None)], text


def pythonic_scanner():
    return CallReading("pythonic").scanner()


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_pythonic_calls_are_read_as_python_literals_in_any_split(step):
    text = ('[get_weather(city="Paris", days=3), get_time(zone=\'CET\', opts={"h24": True, "x": None, "t": (1, 2.5)}), '
            'ns.tool(s="a)b]c\\"d", t=\'it\\\'s\')]')
    calls = [call for _, call in scan(text, step, pythonic_scanner())]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris", "days": 3}), (1, "get_time", {"zone": "CET", "opts": {"h24": True, "x": None, "t": [1, 2.5]}}),
        (2, "ns.tool", {"s": 'a)b]c"d', "t": "it's"})]
    assert len({c["id"] for c in calls}) == 3
    # Llama 4's wrapper; text after the list is content.
    [(_, call)] = scan("<|python_start|>[f(x=1)]<|python_end|>", step, pythonic_scanner())
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    [(_, call), (rest, _)] = scan("[f()]\nDone.", step, pythonic_scanner())
    assert call["function"] == {"name": "f", "arguments": "{}"} and rest == "Done."


def test_a_pythonic_call_goes_out_the_moment_its_parenthesis_closes():
    text = '[a(x="1"), b(y=[2])]'
    scanner, sent = pythonic_scanner(), []
    for at, char in enumerate(text):
        sent += [(at, piece.call["function"]["name"]) for piece in scanner.feed(char) if piece.call]
    assert sent == [(text.index(")"), "a"), (text.rindex(")"), "b")] and not scanner.finish()


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_what_does_not_read_as_a_pythonic_call_is_text(step):
    for text in ("The answer is [4].", "[4, 5]", "[f(x=y)]", "[f(1)]", '[f(x=float("nan"))]', "[f(x={1, 2})]", "[f(**kw)]",
                 '[get_weather(city="Par', "[(lambda: 1)()]", "  [", "<|python_start|>"):
        assert scan(text, step, pythonic_scanner()) == [(text, None)], text
    # Prose that opens with "[" goes out as soon as it cannot be a call, not at the end.
    for prose, known in (("[1] Smith et al.", "[1"), ("[Note that x]", "[Note "), ("[a] b", "[a]")):
        scanner = pythonic_scanner()
        assert "".join(piece.text for piece in scanner.feed(known)) == known, prose
        assert "".join(piece.text for piece in scanner.feed(prose[len(known):]) + scanner.finish()) == prose[len(known):]
    # After a call that went out: the rest as written.
    [(_, call), (rest, _)] = scan('[a(x=1), b(y="cu', step, pythonic_scanner())
    assert call["function"]["name"] == "a" and rest == 'b(y="cu'
    [(_, call), (rest, _)] = scan("[a(x=1), b(y=z)]", step, pythonic_scanner())
    assert call["function"]["name"] == "a" and rest == "b(y=z)]"


SCHEMA_TOOLS = [{"type": "function", "function": {"name": "plan_trip", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": "number"}, "direct": {"type": "boolean"},
    "stops": {"type": "array"}, "prefs": {"type": "object"}, "note": {"type": ["string", "null"]},
    "zip": {"type": "string"}, "rooms": {"type": ["integer", "null"]}}}}}]
XML_ANSWER = ("I will plan it.\n\n<tool_call>\n<function=plan_trip>\n<parameter=city>\nSão Paulo\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=budget>\n1250.5\n</parameter>\n<parameter=direct>\nTrue\n</parameter>\n"
              '<parameter=stops>\n["Rio", "Santos"]\n</parameter>\n<parameter=prefs>\n{"hotel": "quiet"}\n</parameter>\n'
              "<parameter=note>\nfirst line\n  second line\n</parameter>\n<parameter=zip>\n01310\n</parameter>\n"
              "<parameter=rooms>\nnull\n</parameter>\n<parameter=extra>\n5\n</parameter>\n</function>\n</tool_call>\n")


def xml_scanner() -> ToolCallScanner:
    return CallReading("qwen3_xml", schemas=parameter_schemas(SCHEMA_TOOLS)).scanner()


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_qwen3_xml_calls_are_typed_by_the_tools_schema_in_any_split(step):
    """Each value is raw text: its JSON type comes from the tool's schema; a parameter the
    schema does not list stays a string (as vLLM's qwen3_coder parser reads them)."""
    [(content, _), (_, call)] = scan(XML_ANSWER, step, xml_scanner())
    assert content == "I will plan it." and call["index"] == 0 and call["function"]["name"] == "plan_trip"
    assert json.loads(call["function"]["arguments"]) == {
        "city": "São Paulo", "days": 3, "budget": 1250.5, "direct": True, "stops": ["Rio", "Santos"],
        "prefs": {"hotel": "quiet"}, "note": "first line\n  second line", "zip": "01310", "rooms": None, "extra": "5"}
    two = scan("<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n<parameter=x>\n1\n"
               "</parameter>\n</function>\n</tool_call>", step, xml_scanner())
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for _, c in two] == [(0, "a", "{}"), (1, "b", '{"x": "1"}')]


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_qwen3_xml_cut_short_bodies_that_are_not_calls_and_json_in_the_tags(step):
    [(_, cut)] = scan("<tool_call>\n<function=plan_trip>\n<parameter=days>\n4\n</parameter>\n<parameter=city>\nSão P",
                      step, xml_scanner())
    assert json.loads(cut["function"]["arguments"]) == {"days": 4, "city": "São P"}  # as far as it went
    [(_, cut)] = scan("<tool_call>\n<function=f>\n<parameter=x>\n1\n</param", step, xml_scanner())
    assert cut["function"]["arguments"] == '{"x": "1"}'  # less the close tag's start
    for text in ("<tool_call>\n<function=plan_tr", "<tool_call>\n<function=f>\nprose inside\n</function>\n</tool_call>",
                 "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>"):
        assert scan(text, step, xml_scanner()) == [(text, None)], text
    [(_, forgiven)] = scan("<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</tool_call>", step, xml_scanner())
    assert forgiven["function"] == {"name": "f", "arguments": '{"x": "1"}'}  # no </function>: still the call
    [(_, call)] = scan('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', step, xml_scanner())
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}  # the JSON form in the same tags


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_qwen3_xml_call_without_its_tool_call_tags_is_read_too(step):
    """Qwen3-Coder writes a bare ``<function=...>`` at times (vLLM reads it): a call; a
    mention of the tag in prose that holds no call stays text."""
    text = "Writing it.\n<function=plan_trip>\n<parameter=days>\n2\n</parameter>\n</function>\nDone."
    [(before, _), (_, call), (after, _)] = scan(text, step, xml_scanner())
    assert (before, after) == ("Writing it.", "Done.") and call["function"] == {"name": "plan_trip", "arguments": '{"days": 2}'}
    for prose in ("Use <function=name> tags.", "Use <function=name> and </function>.", "a <functio"):
        assert scan(prose, step, xml_scanner()) == [(prose, None)], prose
    assert scan("<function=plan_trip>\n<parameter=city>\nRo", step, xml_scanner())[0][1]["function"]["arguments"] == '{"city": "Ro"}'


def test_tools_that_are_not_functions_with_properties_give_no_schema():
    """Whatever a client sends as tools, the XML reading gets a schema per named function
    (none where its parameters list none) and never fails on the rest."""
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"properties": {"x": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "bare"}}, {"type": "function", "function": {"name": "odd", "parameters": []}},
             {"type": "function", "function": {"parameters": {}}}, {"function": "not an object"}, "a string", None, 7]
    assert parameter_schemas(tools) == {"ok": {"x": {"type": "integer"}}, "bare": {}, "odd": {}}
    assert parameter_schemas("not a list") == {} and parameter_schemas(None) == {}
    reading = CallReading("qwen3_xml", schemas=parameter_schemas(tools))
    [(_, call)] = scan("<tool_call><function=bare><parameter=x>1</parameter></function></tool_call>", 3, reading.scanner())
    assert call["function"] == {"name": "bare", "arguments": '{"x": "1"}'}


def test_a_value_that_does_not_read_as_its_type_stays_text():
    for text, schema in (("three", {"type": "integer"}), ("2.5", {"type": "integer"}), ("yes", {"type": "boolean"}),
                         ("[1, 2", {"type": "array"}), ('{"a": 1}', {"type": "array"}), ("true", {"type": "number"}),
                         ("null", {"type": "string"}), ("42", None), ("42", {"description": "no type"}),
                         ("NaN", {"type": "number"}), ("-Infinity", {"type": "number"})):
        assert typed_value(text, schema) == text, (text, schema)
    assert typed_value("2.0", {"type": "integer"}) == 2 and typed_value(" FALSE ", {"type": "boolean"}) is False
    assert typed_value("7", {"type": "any-other"}) == 7  # a type it does not know: JSON if it reads


def test_the_syntax_is_read_where_the_template_shows_it():
    assert {name: call_syntax(template) for name, template in TEMPLATES.items()} == {name: name for name in TEMPLATES}
    assert call_syntax({"default": "plain", "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert call_syntax("{{ messages }}") is None and call_syntax(None) is None


def test_earlier_calls_reach_the_template_with_object_arguments():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the client's copy untouched
    odd = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    assert template_messages([{"role": "assistant", "tool_calls": [odd]}])[0]["tool_calls"][0] == odd


# ------------------------------------------------------------- end to end, SmolLM2 under the template
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
# One worked example in the history is enough for SmolLM2 to answer in each syntax (greedy).
EXAMPLE = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}]},
]
ASK = EXAMPLE + [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(params=list(TEMPLATES))
async def tools_proxy(request, smollm2, start_proxy):
    """The engine's SmolLM2 behind the proxy, its tokenizer's template swapped for one showing
    a tool-call syntax (each test runs under both)."""
    async with templated_proxy(smollm2, start_proxy, TEMPLATES[request.param]) as served:
        yield served


@pytest.fixture
async def tools_oa(tools_proxy):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=tools_proxy[0].v1, api_key="unused", max_retries=0) as client:
        yield client


async def test_the_models_own_call_comes_back_as_tool_calls(tools_oa, request):
    reply = await tools_oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")

    # Streamed: the call's id and name first, then its arguments as they are written (a
    # pythonic call: whole, once read), no content.
    stream = await tools_oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=40,
                                                     temperature=0, stream=True, logprobs=True)
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    first, *more = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert first.id.startswith("call_") and first.function.name == "get_weather" and first.index == 0
    assert all(m.id is None and m.function.name is None and m.index == 0 for m in more)
    assert first.function.arguments + "".join(m.function.arguments for m in more) == call.function.arguments
    assert not more if request.node.callspec.params["tools_proxy"] in WHOLE_CALLS else len(more) >= 3
    assert not any(d.content for d in deltas) and chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_the_openai_clients_stream_helper_sees_the_arguments_grow(tools_oa, request):
    """The official client's own stream accumulator (``chat.completions.stream``): its
    argument-delta events arrive piece by piece, and its final completion holds the call."""
    async with tools_oa.chat.completions.stream(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=40,
                                                temperature=0) as stream:
        pieces = [event.arguments_delta async for event in stream if event.type == "tool_calls.function.arguments.delta"]
        final = await stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert "".join(pieces) == call.function.arguments and final.choices[0].finish_reason == "tool_calls"
    assert len(pieces) == 1 if request.node.callspec.params["tools_proxy"] in WHOLE_CALLS else len(pieces) >= 3


async def test_each_choice_of_n_streams_its_own_call(tools_oa):
    """n=2, sampled: each choice's call is read on its own (its deltas under its choice index,
    each starting at call index 0), streamed and joined alike."""
    reply = await tools_oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=40,
                                                   temperature=0.3, seed=5, n=2)
    stream = await tools_oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=40,
                                                    temperature=0.3, seed=5, n=2, stream=True)
    joined: dict[int, dict[int, str]] = {0: {}, 1: {}}
    async for chunk in stream:
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or ():
                joined[choice.index][part.index] = joined[choice.index].get(part.index, "") + part.function.arguments
    for choice in reply.choices:
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
        assert joined[choice.index] == {i: call.function.arguments for i, call in enumerate(calls)}  # the same seed


async def test_an_answer_in_prose_stays_content(tools_oa):
    """Offered the tool but asked something else, the model answers in text: content, "stop"."""
    for stream in (False, True):
        reply = await tools_oa.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is 2+2?"}], tools=[WEATHER], max_tokens=20,
            temperature=0, stream=stream, logprobs=True)
        if stream:
            chunks = [c async for c in reply]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            reason = chunks[-1].choices[0].finish_reason
            assert "".join(e.token for e in entries) == text  # every token's log-probability, with its text
        else:
            text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
            assert reply.choices[0].message.tool_calls is None
        assert "4" in text and "<tool_call>" not in text and reason == "stop"


async def test_tool_choice_none_leaves_the_tools_out_and_reads_no_call(tools_oa):
    reply = await tools_oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="none",
                                                    max_tokens=40, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"


async def test_a_tool_result_continues_the_conversation_with_object_arguments(tools_oa, tools_proxy):
    """The earlier call's arguments (a JSON string on the wire) reach the template as an
    object: the prompt is the template's rendering of the object form, token for token."""
    from kvstream.hf.loader import chat_token_ids

    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "clear"}'},
    ]
    reply = await tools_oa.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=30, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    _, tokenizer = tools_proxy
    rendered = tokenizer.decode(chat_token_ids(tokenizer, history, tools=[WEATHER]))
    assert ': {"city": "Paris"}' in rendered or "<parameter=city>\nParis\n" in rendered or 'get_weather(city="Paris")' in rendered
    assert '"{\\"city' not in rendered
    assert reply.usage.prompt_tokens == len(chat_token_ids(tokenizer, history, tools=[WEATHER]))


async def test_the_ollama_client_gets_the_call_too(tools_proxy):
    import ollama

    proxy, _ = tools_proxy
    client = ollama.AsyncClient(host=proxy.url)
    messages = [{"role": "user", "content": "What is the weather in London?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "London"}}}]},
                {"role": "user", "content": "What is the weather in Paris?"}]
    reply = await client.chat(model="smollm2", messages=messages, tools=[WEATHER], options={"temperature": 0, "num_predict": 40})
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris"}


async def test_parallel_calls_and_parallel_tool_calls_false(tools_oa):
    """Shown two calls for two cities, the model answers with two; ``parallel_tool_calls:
    false`` keeps the first only."""
    def weather(city: str, i: int) -> dict:
        return {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}

    messages = [{"role": "user", "content": "What is the weather in London and in Tokyo?"},
                {"role": "assistant", "content": None, "tool_calls": [weather("London", 0), weather("Tokyo", 1)]},
                {"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    both = await tools_oa.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=80, temperature=0)
    calls = both.choices[0].message.tool_calls
    assert len(calls) == 2 and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert len({call.id for call in calls}) == 2
    one = await tools_oa.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=80,
                                                 temperature=0, parallel_tool_calls=False)
    [call] = one.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == calls[0].function.arguments


FORECAST = {"type": "function", "function": {"name": "get_forecast", "description": "The forecast for a city.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}, "days": {"type": "integer"}},
                                                 "required": ["city", "days"]}}}


@pytest.mark.parametrize(("syntax", "pieces", "opens_at"), [
    ("hermes", ["<think>", "I could <tool_call>", "</think>", "Sure. ", "<tool_call>", '\n{"name": "get_weather", ',
                '"arguments": {"city": "Paris"}}\n', "</tool_call>"], 4),
    ("llama3_json", ['{"name": "', 'get_weather", "parameters": {"city": "Paris"}}', '; {"name": "get_weather", ',
                     '"parameters": {"city": "Rome"}}'], 0),
    ("granite", ["One call. ", "<|tool_call|>", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'], 1),
    ("mistral", ["[TOOL_CALLS]", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'], 0),
    ("mistral", ["Two. ", "[TOOL_CALLS]", 'get_weather[ARGS]{"city": "Paris"}', "[TOOL_CALLS]", "get_weather",
                 '[ARGS]{"city": "Rome"}'], 1),
    ("qwen3_xml", ["<think>", "<tool_call>", "</think>", "Sure. ", "<tool_call>", "\n<function=get_weather>\n<parameter=city>",
                   "\nPa", "ris <b>\n</param", "eter>\n</function>\n", "</tool_call>"], 4),
    ("qwen3_xml", ["Call: ", "<function=get_weather>", "\n<parameter=city>\nParis\n</parameter>\n</function>"], 1),
    ("deepseek", ["Ok. ", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n",
                  '{"city": "Paris"}', "\n```<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"], 1),
    ("deepseek", ["<｜tool▁call▁begin｜>", 'get_weather<｜tool▁sep｜>{"city": "Rome"}', "<｜tool▁call▁end｜>"], 0),
    ("pythonic", ["[", "get", '_weather(city="Paris"', ")]"], 1),  # "[g" could begin a bracketed word: "[ge" not
    ("pythonic", ["<|python_start|>", "[get_weather(", "city='Paris'), ", 'get_weather(city="Rome")]', "<|python_end|>"], 1),
])
def test_each_held_syntax_opens_where_its_calls_do_and_takes_them_whole(syntax, pieces, opens_at):
    """The hold begins at the call's opening (not at a tag drafted inside thinking), and the
    calls as the model writes them are whole matches of it."""
    from kvstream.hf.call_grammar import call_hold
    from kvstream.hf.lazy_grammar import LazyGrammar
    from kvstream.hf.pattern_constraint import PatternConstraint, compile_pattern
    from kvstream.hf.tool_call_syntax import CallReading

    hold = call_hold(CallReading(syntax), [WEATHER], False if "<think>" in pieces else None, {})
    spelled = {i: piece.encode() for i, piece in enumerate(pieces)}
    waiting = LazyGrammar(PatternConstraint(compile_pattern(hold.pattern), spelled.__getitem__, ()), hold.triggers,
                          spelled.__getitem__)
    held = None
    for i in range(len(pieces)):
        if held is None:
            held = waiting.advance(i)
            assert (held is not None) == (i == opens_at), (i, waiting.text)
        else:
            assert held.accepts(i), pieces[i]
            held.advance(i)
    assert held is not None and held.complete


def held_pattern(syntax: str, tools: list, single_call: bool = False):
    from kvstream.hf.call_grammar import call_hold
    from kvstream.hf.pattern_constraint import compile_pattern
    from kvstream.hf.tool_call_syntax import CallReading

    hold = call_hold(CallReading(syntax, single_call=single_call), tools, None, {})
    assert hold is not None, syntax
    return compile_pattern(hold.pattern)


@given(st.lists(st.sampled_from(list("</parameter>") + ["x", "\n", "<<", "</param", "</parameter>"]), max_size=30).map("".join))
def test_a_string_value_is_any_text_but_its_close_tag(text):
    """The expression of a raw XML value (the search automaton for ``</parameter>`` written
    out) matches exactly the texts without it: a ``<``, a cut close tag, ``<</para`` are fine."""
    from kvstream.hf.call_grammar import _text_without

    assert (regex.fullmatch(_text_without("</parameter>"), text) is not None) == ("</parameter>" not in text)


FORECAST_UNITS = {"type": "function", "function": {"name": "get_forecast", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]},
    "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}}}, "required": ["city", "days"]}}}


@pytest.mark.parametrize(("text", "held"), [
    ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nSão <Paulo> </para\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", True),
    ("<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=unit>\n"
     'f\n</parameter>\n<parameter=options>\n{"hourly": true}\n</parameter>\n</function>', True),
    ('<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris", "days": 3, "unit": "c", "options": {"hourly": false}}}'
     "\n</tool_call>", True),  # the JSON body the reader takes in the tags too
    ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", False),
    ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
     "</function>\n</tool_call>", False),  # an integer that is not one
    ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
     "<parameter=unit>\nkelvin\n</parameter>\n</function>\n</tool_call>", False),  # not one of the enum's words
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", False),
])
def test_a_qwen3_xml_hold_takes_the_values_the_reader_types(text, held):
    """Qwen3-Coder's XML held: the required parameters present, in the schema's order, a
    typed value JSON of its type, a string any text but its close tag; and what is held reads
    back as the call it spells (xml_calls.py)."""
    pattern = held_pattern("qwen3_xml", [FORECAST_UNITS])
    assert (pattern.fullmatch(text) is not None) == held
    if held:
        [(_, call)] = scan(text, 7, CallReading("qwen3_xml", schemas=parameter_schemas([FORECAST_UNITS])).scanner())
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_forecast" and isinstance(arguments["days"], int) and arguments["city"]


@pytest.mark.parametrize(("text", "held"), [
    ('[get_forecast(city="São Paulo", days=3)]', True),
    ("[get_forecast(city='it\\'s \\u00e9', days=-2, unit='f', options={'hourly': True}), get_forecast(city=\"x\", days=0)]",
     True),
    ('[get_forecast(\n    city="Paris",\n    days=3,\n)]', True),  # spread over lines, a trailing comma
    ('[get_forecast(city="Paris", days=3, options={"hourly": False})]', True),  # an optional one (unit) left out
    ('[get_forecast(city="Paris")]', False),  # a required one missing
    ('[get_forecast(days=3, city="Paris")]', False),  # out of the schema's order
    ('[get_forecast(city="Paris", days="3")]', False),  # a string for an integer
    ('[get_forecast(city="Paris", days=3, unit="k")]', False),  # not one of the enum's words
    ('[get_forecast(city="Paris", days=3, options={"hourly": true})]', False),  # JSON's true is not Python's
    ('[get_forecast(city="a\\/b", days=3)]', False),  # an escape Python keeps as two characters
    ('[get_weather(city="Paris")]', False),  # not an offered tool
    ('[get_forecast(city=Paris, days=3)]', False),  # a name, not a literal
])
def test_a_pythonic_hold_takes_the_literals_the_reader_reads(text, held):
    """A pythonic list held: each call an offered tool, its arguments keywords in the
    schema's order with the required ones present, each value the Python literal of a value
    its schema admits; and what is held reads back (pythonic_calls.py) as the calls it spells."""
    import ast

    pattern = held_pattern("pythonic", [FORECAST_UNITS])
    assert (pattern.fullmatch(text) is not None) == held
    if held:
        calls = [call for _, call in scan(text, 5, CallReading("pythonic").scanner()) if call]
        assert len(calls) == text.count("get_forecast(")
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == "get_forecast" and isinstance(arguments["days"], int)
        listed = ast.parse(text).body[0].value
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            {k.arg: ast.literal_eval(k.value) for k in node.keywords} for node in listed.elts]


def test_tools_a_python_call_cannot_name_are_left_out_of_a_pythonic_hold():
    """A tool named ``get-time`` or with a parameter ``from`` cannot be called in Python's
    syntax (the reader takes such a call as text): the others are held; none: unheld."""
    from kvstream.hf.call_grammar import call_hold

    dashed = {"type": "function", "function": {"name": "get-time", "parameters": {"type": "object", "properties": {}}}}
    keyword = {"type": "function", "function": {"name": "move", "parameters": {"type": "object", "properties": {
        "from": {"type": "string"}}}}}
    optional = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}
    pattern = held_pattern("pythonic", [dashed, keyword, FORECAST, optional])
    assert pattern.fullmatch('[get_forecast(city="Paris", days=3)]')
    assert not pattern.fullmatch("[get-time()]") and not pattern.fullmatch('[move(from="a")]')
    assert call_hold(CallReading("pythonic"), [dashed, keyword], None, {}) is None
    # Arguments all optional: none, or some, a trailing comma only after one (Python's syntax).
    assert all(pattern.fullmatch(text) for text in ("[clock()]", "[clock(zone='CET')]", "[clock(zone='CET',)]"))
    assert not pattern.fullmatch("[clock(,)]")


@given(st.text(alphabet="aAcdefilnorstuTFN_9ywhkbmp", min_size=1, max_size=9) | st.sampled_from(keyword.kwlist))
def test_a_python_identifier_is_any_name_but_a_keyword(name):
    """The keyword names a tool without listed parameters is held to: exactly the ASCII
    identifiers Python takes as a keyword argument (``class=1`` does not parse)."""
    from kvstream.hf.call_grammar import python_identifier

    identifier = regex.compile(python_identifier())
    assert (identifier.fullmatch(name) is not None) == (name.isidentifier() and not keyword.iskeyword(name))
    for grown in (name + "_", name[:-1]):  # the keywords' neighbours too
        assert (identifier.fullmatch(grown) is not None) == (grown.isidentifier() and not keyword.iskeyword(grown))


def test_a_tool_without_listed_parameters_takes_any_keyword_argument_but_a_language_keyword():
    from kvstream.hf.call_grammar import call_hold
    from kvstream.hf.pattern_machine import Machine, machine_for

    ping = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    pattern = held_pattern("pythonic", [ping])
    machine = machine_for(call_hold(CallReading("pythonic"), [ping], None, {}).pattern)

    def machine_holds(text: str) -> bool:
        state = machine.start()
        for char in text:
            state = machine.step(state, char)
        return bool(state) and Machine.whole(state)

    for text, held in [("[ping()]", True), ("[ping(host='a', classy=1, match=2, from_=3)]", True),
                       ("[ping(Truth=None)]", True), ("[ping(class=1)]", False), ("[ping(host='a', from=1)]", False),
                       ("[ping(None=1)]", False), ("[ping(1x=2)]", False)]:
        assert (pattern.fullmatch(text) is not None) == held == machine_holds(text), text


@pytest.mark.parametrize("syntax", ["hermes", "llama3_json", "granite", "mistral", "qwen3_xml", "deepseek", "pythonic"])
def test_bounds_a_hold_cannot_enforce_are_left_out_and_schemas_share_one_set_of_rules(syntax):
    """Tools with keywords the expression cannot hold (``minimum``, ``pattern``: common in real
    tools; a 500 before) are held to the rest; values of any JSON (``{}``) in several tools, in
    a list of calls, compile (each schema's rules are defined once: they went unheld before)."""
    bounded = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "seats": {"type": "integer", "minimum": 1}, "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "note": {}},
        "required": ["seats"]}}}
    anything = {"type": "function", "function": {"name": "log", "parameters": {"type": "object", "properties": {"value": {}}}}}
    pattern = held_pattern(syntax, [bounded, anything])
    calls = {"hermes": '<tool_call>\n{"name": "book", "arguments": {"seats": 2, "code": "abc", "note": [1]}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "log", "arguments": {"value": {"a": null}}}\n</tool_call>',
             "llama3_json": '{"name": "book", "parameters": {"seats": 0, "code": "x", "note": 1}}; '
                            '{"name": "log", "parameters": {"value": "v"}}',
             "granite": '<|tool_call|>[{"name": "book", "arguments": {"seats": 2, "code": "x", "note": true}}, '
                        '{"name": "log", "arguments": {"value": []}}]',
             "mistral": '[TOOL_CALLS]book[ARGS]{"seats": 2, "code": "x", "note": null}[TOOL_CALLS]log[ARGS]{"value": 1}',
             "qwen3_xml": "<tool_call>\n<function=book>\n<parameter=seats>\n-1\n</parameter>\n</function>\n</tool_call>\n"
                          "<tool_call>\n<function=log>\n<parameter=value>\nanything\n</parameter>\n</function>\n</tool_call>",
             "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>book\n```json\n"
                         '{"seats": 2, "code": "x", "note": {}}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>log<｜tool▁sep｜>'
                         '{"value": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
             "pythonic": "[book(seats=2, code='x', note=[1]), log(value={'a': None})]"}
    assert pattern.fullmatch(calls[syntax]), syntax
    assert not pattern.fullmatch(calls[syntax].replace("seats", "places"))


def test_a_strict_tool_beyond_the_expression_leaves_its_calls_unheld():
    """``strict`` asks for the whole schema: where the expression cannot hold it, a model's
    own calls go unheld (the model may answer in text; a forced call is a 400,
    test_tool_calls.py), and the same tool not strict is held to the rest."""
    from kvstream.hf.call_grammar import call_hold

    bounded = copy.deepcopy(FORECAST)
    bounded["function"]["parameters"]["properties"]["days"]["minimum"] = 1
    strict = copy.deepcopy(bounded)
    strict["function"]["strict"] = True
    assert call_hold(CallReading("hermes"), [strict], None, {}) is None
    assert call_hold(CallReading("hermes"), [bounded], None, {}) is not None


def test_a_loosened_schema_keeps_what_it_can_hold_at_every_depth():
    from kvstream.hf.json_schema import loosened

    schema = {"type": "object", "properties": {"minimum": {"type": "integer", "minimum": 0, "description": "kept"},
                                               "tags": {"type": "array", "items": {"type": "string", "pattern": "x"}}},
              "required": ["minimum"], "allOf": [{"required": ["tags"]}], "$defs": {"d": {"anyOf": [{"maxLength": 3,
                                                                                                      "format": "date",
                                                                                                      "multipleOf": 2}]}}}
    assert loosened(schema) == {"type": "object", "properties": {"minimum": {"type": "integer", "description": "kept"},
                                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                                "required": ["minimum"], "$defs": {"d": {"anyOf": [{"maxLength": 3, "format": "date"}]}}}


@pytest.mark.parametrize("syntax", ["hermes", "llama3_json", "granite", "mistral", "qwen3_xml", "deepseek", "pythonic"])
async def test_calls_are_held_to_the_offered_tools_from_their_opening_on(smollm2, start_proxy, monkeypatch, syntax):
    """Shown a ``get_weather`` call and offered only ``get_forecast`` (city and days
    required), SmolLM2 left free writes calls the tools refuse (as measured here: Hermes,
    Llama 3, Mistral and DeepSeek leave ``days`` out for Paris, Qwen3-Coder's XML ``city``, the pythonic
    list writes ``days`` a string and adds a ``max_days``,
    Granite calls ``forecast`` with ``days`` a string, Hermes calls ``get_weather`` for Rome).
    Held from the call's opening on (call_grammar.py), each is ``get_forecast`` with both
    arguments. (Held in Mistral's list, the model repeats its call until ``max_tokens``: one
    call is asked for there. DeepSeek's tags are many tokens in SmolLM2's vocabulary.)"""
    from openai import AsyncOpenAI

    import kvstream.hf.call_grammar as call_grammar

    async def ask(oa, question: str) -> list:
        reply = await oa.chat.completions.create(model="smollm2", messages=EXAMPLE + [{"role": "user", "content": question}],
                                                 tools=[FORECAST], max_tokens=120 if syntax == "deepseek" else 60,
                                                 temperature=0, parallel_tool_calls=syntax != "mistral")
        assert reply.choices[0].finish_reason == "tool_calls", reply
        return [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls]

    def runnable(calls: list) -> bool:
        return all(name == "get_forecast" and isinstance(arguments.get("city"), str) and isinstance(arguments.get("days"), int)
                   for name, arguments in calls)

    questions = ["What is the forecast in Paris for 3 days?"] + (["Will it rain in Rome this week?"] if syntax == "hermes" else [])
    async with templated_proxy(smollm2, start_proxy, {**TEMPLATES, "deepseek": DEEPSEEK_TEMPLATE}[syntax]) as (proxy, _):
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            held = [await ask(oa, q) for q in questions]
            with monkeypatch.context() as free:
                free.setattr(call_grammar, "call_hold", lambda *args: None)
                unheld = [await ask(oa, q) for q in questions]
    assert not any(map(runnable, unheld)), unheld
    assert all(map(runnable, held)) and held[0] == [("get_forecast", {"city": "Paris", "days": 3})], held
    if syntax == "hermes":
        assert unheld[1] == [("get_weather", {"city": "Rome"})] and held[1][0][1]["city"] == "Rome"


async def test_a_holds_expression_is_compiled_off_the_event_loop(smollm2, start_proxy, monkeypatch):
    """The expression of many tools takes long to read (50 tools of 6 parameters: up to
    0.45 s for the machine, 1.5 s when the regex module compiled it, more on a loaded
    machine; benchmarks/tool_holds.py): it is read on a worker thread before the request is
    queued, never on the event loop every other client's stream is served from, and submit
    finds it cached."""
    import asyncio

    from openai import AsyncOpenAI

    import kvstream.hf.call_grammar as call_grammar

    compiled_on_loop = []

    def expression(text):
        try:
            asyncio.get_running_loop()
            compiled_on_loop.append(True)
        except RuntimeError:
            compiled_on_loop.append(False)
        return original(text)

    original = call_grammar.expression
    monkeypatch.setattr(call_grammar, "expression", expression)
    call_grammar._cached_hold.cache_clear()
    async with templated_proxy(smollm2, start_proxy, HERMES_TEMPLATE) as (proxy, _):
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            for _ in range(2):
                reply = await oa.chat.completions.create(
                    model="smollm2", messages=EXAMPLE + [{"role": "user", "content": "What is the forecast in Paris for 3 days?"}],
                    tools=[FORECAST], max_tokens=60, temperature=0)
                assert reply.choices[0].message.tool_calls[0].function.name == "get_forecast"
    assert compiled_on_loop == [False]  # once, on a worker thread; the second request found it cached


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, QWEN3_XML_TEMPLATE, PYTHONIC_TEMPLATE])
async def test_tools_a_hold_cannot_be_made_of_are_a_400_or_read_unheld_never_a_500(smollm2, start_proxy, template):
    """A tool without a name is the client's 400 naming ``tools`` (the hold is made before the
    request is queued); a schema whose reference resolves nowhere leaves the calls unheld and
    the answer is served."""
    import aiohttp

    unnamed = [{"type": "function", "function": {"description": "no name", "parameters": {"type": "object"}}}]
    dangling = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/nowhere"}}}}}]
    async with templated_proxy(smollm2, start_proxy, template) as (proxy, _):
        async with aiohttp.ClientSession() as http:
            answers = []
            for tools in (unnamed, dangling):
                body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 5}
                async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
                    answers.append((resp.status, await resp.json()))
    assert answers[0][0] == 400 and answers[0][1]["error"]["param"] == "tools", answers[0]
    assert answers[1][0] == 200 and answers[1][1]["choices"][0]["finish_reason"] in ("stop", "length"), answers[1]


async def test_a_tool_with_bounds_the_hold_cannot_enforce_is_held_to_the_rest(smollm2, start_proxy):
    """A tool whose parameters carry ``minimum``/``maximum`` (as real tools' do) is still
    offered and its call held (the request failed before, the bound refused as in a client's
    own schema); the bound itself is the model's to keep."""
    from openai import AsyncOpenAI

    bounded = copy.deepcopy(FORECAST)
    bounded["function"]["parameters"]["properties"]["days"].update(minimum=1, maximum=16)
    async with templated_proxy(smollm2, start_proxy, HERMES_TEMPLATE) as (proxy, _):
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            reply = await oa.chat.completions.create(
                model="smollm2", messages=EXAMPLE + [{"role": "user", "content": "What is the forecast in Paris for 3 days?"}],
                tools=[bounded], max_tokens=60, temperature=0)
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_forecast", {"city": "Paris", "days": 3})


async def test_a_held_call_with_post_sampling_probs_or_unheld_without_top_k(smollm2, start_proxy):
    """``post_sampling_probs`` under a hold needs a ``top_k`` to bound the tokens judged: with
    one, the call is held (its probabilities are those of what the hold allows,
    test_llamacpp_native.py); without, the answer goes unheld rather than failing."""
    from openai import AsyncOpenAI

    question = EXAMPLE + [{"role": "user", "content": "What is the forecast in Paris for 3 days?"}]
    async with templated_proxy(smollm2, start_proxy, HERMES_TEMPLATE) as (proxy, _):
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            answers = {}
            for top_k in (10, None):
                reply = await oa.chat.completions.create(
                    model="smollm2", messages=question, tools=[FORECAST], max_tokens=60, temperature=0.3, seed=1,
                    logprobs=True, top_logprobs=3, extra_body={"post_sampling_probs": True, "top_k": top_k})
                choice = reply.choices[0]
                answers[top_k] = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
                assert choice.finish_reason == "tool_calls", choice
    assert answers[10] and all(name == "get_forecast" and isinstance(a.get("days"), int) for name, a in answers[10])
    assert answers[None] != answers[10]  # (unheld, as measured: days left out)


async def test_qwen3_xml_values_come_back_typed_by_the_tools_schema(smollm2, start_proxy):
    """Qwen3-Coder's syntax end to end: the model writes ``<parameter=days>5</parameter>``,
    the client gets ``"days": 5`` (an integer, as the schema says), streamed or not."""
    from openai import AsyncOpenAI

    forecast = {"type": "function", "function": {"name": "get_forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}}
    messages = [{"role": "user", "content": "What is the forecast in London for the next 2 days?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
                    "name": "get_forecast", "arguments": '{"city": "London", "days": 2}'}}]},
                {"role": "user", "content": "What is the forecast in Paris for the next 5 days?"}]
    async with templated_proxy(smollm2, start_proxy, QWEN3_XML_TEMPLATE) as (proxy, _):
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            reply = await oa.chat.completions.create(model="smollm2", messages=messages, tools=[forecast], max_tokens=60,
                                                     temperature=0)
            [call] = reply.choices[0].message.tool_calls
            assert call.function.name == "get_forecast" and json.loads(call.function.arguments) == {"city": "Paris", "days": 5}
            stream = await oa.chat.completions.create(model="smollm2", messages=messages, tools=[forecast], max_tokens=60,
                                                      temperature=0, stream=True)
            parts = [c.choices[0].delta.tool_calls[0] async for c in stream if c.choices and c.choices[0].delta.tool_calls]
            assert "".join(part.function.arguments for part in parts) == call.function.arguments
            assert [part.function.arguments for part in parts][:2] == ['{"city": "', "Paris"]  # a string as it comes


def test_call_tags_that_are_special_tokens_are_put_back_from_their_ids(smollm2):
    """A tokenizer whose call tags are special tokens (the detokenizer skips those) has their
    text put back by id before the answer is read."""
    from tokenizers import AddedToken

    from kvstream.hf.answer_reading import answer_reading, special_tag_texts
    from kvstream.hf.tool_call_syntax import call_reading

    tokenizer = copy.deepcopy(smollm2[2])
    assert special_tag_texts(tokenizer) == {}  # SmolLM2's own: the tags are plain text
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    # Marked special without being listed among the special tokens (as Mistral's control tokens are).
    tokenizer.add_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    tags = special_tag_texts(tokenizer)
    assert sorted(tags.values()) == ["</tool_call>", "<tool_call>", "[TOOL_CALLS]"]
    assert all(tokenizer.decode([i], skip_special_tokens=True) == "" for i in tags)
    tokenizer.chat_template = HERMES_TEMPLATE
    reading = answer_reading(tokenizer, {"tools": [WEATHER]}, [1, 2, 3])
    assert reading.calls.syntax == "hermes" and reading.tag_texts == tags and not reading.calls.single_call
    # The tags' tokens arrive with no text (skipped): the reader reads them by id.
    open_id, close_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
    reader = reading.reader()
    pieces = reader.read(open_id, "") + reader.read(7, '{"name": "get_weather", "arguments": {}}') + reader.read(close_id, "")
    assert [p.call["function"]["name"] for p in pieces if p.call] == ["get_weather"]
    assert not any(p.text for p in pieces)
    assert call_reading(tokenizer, {"tools": [WEATHER], "tool_choice": "none"}) is None
    assert call_reading(tokenizer, {"tools": [WEATHER], "tool_choice": "required"}) is None  # forced: a schema instead
    assert call_reading(tokenizer, {"tools": [WEATHER], "parallel_tool_calls": False}).single_call
    # Held, the tags are those tokens (referenced), never their text spelled by others.
    from kvstream.hf.call_grammar import call_hold

    hold = call_hold(reading.calls, [WEATHER], None, reading.tag_texts)
    assert {token for token, _ in hold.tokens} == {open_id, close_id}
    assert "<tool_call>" not in hold.pattern and hold.triggers.tokens == {open_id} and not hold.triggers.words


# ------------------------------------------------- DeepSeek's syntax, --chat-template, --tool-call-syntax
def deepseek_backend(smollm2, tmp_path, **settings):
    """SmolLM2 served with DeepSeek's call syntax shown by a template given as a file (the
    model's own shows it no tools), as ``--chat-template`` gives it."""
    import copy as copy_module

    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    template = tmp_path / "deepseek.jinja"
    template.write_text(DEEPSEEK_TEMPLATE)
    model, _, tokenizer = smollm2
    return HFBackend(None, None, preloaded=LoadedModel(model, copy_module.copy(tokenizer), "smollm2", "hf:test"),
                     block_size=16, num_gpu_blocks=128, num_cpu_blocks=32, max_batch_size=8, chat_template=str(template),
                     **settings)


async def test_deepseek_calls_end_to_end_under_a_template_given_as_a_file(smollm2, start_proxy, tmp_path):
    """DeepSeek's syntax through the server: SmolLM2 under a DeepSeek-style template given with
    ``chat_template`` (its tags are many tokens in SmolLM2's vocabulary, one each in
    DeepSeek's: hence 100 tokens), the call streamed as written, the history's earlier call
    rendered with string arguments (the template joins them with ``+``), the Ollama client."""
    import ollama
    from openai import AsyncOpenAI

    from kvstream.hf.loader import chat_token_ids

    proxy = await start_proxy(deepseek_backend(smollm2, tmp_path))
    await proxy.engine.start()
    try:
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            reply = await oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=100, temperature=0)
            choice = reply.choices[0]
            [call] = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
            stream = await oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=100,
                                                      temperature=0, stream=True)
            deltas = [c.choices[0].delta async for c in stream if c.choices]
            first, *more = [d.tool_calls[0] for d in deltas if d.tool_calls]
            assert first.id.startswith("call_") and first.function.name == "get_weather" and len(more) >= 3
            assert first.function.arguments + "".join(m.function.arguments for m in more) == call.function.arguments
            assert not any(d.content for d in deltas)

            history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'}]
            after = await oa.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=20, temperature=0)
            tokenizer = proxy.engine.backend.runner.tokenizer
            ids = chat_token_ids(tokenizer, history, tools=[WEATHER])
            assert after.usage.prompt_tokens == len(ids) and '```json\n{"city": "Paris"}\n```' in tokenizer.decode(ids)
        client = ollama.AsyncClient(host=proxy.url)
        messages = [{"role": "user", "content": "What is the weather in London?"},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "London"}}}]},
                    {"role": "user", "content": "What is the weather in Paris?"}]
        answer = await client.chat(model="smollm2", messages=messages, tools=[WEATHER], options={"temperature": 0, "num_predict": 100})
        [ollama_call] = answer.message.tool_calls
        assert ollama_call.function.name == "get_weather" and dict(ollama_call.function.arguments) == {"city": "Paris"}
        described = proxy.engine.backend.describe()
        assert described["tool_call_syntax"] == "deepseek" and described["chat_template"].endswith("deepseek.jinja")
    finally:
        await proxy.engine.close()


async def test_a_chosen_call_syntax_overrides_the_templates(smollm2, start_proxy, tmp_path):
    """``tool_call_syntax: none`` leaves the model's calls as its text; another syntax than the
    template's reads none of them either (the model writes DeepSeek's)."""
    from openai import AsyncOpenAI

    for syntax in ("none", "hermes"):
        proxy = await start_proxy(deepseek_backend(smollm2, tmp_path, tool_call_syntax=syntax))
        await proxy.engine.start()
        try:
            async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
                reply = await oa.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=100,
                                                         temperature=0)
            choice = reply.choices[0]
            assert choice.message.tool_calls is None and choice.finish_reason == "stop"
            assert choice.message.content.startswith(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_weather")
            assert proxy.engine.backend.describe()["tool_call_syntax"] == (None if syntax == "none" else syntax)
        finally:
            await proxy.engine.close()


def test_a_chat_template_file_that_cannot_be_used_is_one_error_naming_it(tmp_path):
    from kvstream.hf.loader import read_chat_template

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n")
    for path, why in ((tmp_path / "missing.jinja", "cannot read it"), (broken, "not a Jinja template (line 2")):
        with pytest.raises(ValueError, match=f"--chat-template {path}: {why}".replace("(", r"\(")):
            read_chat_template(path)
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(ValueError, match="empty"):
        read_chat_template(tmp_path / "empty.jinja")


def test_the_configured_syntaxes_are_the_ones_read():
    from typing import get_args

    from kvstream.config import BackendSettings
    from kvstream.hf.tool_call_syntax import SYNTAXES

    assert set(get_args(BackendSettings.model_fields["tool_call_syntax"].annotation)) == {"auto", "none", *SYNTAXES}
    assert call_syntax(DEEPSEEK_TEMPLATE) == "deepseek"


def test_serve_with_a_chat_template_it_cannot_read_stops_at_once_naming_it(tmp_path):
    from tests.test_cli import kvstream

    out = kvstream("serve", "--backend", "hf", "--chat-template", str(tmp_path / "missing.jinja"), "--port", "0", cwd=tmp_path)
    assert out.returncode == 1 and f"--chat-template {tmp_path / 'missing.jinja'}: cannot read it" in out.stderr
    assert "Traceback" not in out.stderr
