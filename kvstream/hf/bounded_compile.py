"""The regex module's compile of a client's expression, tried first in a helper process.

The ``regex`` module builds a compiled expression's nodes in C, one set per repetition a
count asks for, nested counts multiplied: ``(?:ab|c){1000000}``, seventeen characters, takes
gigabytes and ends the process with a segmentation fault; ``(?:(?:a{1000}){1000}){16}`` takes
11 s and 5 GB before it compiles. No exception to catch, no timeout to pass: a server that
compiled such an expression in its own process died with every stream in it.

So an expression from a client (one it wrote, or one KVStream wrote from its schema, grammar
or tools) is compiled first in a helper process (one per server, started on first use, kept
for the next), under a memory limit (``MAX_COMPILE_BYTES`` of address space past what the
helper holds at rest, where the platform sets one) and a time limit (``MAX_COMPILE_S``).
Only an expression that compiled there within both is compiled here; one that did not is
refused (``CompileTooCostly``, a ValueError: a 400 for the request) and the helper, killed
or dead, is replaced by the next check. Measuring the real compile, rather than estimating it
from the text, holds for whatever the regex module unrolls, in any of its syntaxes (verbose
comments, scoped flags, fuzzy counts).

What it costs (``python benchmarks/bounded_compile.py``): each expression not yet cached
compiled twice, the first time in the helper (half a millisecond more for the expressions
people write; 16 KiB of alternatives 73 -> 165 ms), ~30 ms to start the helper on first use
and after each refusal, and a small idle process. An expression the incremental machine
holds is only checked here (``compile_complaint``): compiled once, in the helper.
"""

from __future__ import annotations

import atexit
import json
import logging
import subprocess
import sys
import threading
from typing import Any

import regex

log = logging.getLogger(__name__)

# About 250 bytes of nodes per repetition compiled: 64 MiB is ~250,000 of them, ~0.2 s here.
# The expressions people write take well under 1 MB (a date, an e-mail, 16 KB of alternatives:
# 3 MB).
MAX_COMPILE_BYTES = 64 * 1024 * 1024
# A backstop for an expression slow to compile without growing (16 KB of alternatives: 0.1 s).
MAX_COMPILE_S = 1.0
START_TIMEOUT_S = 30.0  # the helper's interpreter starting, on a loaded machine

# The helper: limits its own address space, then answers each expression with "done" once
# compiled, or "error" and the regex module's complaint (JSON) where it does not compile. A
# compile that runs out of memory either raises MemoryError (answered "memory") or kills the
# helper outright; either way the caller refuses.
_HELPER = r"""
import json, os, signal, sys
import regex
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
try:
    import resource
    with open("/proc/self/statm") as statm:
        at_rest = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (at_rest + int(sys.argv[1]),) * 2)
except (ImportError, OSError, ValueError):
    pass  # no address-space limit here: the time limit still holds
print("ready", flush=True)
for line in sys.stdin:
    try:
        regex.compile(json.loads(line))
        reply = "done"
    except MemoryError:
        reply = "memory"
    except Exception as exc:  # regex.error, RecursionError, OverflowError...
        reply = "error " + json.dumps(str(exc))
    regex.purge()  # keep nothing: each expression is measured from rest
    print(reply, flush=True)
"""


class CompileTooCostly(ValueError):
    """The expression takes more memory or time to compile than this server gives one."""


class CompileProbe:
    """A helper process that compiles an expression within bounds before this one does.

    ``check(text)`` returns once the helper has compiled ``text`` within ``memory_bytes`` and
    ``timeout_s`` (with the regex module's complaint where it does not compile), and raises
    CompileTooCostly if it did not. Thread-safe (checks take turns)."""

    def __init__(self, memory_bytes: int = MAX_COMPILE_BYTES, timeout_s: float = MAX_COMPILE_S) -> None:
        self.memory_bytes = memory_bytes
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None
        atexit.register(self.close)

    def check(self, text: str) -> str | None:
        """None if ``text`` compiles within the bounds, the regex module's complaint if it
        does not compile; CompileTooCostly past the bounds."""
        with self._lock:
            process = self._started()
            reply, timed_out = self._ask(process, json.dumps(text) + "\n", self.timeout_s)
            if reply == "done":
                return None
            if reply.startswith("error "):
                return str(json.loads(reply[len("error "):]))
            self._discard()  # killed, dead or out of memory: the next check starts a fresh one
        mb = self.memory_bytes // (1024 * 1024)
        why = f"longer than {self.timeout_s:g} s" if timed_out else f"more than {mb} MB"
        raise CompileTooCostly(f"the expression takes {why} to compile, past what this server gives one")

    def close(self) -> None:
        """Stop the helper (a later check starts another)."""
        with self._lock:
            self._discard()

    def _started(self) -> subprocess.Popen[str]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._discard()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _HELPER, str(self.memory_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, encoding="utf-8")
        except OSError as exc:
            raise self._unchecked(exc) from None
        reply, _ = self._ask(process, None, START_TIMEOUT_S)
        if reply != "ready":
            process.kill()
            process.wait()
            raise self._unchecked("it did not answer")
        self._process = process
        return process

    @staticmethod
    def _unchecked(why: object) -> CompileTooCostly:
        # Without its helper the server cannot tell a costly expression from a cheap one: it
        # refuses them all rather than risk its process (a 400 naming the cause).
        log.error("the helper process that checks expressions before they are compiled did not start: %s", why)
        return CompileTooCostly("this server cannot check expressions now (its helper process did not start)")

    @staticmethod
    def _ask(process: subprocess.Popen[str], line: str | None, timeout_s: float) -> tuple[str, bool]:
        """``line`` sent (None: nothing) and the helper's next line read, the helper killed
        past ``timeout_s``; the reply ("" if it died) and whether it was killed for time."""
        assert process.stdin is not None and process.stdout is not None
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            process.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.daemon = True
        timer.start()
        try:
            if line is not None:
                process.stdin.write(line)
                process.stdin.flush()
            reply = process.stdout.readline().strip()
        except OSError:  # its pipe closed: it died
            reply = ""
        finally:
            timer.cancel()
        return reply, timed_out.is_set()

    def _discard(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:  # (flushing what was buffered for a killed helper: nobody reads it)
                pass


_probe = CompileProbe()


def compile_complaint(text: str) -> str | None:
    """The regex module's complaint about ``text`` (None: it compiles), asked of the helper
    alone (CompileTooCostly past its bounds): for an expression this process compiles only
    if an answer needs it, checked now without pausing everything here for its compile."""
    return _probe.check(text)


def bounded_compile(text: str) -> Any:
    """``text`` compiled by the regex module, once a helper process has compiled it within
    ``MAX_COMPILE_BYTES`` and ``MAX_COMPILE_S``; CompileTooCostly (a ValueError) if it did
    not; the regex module's own error if it does not compile."""
    _probe.check(text)
    return regex.compile(text)
