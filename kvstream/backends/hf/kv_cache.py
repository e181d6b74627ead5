"""The physical KV memory of the in-process engine: a device pool and a host swap pool.

Both are one tensor per K and V shaped ``[layers, blocks, block_size, kv_heads, head_dim]``,
token-major, so a block is one contiguous slab in every layer. Every copy the block manager
asks for (copy-on-write, swap out, swap in) is then a single ``index_select`` /
``index_copy_`` over all layers at once, whatever the number of blocks moved.

Which block holds which tokens is the BlockManager's business; this module only moves bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


# Pool size when neither num_gpu_blocks nor kv_cache_bytes is set, on CPU.
DEFAULT_CPU_KV_BYTES = 1024**3
# Share of free device memory the pool takes on CUDA by default.
CUDA_KV_FRACTION = 0.4


@dataclass(frozen=True)
class KVShape:
    """The per-token KV geometry of a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVShape:
        """The geometry of a transformers model config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class PagedKVCache:
    """``num_blocks`` device blocks and ``num_cpu_blocks`` host blocks of ``block_size`` tokens."""

    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        dims = (shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        # Zero-filled, not empty: padded attention reads unused slots (masked out), and a NaN
        # left there by chance would still poison the softmax product.
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)
        host_dims = (shape.num_layers, num_cpu_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        pin = device.type == "cuda"
        self.host_k = torch.zeros(host_dims, dtype=dtype, pin_memory=pin)
        self.host_v = torch.zeros(host_dims, dtype=dtype, pin_memory=pin)
        # Flat per-layer views, slot = block_id * block_size + offset: what attention indexes.
        self.flat_k = self.k.view(shape.num_layers, num_blocks * block_size, shape.num_kv_heads, shape.head_dim)
        self.flat_v = self.v.view(shape.num_layers, num_blocks * block_size, shape.num_kv_heads, shape.head_dim)

    @property
    def device_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def host_bytes(self) -> int:
        return self.host_k.numel() * self.host_k.element_size() * 2

    def _ids(self, ids: Iterable[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device to device (copy-on-write): ``(src, dst)`` block ids."""
        if not pairs:
            return
        src = self._ids((s for s, _ in pairs), self.device)
        dst = self._ids((d for _, d in pairs), self.device)
        for pool in (self.k, self.v):
            pool.index_copy_(1, dst, pool.index_select(1, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device to host: ``(device_id, host_id)``. Must run before the device blocks are
        written again (the scheduler may hand them to another sequence in the same pass)."""
        if not pairs:
            return
        src = self._ids((s for s, _ in pairs), self.device)
        dst = self._ids((d for _, d in pairs), torch.device("cpu"))
        for pool, host in ((self.k, self.host_k), (self.v, self.host_v)):
            host.index_copy_(1, dst, pool.index_select(1, src).to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host to device: ``(host_id, device_id)``."""
        if not pairs:
            return
        src = self._ids((s for s, _ in pairs), torch.device("cpu"))
        dst = self._ids((d for _, d in pairs), self.device)
        for pool, host in ((self.k, self.host_k), (self.v, self.host_v)):
            pool.index_copy_(1, dst, host.index_select(1, src).to(self.device, non_blocking=True))


def auto_num_blocks(model: torch.nn.Module, block_size: int, budget_bytes: int | None = None) -> int:
    """Device blocks for ``model`` within ``budget_bytes`` (default: 1 GiB on CPU, 40% of
    the free memory on CUDA)."""
    param = next(model.parameters())
    if budget_bytes is None:
        if param.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(param.device)
            budget_bytes = int(free * CUDA_KV_FRACTION)
        else:
            budget_bytes = DEFAULT_CPU_KV_BYTES
    return max(4, budget_bytes // (KVShape.of(model.config).bytes_per_token(param.dtype) * block_size))
