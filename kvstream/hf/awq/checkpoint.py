"""AWQ checkpoint folders: reading their tensors without loading them, writing new ones.

``SafetensorsIndex`` parses the safetensors headers of a folder (one file, or shards named
by ``model.safetensors.index.json``) and hands out tensors either memory-mapped (private,
read-only pages: nothing is read until touched, and untouched pages cost no RAM) or copied
into memory. A folder is AWQ when its ``config.json`` has ``quantization_config``
``{"quant_method": "awq", "bits": 4, "version": "gemm", ...}``.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstream.hf.awq.format import SUPPORTED_GROUP_SIZES

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A folder that is not a usable AWQ checkpoint; the message names the file or key."""


@dataclass(frozen=True)
class TensorRef:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsIndex:
    """Every tensor of a folder's safetensors files, by name, without reading the data."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.refs: dict[str, TensorRef] = {}
        self._storages: dict[Path, torch.UntypedStorage] = {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no .safetensors files")
        for name in files:
            path = folder / name
            if not path.is_file():
                raise CheckpointError(f"{folder}: shard {name} named by model.safetensors.index.json is missing")
            self._read_header(path)

    def _read_header(self, path: Path) -> None:
        length = path.stat().st_size
        with open(path, "rb") as f:
            first = f.read(8)
            size = struct.unpack("<Q", first)[0] if len(first) == 8 else -1
            if not 0 < size <= length - 8:
                raise CheckpointError(f"{path.name}: not a safetensors file (no header length that fits its {length} bytes)")
            try:
                header = json.loads(f.read(size))
            except ValueError as exc:
                raise CheckpointError(f"{path.name}: not a safetensors file (its header is not JSON: {exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path.name}: not a safetensors file (its header is not a JSON object)")
        base = 8 + size
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in DTYPES:
                raise CheckpointError(f"{path.name}: tensor {name} has dtype {meta['dtype']}, which is not supported")
            start, end = meta["data_offsets"]
            self.refs[name] = TensorRef(path, DTYPES[meta["dtype"]], tuple(meta["shape"]), base + start, base + end)

    def __contains__(self, name: str) -> bool:
        return name in self.refs

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor as a view of the file's pages (copy-on-write; never written)."""
        ref = self._ref(name)
        storage = self._storages.get(ref.file)
        if storage is None:
            storage = torch.UntypedStorage.from_file(str(ref.file), shared=False, nbytes=ref.file.stat().st_size)
            self._storages[ref.file] = storage
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, ref.start, (ref.nbytes,))
        if ref.start % max(1, torch.empty(0, dtype=ref.dtype).element_size()):
            raw = raw.clone()  # misaligned for its dtype: a copy can be viewed
        return raw.view(ref.dtype).reshape(ref.shape)

    def is_mapped(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of one of this index's file mappings (not a copy)."""
        pointer = tensor.untyped_storage().data_ptr()
        return any(pointer == storage.data_ptr() for storage in self._storages.values())

    def file_range(self, tensor: torch.Tensor) -> tuple[str, int, int]:
        """(file, start, end): where a tensor that is a view of one of this index's file
        mappings lies in its file, in bytes."""
        base = tensor.untyped_storage().data_ptr()
        for file, storage in self._storages.items():
            if storage.data_ptr() == base:
                start = tensor.data_ptr() - base  # a mapping covers its whole file from byte 0
                return str(file), start, start + tensor.numel() * tensor.element_size()
        raise ValueError("the tensor is not a view of this checkpoint's mappings")

    def load(self, name: str) -> torch.Tensor:
        """The tensor copied into memory."""
        return self.mapped(name).clone()

    def _ref(self, name: str) -> TensorRef:
        ref = self.refs.get(name)
        if ref is None:
            raise CheckpointError(f"{self.folder}: tensor {name} is not in the checkpoint")
        return ref


def awq_settings(folder: Path) -> dict[str, Any] | None:
    """The folder's AWQ ``quantization_config``, checked; None when the folder is not AWQ.
    Raises CheckpointError for an AWQ config the engine cannot run."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        return None
    quant = json.loads(config_path.read_text()).get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "awq":
        return None
    problems = []
    if quant.get("bits") != 4:
        problems.append(f"bits {quant.get('bits')} (only 4)")
    if quant.get("group_size") not in SUPPORTED_GROUP_SIZES:
        problems.append(f"group_size {quant.get('group_size')} (one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))})")
    if str(quant.get("version", "gemm")).lower() != "gemm":
        problems.append(f"version {quant.get('version')} (only gemm)")
    if quant.get("zero_point", True) is not True:
        problems.append("zero_point false (only asymmetric)")
    if problems:
        raise CheckpointError(f"{config_path}: quantization_config has " + "; ".join(problems))
    return quant


def awq_config(group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` KVStream writes (AutoAWQ's GEMM format)."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm", "modules_to_not_convert": None}


DATA_ALIGNMENT = 64


def align_data(path: Path) -> bool:
    """Pad a safetensors file's header with spaces (the format allows trailing whitespace
    there) so that its data starts on a 64-byte boundary of the file, hence of a mapping of
    it; False when it already did. Tensor offsets are sums of the tensors' sizes, for AWQ
    checkpoints' shapes multiples of 32 bytes, so every packed tensor then starts 32-byte
    aligned, and the AWQ kernel's 32-byte loads from a mapped layer never straddle two cache
    lines (as ``save_file`` writes them they sat 16 bytes off: mapped decode 1.11x aligned,
    benchmarks/awq_alignment.py). The file is replaced whole, never left half written."""
    with open(path, "rb") as source:
        (size,) = struct.unpack("<Q", source.read(8))
        header = source.read(size)
        pad = -(8 + size) % DATA_ALIGNMENT
        if pad == 0:
            return False
        staged = path.with_name(path.name + ".aligning")
        try:
            with open(staged, "wb") as target:
                target.write(struct.pack("<Q", size + pad) + header + b" " * pad)
                shutil.copyfileobj(source, target, 16 * 2**20)
            shutil.copymode(path, staged)
        except BaseException:  # a full disk, Ctrl-C: the original stays, the partial copy goes
            staged.unlink(missing_ok=True)
            raise
    staged.replace(path)
    return True


def align_folder(folder: Path) -> tuple[int, int, int, int]:
    """``align_data`` on every safetensors file of a checkpoint folder (read as
    ``SafetensorsIndex`` reads it: CheckpointError names what is wrong) -> (files realigned,
    files, packed tensors now starting 32-byte aligned, packed tensors)."""
    files = sorted({ref.file for ref in SafetensorsIndex(folder).refs.values()})
    realigned = sum(align_data(path) for path in files)
    refs = SafetensorsIndex(folder).refs
    packed = [ref for name, ref in refs.items() if name.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales")]
    return realigned, len(files), sum(ref.start % 32 == 0 for ref in packed), len(packed)
