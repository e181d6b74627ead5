"""Spill tiers under the device KV pool: host RAM, then a file on disk.

When the pool reclaims a cached block (LRU) its KV is not thrown away but spilled here,
keyed by the block's chained hash (which names the whole prefix up to it). A later request
whose prefix continues past what the pool still holds finds the rest here, and the engine
copies it back into fresh pool blocks instead of recomputing it.

* Every block is stored as one fixed-size record (BlockCodec): K and V at the model's
  precision, or KIVI-quantized to 8 or 4 bits (kv_quant.py).
* HostBlockStore keeps records in RAM within a byte budget, least recently used out first;
  what it drops goes to the DiskBlockStore, when there is one.
* DiskBlockStore keeps records in one preallocated file, memory-mapped, with an append-only
  index beside it (slot, hash, checksum, token ids). The index is replayed on open, so a
  restarted server answers the prefixes it knew warm. A record whose checksum does not match
  (a crash mid-write, a damaged file) is treated as a miss, never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from collections import OrderedDict
from pathlib import Path

import torch

from kvstream.hf.kv_quant import KEY_AXIS, VALUE_AXIS, QuantizedTensor, dequantize, quantize
from kvstream.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


class BlockCodec:
    """Turns one block's K and V (``[layers, block_size, kv_heads, head_dim]`` each) into a
    fixed-size byte record and back."""

    def __init__(self, layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, bits: int | None) -> None:
        self.block_shape = (layers, block_size, kv_heads, head_dim)
        self.dtype = dtype
        self.bits = bits
        # (name, dtype, shape) of every tensor in a record, in order.
        if bits is None:
            self.parts = [("k", dtype, self.block_shape), ("v", dtype, self.block_shape)]
        else:
            packed = (layers, block_size, kv_heads, head_dim * bits // 8)
            k_groups = (layers, 1, kv_heads, head_dim)
            v_groups = (layers, block_size, kv_heads, 1)
            self.parts = [
                ("k_codes", torch.uint8, packed), ("k_min", torch.float16, k_groups), ("k_scale", torch.float16, k_groups),
                ("v_codes", torch.uint8, packed), ("v_min", torch.float16, v_groups), ("v_scale", torch.float16, v_groups),
            ]
        self.sizes = [_numel(shape) * _itemsize(dt) for _, dt, shape in self.parts]
        self.record_bytes = sum(self.sizes)

    @property
    def layout(self) -> str:
        """What a record's bytes mean; a disk tier written with another layout is discarded."""
        return f"v{FORMAT_VERSION} shape={self.block_shape} dtype={self.dtype} bits={self.bits}"

    @property
    def full_precision_bytes(self) -> int:
        return 2 * _numel(self.block_shape) * _itemsize(self.dtype)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One record: a flat uint8 tensor of ``record_bytes`` on the CPU."""
        k, v = k.detach().cpu(), v.detach().cpu()
        if self.bits is None:
            tensors = [k.to(self.dtype), v.to(self.dtype)]
        else:
            qk, qv = quantize(k, self.bits, KEY_AXIS), quantize(v, self.bits, VALUE_AXIS)
            tensors = [qk.codes, qk.minimum, qk.scale, qv.codes, qv.minimum, qv.scale]
        return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])

    def decode(self, record: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a record, at the model's dtype on ``device``."""
        tensors, offset = [], 0
        for (_, dtype, shape), size in zip(self.parts, self.sizes, strict=True):
            tensors.append(record[offset : offset + size].view(dtype).reshape(shape))
            offset += size
        if self.bits is None:
            return tensors[0].to(device), tensors[1].to(device)
        k = QuantizedTensor(tensors[0], tensors[1], tensors[2], self.bits, self.block_shape)
        v = QuantizedTensor(tensors[3], tensors[4], tensors[5], self.bits, self.block_shape)
        return dequantize(k, self.dtype, device), dequantize(v, self.dtype, device)


