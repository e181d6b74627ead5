"""A client's expression compiled first in a helper process (bounded_compile.py): what the
regex module's compile dies of, or takes gigabytes for, is refused, and this process lives;
what people write compiles as before; the helper is kept, replaced when it dies, and
stopped with the server.

Several tests here would end the test process with a segmentation fault without the helper:
the regex module crashes compiling them."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.conftest import require_import

regex = require_import("regex")

from kvstream.hf.bounded_compile import CompileProbe, CompileTooCostly, bounded_compile  # noqa: E402
from kvstream.hf.pattern_constraint import PatternError, check_pattern, compile_pattern  # noqa: E402

CRASHES = "(?:ab|c){1000000}"  # seventeen characters: a segmentation fault in regex.compile
GIGABYTES = "(?=a)(?:(?:a{1000}){1000}){64}"  # ~20 GB (16 of the outer count took 11 s and 5 GB)
# The regex module's verbose syntax: the comment hides the '(' and the count applies to the
# group before it, a million times; a reading of the text alone would have to know that.
VERBOSE = "(?x)(?:(?:a{1000}) #(\n{1000})"
SLOW = "(?:x|y)" * 2300  # 16 KB of alternatives: ~0.1 s, ~3 MB
SLOWER = "(?:x|y)" * 14000  # 98 KB: ~0.5 s here, ~20 MB


@pytest.fixture
def probe():
    checker = CompileProbe()
    yield checker
    checker.close()


def helper_pid(checker: CompileProbe) -> int:
    assert checker._process is not None
    return checker._process.pid


@pytest.mark.parametrize(("text", "match"), [
    (r"\d{4}-\d{2}-\d{2}", "2026-12-06"), (r"(?:[0-9a-f]{2}:){5}[0-9a-f]{2}", "00:1a:2b:3c:4d:5e"),
    (r"[A-Z][a-z]+(?: [A-Z][a-z]+)*", "Ada Lovelace"), (r"x(?=y)y(?!z)", "xy"), ("a{100000}", "a" * 100_000),
    (SLOW, "xy" * 1150)])
def test_what_people_write_compiles_as_before(text, match):
    pattern = bounded_compile(text)
    assert pattern.pattern == text and pattern.flags == regex.compile(text).flags
    assert pattern.fullmatch(match) and not pattern.fullmatch(match + "!")


@pytest.mark.parametrize("text", [CRASHES, GIGABYTES, VERBOSE, "a{4000000}"])
def test_an_expression_too_costly_to_compile_is_refused_and_this_process_lives(text):
    # At its memory limit, not after gigabytes (or, on a machine busy enough, at its time limit).
    with pytest.raises(CompileTooCostly, match="(MB|s) to compile"):
        bounded_compile(text)
    assert bounded_compile("ab|c").fullmatch("c")  # and the next is checked as before


def test_a_client_expression_too_costly_is_a_pattern_error_a_400():
    with pytest.raises(PatternError, match="to compile"):
        compile_pattern(CRASHES)


def test_an_expression_that_does_not_compile_raises_the_regex_modules_own_error(probe):
    with pytest.raises(regex.error, match="missing \\)"):
        bounded_compile("a+(")
    assert probe.check("a+(") == "missing ) at position 3"  # the helper's answer: the complaint
    assert probe.check("a+") is None


def test_an_expression_is_checked_without_compiling_it_here(monkeypatch):
    """For an expression the machine holds (guided.py): the helper's verdict alone."""
    compiled = []
    original = regex.compile
    monkeypatch.setattr(regex, "compile", lambda text, *a, **k: compiled.append(text) or original(text, *a, **k))
    check_pattern(r"\d{4}-\d{2}")
    with pytest.raises(PatternError, match="does not compile \\(missing \\) at position 3\\)"):
        check_pattern("a+(")
    with pytest.raises(PatternError, match="(MB|s) to compile"):
        check_pattern(CRASHES)
    assert compiled == []


def test_the_memory_limit_is_what_the_probe_is_given(probe):
    probe.check("a{200000}")  # ~52 MB
    small = CompileProbe(memory_bytes=16 * 1024 * 1024, timeout_s=30)  # (memory decides, however busy the machine)
    try:
        with pytest.raises(CompileTooCostly, match="more than 16 MB"):
            small.check("a{200000}")
        small.check("a{1000}")
    finally:
        small.close()


def test_a_compile_past_the_time_limit_is_refused_and_its_helper_killed():
    hasty = CompileProbe(timeout_s=0.05)
    try:
        hasty.check("ab")
        pid = helper_pid(hasty)
        with pytest.raises(CompileTooCostly, match="longer than 0.05 s"):
            hasty.check(SLOWER)
        assert hasty._process is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped
    finally:
        hasty.close()


def test_the_helper_is_kept_between_checks_and_replaced_after_a_refusal(probe):
    probe.check("a")
    first = helper_pid(probe)
    probe.check("b+")
    assert helper_pid(probe) == first
    with pytest.raises(CompileTooCostly):
        probe.check(CRASHES)
    probe.check("c?")
    assert helper_pid(probe) != first


def test_a_helper_that_died_between_checks_is_replaced(probe):
    probe.check("a")
    os.kill(helper_pid(probe), signal.SIGKILL)
    probe._process.wait()
    probe.check("b")  # a fresh one answers
    assert probe._process.poll() is None


def test_the_servers_ctrl_c_does_not_reach_the_helper(probe):
    probe.check("a")
    pid = helper_pid(probe)
    os.kill(pid, signal.SIGINT)  # what a terminal's Ctrl-C sends the whole process group
    time.sleep(0.2)
    probe.check("b")
    assert helper_pid(probe) == pid


def test_close_stops_the_helper(probe):
    probe.check("a")
    process = probe._process
    probe.close()
    assert process.poll() is not None and probe._process is None
    probe.check("b")  # a later check starts another


def test_checks_from_many_threads_take_turns(probe):
    texts = [f"x{{{n}}}" for n in range(1, 9)] + [CRASHES]
    verdicts: dict[str, bool] = {}

    def check(text: str) -> None:
        try:
            probe.check(text)
            verdicts[text] = True
        except CompileTooCostly:
            verdicts[text] = False

    threads = [threading.Thread(target=check, args=(text,)) for text in texts * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert verdicts == {text: text != CRASHES for text in texts}


@pytest.mark.parametrize("python", ["/nonexistent/python", "/bin/true"])
def test_without_its_helper_every_expression_is_refused_not_compiled_unchecked(monkeypatch, python):
    """A helper that cannot start (no interpreter there) or exits at once: a 400 saying so."""
    monkeypatch.setattr("sys.executable", python)
    checker = CompileProbe()
    try:
        with pytest.raises(CompileTooCostly, match="cannot check expressions now"):
            checker.check("a")
    finally:
        checker.close()


def test_a_checked_expression_is_asked_of_the_helper_once(monkeypatch):
    """A request's fields are read twice (checked at arrival, then when it runs): the helper's
    compile, as long as the regex module's, is not paid twice."""
    import kvstream.hf.pattern_constraint as pattern_constraint

    asked = []
    monkeypatch.setattr(pattern_constraint, "compile_complaint", lambda text: asked.append(text))
    pattern_constraint.check_pattern.cache_clear()
    pattern_constraint.check_pattern(r"\d{5}")
    pattern_constraint.check_pattern(r"\d{5}")
    assert asked == [r"\d{5}"]
