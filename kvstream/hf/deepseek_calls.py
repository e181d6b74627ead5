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

from kvstream.hf.call_streams import JsonCallStream

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
TAGS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
# V3 / R1: after the separator, the name's line, then the fence that opens the arguments.
_NAME_AND_FENCE = re.compile(r"([^\n`]+)\n```(?:json)?[ \t]*\n\s*")


@dataclass
class DeepSeekCallStream(JsonCallStream):
    """One call's body between DeepSeek's call tags, V3's fenced form or V3.1's bare one."""

    def _find_arguments(self, body: str) -> bool:
        head, sep, rest = body.partition(SEP)
        if not sep:
            return False
        bare = rest.lstrip()
        if bare.startswith("{"):  # V3.1: name<sep>{...}
            name, start = head.strip(), len(body) - len(bare)
        else:  # V3 / R1: type<sep>name, then the fence
            fenced = _NAME_AND_FENCE.match(rest)
            if fenced is None or not rest[fenced.end():].startswith("{"):
                return False  # not certain yet (or arguments that are not an object: not a call)
            name, start = fenced.group(1).strip(), len(head) + len(sep) + fenced.end()
        if not name:
            return False
        self._name, self._value_start, self._scanned = name, start, start
        return True

    def _progress(self, body: str) -> tuple[str, str] | None:
        progress = super()._progress(body)
        return None if progress is None else (progress[0], self._less_fence(progress[1]))

    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        if self._value_start is None and not self._find_arguments(body):
            return None
        self._follow(body)
        if self._value_end is not None:  # the object as written, as it streamed
            return self._name, body[self._value_start:self._value_end]
        return self._name, self._less_fence(body[self._value_start:])  # never closed: as far as it went

    def _less_fence(self, arguments: str) -> str:
        """Arguments whose object has not closed, less what may be the fence after it (held
        back while it streams: an object that never closes does not take the fence in)."""
        if self._value_end is not None or self._in_string:
            return arguments
        # (By hand, from the end: a regex anchored at the end still tries every position.)
        end = len(arguments)
        while end > len(arguments) - 3 and end and arguments[end - 1] == "`":
            end -= 1
        while end and arguments[end - 1].isspace():
            end -= 1
        return arguments if end == len(arguments) else arguments[:end]
