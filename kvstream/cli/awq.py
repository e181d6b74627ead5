"""``kvstream awq quantize``: an AWQ checkpoint from an HF model folder (or the embedded one);
``kvstream awq align``: a checkpoint's packed tensors 32-byte aligned in place."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger("kvstream")


def quantize(out: Path, model: str | None, group_size: int | None, calibration: Path | None, method: str, samples: int, evaluate: bool) -> int:
    """Returns the exit code: 0, or 2 for bad input (one line on stderr)."""
    from kvstream.hf.backend import missing_requirements

    if (problem := missing_requirements()) is not None:
        print(problem, file=sys.stderr)
        return 2
    if method not in ("awq", "rtn"):
        print(f"--method must be awq or rtn, not {method!r}", file=sys.stderr)
        return 2
    if calibration is not None and not calibration.is_file():
        print(f"--calibration {calibration}: no such file", file=sys.stderr)
        return 2
    if out.exists() and any(out.iterdir()):
        print(f"--out {out}: the folder exists and is not empty", file=sys.stderr)
        return 2

    from kvstream.hf.awq import quantize as awq
    from kvstream.hf.awq.model import load_awq_model
    from kvstream.hf.loader import load_model

    try:
        # Every weight upcast (no half storage): the search rescales the float32 nn.Linear layers.
        loaded = load_model(model, dtype="float32", device="cpu", half_weights=False)
        size = awq.choose_group_size(loaded.model, group_size)
        text = calibration.read_text() if calibration is not None else awq.default_calibration_text()
        heldout = awq.heldout_text() if evaluate else ""
        before = awq.perplexity(loaded.model, loaded.tokenizer, heldout) if evaluate else None
        started = time.monotonic()
        state = awq.quantize_model(loaded.model, loaded.tokenizer, size, text, activation_aware=method == "awq", samples=samples,
                                   progress=lambda step: logger.info("quantizing: %s", step))
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    source = Path(loaded.model.config._name_or_path) if loaded.model.config._name_or_path else None
    awq.save_checkpoint(out, loaded.model, loaded.tokenizer, state, size, source if source and source.is_dir() else None)
    print(f"wrote {out} ({method}, group size {size}) in {time.monotonic() - started:.0f}s")
    if evaluate:
        import torch

        quantized, _ = load_awq_model(out, torch.float32)
        after = awq.perplexity(quantized, loaded.tokenizer, heldout)
        print(f"perplexity on held-out text: original {before:.2f}, {method} 4-bit {after:.2f}")
    return 0


def align(folder: Path) -> int:
    """Returns the exit code: 0, or 2 for a folder that is not a readable checkpoint (one line
    on stderr, as for a proxy-only install)."""
    from kvstream.hf.backend import missing_requirements

    if (problem := missing_requirements()) is not None:
        print(problem, file=sys.stderr)
        return 2
    from kvstream.hf.awq.checkpoint import CheckpointError, align_folder

    if not folder.is_dir():
        print(f"{folder}: no such folder", file=sys.stderr)
        return 2
    try:
        realigned, files, aligned, packed = align_folder(folder)
    except (CheckpointError, OSError) as exc:
        print(f"{folder}: not a readable safetensors checkpoint ({exc})", file=sys.stderr)
        return 2
    print(f"{folder}: {realigned} of {files} safetensors files realigned; {aligned} of {packed} packed tensors start 32-byte aligned")
    return 0
