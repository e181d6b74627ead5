"""Ollama's per-request ``template`` on /api/generate: a Go text/template that replaces the
model's own for one request, rendered here into the prompt that is sent as it is.

Ollama renders such a template over ``.System``, ``.Prompt`` and ``.Response`` and, for the
turn being answered, cuts the text where ``.Response`` stands (what follows it, an end-of-turn
marker, belongs after the answer). The subset its generate templates use is read: those
fields, ``if`` / ``else if`` / ``else`` / ``end`` on them, comments, and the ``{{-`` / ``-}}``
whitespace trims. Anything else (``range .Messages``, ``.Tools``, functions, pipelines) is a
TemplateUnsupported naming it: the request is refused rather than templated wrongly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.DOTALL)
_FIELDS = ("System", "Prompt", "Response")
_FIELD = re.compile(r"\.(System|Prompt|Response)")


class TemplateUnsupported(ValueError):
    """The template uses what this renderer does not read; the message names it."""


@dataclass
class _If:
    branches: list[tuple[str | None, list[object]]] = field(default_factory=list)  # (field or None for else, body)


def render_generate_template(template: str, system: str, prompt: str) -> str:
    """The prompt ``template`` makes of ``system`` and ``prompt``, cut where ``.Response``
    stands (the answer follows). TemplateUnsupported for what it cannot read."""
    out: list[str] = []
    _run(_parse(_lex(template)), {"System": system, "Prompt": prompt}, out)
    return "".join(out)


def _lex(template: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", body) pieces, with the trims applied to the text around."""
    pieces: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for match in _ACTION.finditer(template):
        text = template[pos:match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        if text:
            pieces.append(("text", text))
        pieces.append(("action", match.group(2)))
        pos, trim_next = match.end(), bool(match.group(3))
    text = template[pos:]
    if trim_next:
        text = text.lstrip()
    if "{{" in text:
        raise TemplateUnsupported("an unclosed '{{' in 'template'")
    if text:
        pieces.append(("text", text))
    return pieces


def _condition(body: str, keyword: str) -> str:
    name = body[len(keyword):].strip()
    if not _FIELD.fullmatch(name):
        raise TemplateUnsupported(f"'{{{{ {body} }}}}' in 'template': only {', '.join('.' + f for f in _FIELDS)} "
                                  "are read here")
    return name[1:]


def _parse(pieces: list[tuple[str, str]]) -> list[object]:
    root: list[object] = []
    stack: list[tuple[_If, list[object]]] = []  # an open if, and the list it was put in
    current = root
    for kind, body in pieces:
        if kind == "text":
            current.append(body)
        elif body.startswith("/*") and body.endswith("*/"):
            continue
        elif _FIELD.fullmatch(body):
            current.append(("field", body[1:]))
        elif body.startswith("if "):
            node = _If([(_condition(body, "if"), [])])
            current.append(node)
            stack.append((node, current))
            current = node.branches[-1][1]
        elif body.startswith("else if ") and stack:
            stack[-1][0].branches.append((_condition(body, "else if"), []))
            current = stack[-1][0].branches[-1][1]
        elif body == "else" and stack:
            stack[-1][0].branches.append((None, []))
            current = stack[-1][0].branches[-1][1]
        elif body == "end" and stack:
            current = stack.pop()[1]
        else:
            raise TemplateUnsupported(f"'{{{{ {body} }}}}' in 'template': only .System, .Prompt, .Response and "
                                      "if/else/end on them are read here; send the prompt templated with raw: true")
    if stack:
        raise TemplateUnsupported("an 'if' without its 'end' in 'template'")
    return root


def _run(nodes: list[object], values: dict[str, str], out: list[str]) -> bool:
    """Render ``nodes`` into ``out``; True once ``.Response`` is reached (the prompt ends
    there; ``.Response`` is empty when tested, as the answer is not written yet)."""
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _If):
            for name, body in node.branches:
                if name is None or values.get(name):
                    if _run(body, values, out):
                        return True
                    break
        elif node[1] == "Response":  # type: ignore[index]
            return True
        else:
            out.append(values[node[1]])  # type: ignore[index]
    return False
