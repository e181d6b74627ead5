"""``kvstream bench``: a load generator for any OpenAI-compatible URL, measured as vLLM's
``bench serve`` measures, plus what only a proxy can report (queue time, prefix hits)."""