class DiskBlockStore:
    """Fixed-size records in one memory-mapped file, at most ``max_bytes`` of them."""

    def __init__(self, directory: str | Path, codec: BlockCodec, max_bytes: int, identity: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.codec = codec
        self.record_bytes = codec.record_bytes
        self.num_slots = max(1, max_bytes // self.record_bytes)
        self._data_path, self._index_path, meta_path = self.dir / "blocks.bin", self.dir / "index.log", self.dir / "meta.json"
        meta = {"format": FORMAT_VERSION, "identity": identity, "layout": codec.layout, "num_slots": self.num_slots}
        if not meta_path.exists() or _read_json(meta_path) != meta:
            # Another model, precision or size: none of the old records can be read as ours.
            for path in (self._data_path, self._index_path):
                path.unlink(missing_ok=True)
            meta_path.write_text(json.dumps(meta))
        with open(self._data_path, "a+b") as f:
            f.truncate(self.num_slots * self.record_bytes)  # sparse: costs disk only as filled
        self._file = open(self._data_path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), self.num_slots * self.record_bytes)
        # hash -> (slot, checksum, token ids), least recently used first.
        self._entries: OrderedDict[BlockHash, tuple[int, bytes, tuple[int, ...]]] = OrderedDict()
        self._free: list[int] = []
        self._replay_index()
        self._index = open(self._index_path, "a", encoding="ascii")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return len(self._entries) * self.record_bytes

    def contains(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry[2] == token_ids

    def get(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The record for ``block_hash``, or None (absent, other tokens, or damaged)."""
        entry = self._entries.get(block_hash)
        if entry is None or entry[2] != token_ids:
            return None
        slot, checksum, _ = entry
        start = slot * self.record_bytes
        data = self._map[start : start + self.record_bytes]
        if _checksum(data) != checksum:
            logger.warning("disk KV record %d is damaged; recomputing that block", slot)
            self._drop(block_hash)
            return None
        self._entries.move_to_end(block_hash)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def put(self, block_hash: BlockHash, token_ids: tuple[int, ...], record: torch.Tensor) -> None:
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        if self._free:
            slot = self._free.pop()
        else:  # full: reuse the least recently used slot
            _, (slot, _, _) = self._entries.popitem(last=False)
        data = record.numpy().tobytes()
        start = slot * self.record_bytes
        self._map[start : start + self.record_bytes] = data
        checksum = _checksum(data)
        self._entries[block_hash] = (slot, checksum, token_ids)
        # The record is written before the index line that points at it; the checksum covers
        # a crash between a slot's reuse and its new line.
        self._index.write(f"{slot} {block_hash.hex()} {checksum.hex()} {','.join(map(str, token_ids))}\n")

    def flush(self) -> None:
        self._map.flush()
        self._index.flush()
        os.fsync(self._index.fileno())

    def close(self) -> None:
        if self._file.closed:
            return
        self.flush()
        self._index.close()
        self._map.close()
        self._file.close()

    def _drop(self, block_hash: BlockHash) -> None:
        slot, _, _ = self._entries.pop(block_hash)
        self._free.append(slot)

    def _replay_index(self) -> None:
        """Rebuild the map from the index (a later line for a slot replaces an earlier one),
        then rewrite the index with only the live lines."""
        by_slot: dict[int, tuple[BlockHash, bytes, tuple[int, ...]]] = {}
        if self._index_path.exists():
            for line in self._index_path.read_text(encoding="ascii", errors="replace").splitlines():
                try:
                    slot_s, hash_hex, checksum_hex, tokens_s = line.split(" ")
                    slot = int(slot_s)
                    entry = (bytes.fromhex(hash_hex), bytes.fromhex(checksum_hex), tuple(int(t) for t in tokens_s.split(",")))
                except ValueError:
                    continue  # a torn last line from a crash
                if 0 <= slot < self.num_slots:
                    by_slot[slot] = entry
        for slot, (block_hash, checksum, tokens) in by_slot.items():
            self._entries.pop(block_hash, None)  # the same hash twice: the later slot wins
            self._entries[block_hash] = (slot, checksum, tokens)
        used = {slot for slot, _, _ in self._entries.values()}
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
        tmp = self._index_path.with_suffix(".tmp")
        tmp.write_text(
            "".join(f"{s} {h.hex()} {c.hex()} {','.join(map(str, t))}\n" for h, (s, c, t) in self._entries.items()),
            encoding="ascii",
        )
        os.replace(tmp, self._index_path)


class HostBlockStore:
    """Records in RAM within ``max_bytes``; the least recently used go to ``disk`` (if any)."""

    def __init__(self, codec: BlockCodec, max_bytes: int, disk: DiskBlockStore | None = None) -> None:
        self.codec = codec
        self.max_records = max_bytes // codec.record_bytes
        self.disk = disk
        self._records: OrderedDict[BlockHash, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.spilled = 0  # blocks received from the pool (the engine counts what comes back)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes_used(self) -> int:
        return len(self._records) * self.codec.record_bytes

    def contains(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        entry = self._records.get(block_hash)
        if entry is not None:
            return entry[0] == token_ids
        return self.disk is not None and self.disk.contains(block_hash, token_ids)

    def get(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        entry = self._records.get(block_hash)
        if entry is not None:
            if entry[0] != token_ids:
                return None
            self._records.move_to_end(block_hash)
            return entry[1]
        return self.disk.get(block_hash, token_ids) if self.disk is not None else None

    def put(self, block_hash: BlockHash, token_ids: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one block (K and V ``[layers, block_size, kv_heads, head_dim]``)."""
        self.spilled += 1
        if block_hash in self._records:
            self._records.move_to_end(block_hash)
            return
        record = self.codec.encode(k, v)
        if self.max_records == 0:
            if self.disk is not None:
                self.disk.put(block_hash, token_ids, record)
            return
        self._records[block_hash] = (token_ids, record)
        while len(self._records) > self.max_records:
            old_hash, (old_tokens, old_record) = self._records.popitem(last=False)
            if self.disk is not None:
                self.disk.put(old_hash, old_tokens, old_record)

    def persist(self) -> None:
        """Write every RAM record to disk too (at shutdown: a restart then finds them)."""
        if self.disk is None:
            return
        for block_hash, (tokens, record) in self._records.items():
            self.disk.put(block_hash, tokens, record)
        self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.persist()
            self.disk.close()


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
