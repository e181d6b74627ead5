"""Tool calls in DeepSeek's form (DeepSeek-V3, R1 and its distillations, V3.1), read as
they stream. Their templates wrap an answer's calls in ``<｜tool▁calls▁begin｜>`` ...
``<｜tool▁calls▁end｜>`` and each call in ``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>``;
inside, V3 and R1 write the call's type, its name and its arguments in a JSON fence::

    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>

and V3.1 the name and the arguments alone, ``get_weather<｜tool▁sep｜>{"city": "Paris"}``
(vLLM's ``deepseek_v3`` and ``deepseek_v31`` parsers). Both are read, whichever the template
shows: the arguments object's text streams as written (call_streams.py's JSON following),
from its opening brace to its closing one, so the fence after it never goes out.
tool_call_syntax.py finds the tags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstream.hf.call_streams import SeparatedCallStream

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
TAGS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
# V3 / R1: after the separator, the name's line, then the fence that opens the arguments.
_NAME_AND_FENCE = re.compile(r"([^\n`]+)\n```(?:json)?[ \t]*\n\s*")


@dataclass
class DeepSeekCallStream(SeparatedCallStream):
    """One call's body between DeepSeek's call tags, V3's fenced form or V3.1's bare one."""

    separator: str = SEP

    def _find_arguments(self, body: str) -> bool:
        head, sep, rest = body.partition(SEP)
        fenced = _NAME_AND_FENCE.match(rest) if sep else None
        if fenced is None or not fenced.group(1).strip() or not rest[fenced.end():].startswith("{"):
            return super()._find_arguments(body)  # V3.1 (or not certain yet)
        self._begin(fenced.group(1).strip(), len(head) + len(sep) + fenced.end())  # V3 / R1: type<sep>name, the fence
        return True

    def _progress(self, body: str) -> tuple[str, str] | None:
        progress = super()._progress(body)
        return None if progress is None else (progress[0], self._less_fence(progress[1]))

    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        whole = super()._whole(body, cut)
        return None if whole is None else (whole[0], self._less_fence(whole[1]))

    def _less_fence(self, arguments: str) -> str:
        """Arguments whose object has not closed, less what may be the fence after it (held
        back while it streams: an object that never closes does not take the fence in)."""
        if self._value is None or self._value.end is not None or self._value.in_string:
            return arguments
        # (By hand, from the end: a regex anchored at the end still tries every position.)
        end = len(arguments)
        while end > len(arguments) - 3 and end and arguments[end - 1] == "`":
            end -= 1
        while end and arguments[end - 1].isspace():
            end -= 1
        return arguments if end == len(arguments) else arguments[:end]
