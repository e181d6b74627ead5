"""The physical KV memory of the in-process engine: a device pool and a host swap pool.

Both are one tensor per K and V shaped ``[layers, blocks, block_size, kv_heads, head_dim]``,
token-major, so a block is one contiguous slab in every layer. Every copy the block manager
asks for (copy-on-write, swap out, swap in) is then a single ``index_select`` /
``index_copy_`` over all layers at once, whatever the number of blocks moved.

With ``swap_bits`` (the engine's ``kv_cache_bits``) the host pool is KIVI-quantized instead
(``SwapStore``): swapped blocks take 8 or 4 bits per value plus small fp16 ranges, and a
sequence's partial last block is kept exact.

Which block holds which tokens is the BlockManager's business; this module only moves bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvstream.hf.kv_quant import QuantizedTensor, dequantize, quantize

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
        swap_bits: int | None = None,
    ) -> None:
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.dtype = dtype
        self.swap_bits = swap_bits
        dims = (shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        # Zero-filled, not empty: padded attention reads unused slots (masked out), and a NaN
        # left there by chance would still poison the softmax product.
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)
        host_dims = (shape.num_layers, num_cpu_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        pin = device.type == "cuda"
        if swap_bits is None:
            self.host_k = torch.zeros(host_dims, dtype=dtype, pin_memory=pin)
            self.host_v = torch.zeros(host_dims, dtype=dtype, pin_memory=pin)
        else:
            # KIVI-quantized host pool (kv_quant.py): codes plus a fp16 (min, scale) per key
            # channel per block and per value token. A sequence's partial last block is kept
            # at full precision in ``host_exact`` instead (its unused slots would only widen
            # the key ranges).
            self.host_q = SwapStore(host_dims, swap_bits, pin)
            self.host_exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Flat per-layer views, slot = block_id * block_size + offset: what attention indexes.
        self.flat_k = self.k.view(shape.num_layers, num_blocks * block_size, shape.num_kv_heads, shape.head_dim)
        self.flat_v = self.v.view(shape.num_layers, num_blocks * block_size, shape.num_kv_heads, shape.head_dim)

    def release(self) -> None:
        """Free the pools' memory: the runner is closed and nothing reads them again (a
        closed backend an application or a test still holds costs nothing)."""
        self.num_blocks = self.num_cpu_blocks = 0
        self.k = self.v = self.flat_k = self.flat_v = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.swap_bits is None:
            self.host_k = self.host_v = torch.empty(0, dtype=self.dtype)
        else:
            self.host_q = SwapStore((self.shape.num_layers, 0, self.block_size, self.shape.num_kv_heads, self.shape.head_dim),
                                    self.swap_bits, False)
            self.host_exact.clear()

    @property
    def device_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def host_bytes(self) -> int:
        if self.swap_bits is not None:
            return self.host_q.nbytes + sum(k.numel() * k.element_size() * 2 for k, _ in self.host_exact.values())
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

    def swap_out(self, pairs: list[tuple[int, int]], exact: set[int] | frozenset[int] = frozenset()) -> None:
        """Device to host: ``(device_id, host_id)``. Must run before the device blocks are
        written again (the scheduler may hand them to another sequence in the same pass).
        With a quantized host pool, the host ids in ``exact`` (partial blocks) stay exact."""
        if not pairs:
            return
        if self.swap_bits is not None:
            self._swap_out_quantized(pairs, exact)
            return
        src = self._ids((s for s, _ in pairs), self.device)
        dst = self._ids((d for _, d in pairs), torch.device("cpu"))
        for pool, host in ((self.k, self.host_k), (self.v, self.host_v)):
            host.index_copy_(1, dst, pool.index_select(1, src).to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host to device: ``(host_id, device_id)``."""
        if not pairs:
            return
        if self.swap_bits is not None:
            self._swap_in_quantized(pairs)
            return
        src = self._ids((s for s, _ in pairs), torch.device("cpu"))
        dst = self._ids((d for _, d in pairs), self.device)
        for pool, host in ((self.k, self.host_k), (self.v, self.host_v)):
            pool.index_copy_(1, dst, host.index_select(1, src).to(self.device, non_blocking=True))

    def _swap_out_quantized(self, pairs: list[tuple[int, int]], exact: set[int] | frozenset[int]) -> None:
        whole = [(d, h) for d, h in pairs if h not in exact]
        for device_id, host_id in pairs:
            if host_id in exact:
                self.host_exact[host_id] = (self.k[:, device_id].cpu().clone(), self.v[:, device_id].cpu().clone())
            else:  # a host block freed while swapped (its sequence aborted) may be reused
                self.host_exact.pop(host_id, None)
        if whole:
            src = self._ids((d for d, _ in whole), self.device)
            self.host_q.put([h for _, h in whole], self.k.index_select(1, src).cpu(), self.v.index_select(1, src).cpu())

    def _swap_in_quantized(self, pairs: list[tuple[int, int]]) -> None:
        whole = [(h, d) for h, d in pairs if h not in self.host_exact]
        for host_id, device_id in pairs:
            kept = self.host_exact.pop(host_id, None)
            if kept is not None:
                self.k[:, device_id] = kept[0].to(self.device)
                self.v[:, device_id] = kept[1].to(self.device)
        if whole:
            k, v = self.host_q.get([h for h, _ in whole], self.dtype)
            dst = self._ids((d for _, d in whole), self.device)
            self.k.index_copy_(1, dst, k.to(self.device))
            self.v.index_copy_(1, dst, v.to(self.device))


class SwapStore:
    """The quantized host swap pool: per host block, KIVI codes of K (per channel over the
    block's tokens) and V (per token), with their fp16 (min, scale)."""

    def __init__(self, dims: tuple[int, ...], bits: int, pin: bool) -> None:
        layers, blocks, bs, heads, dim = dims
        self.bits = bits
        packed = dim * bits // 8
        self.k_codes = torch.zeros((layers, blocks, bs, heads, packed), dtype=torch.uint8, pin_memory=pin)
        self.v_codes = torch.zeros((layers, blocks, bs, heads, packed), dtype=torch.uint8, pin_memory=pin)
        self.k_min = torch.zeros((layers, blocks, 1, heads, dim), dtype=torch.float16, pin_memory=pin)
        self.k_scale = torch.zeros_like(self.k_min)
        self.v_min = torch.zeros((layers, blocks, bs, heads, 1), dtype=torch.float16, pin_memory=pin)
        self.v_scale = torch.zeros_like(self.v_min)
        self.block_shape = (layers, bs, heads, dim)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.v_codes, self.k_min, self.k_scale, self.v_min, self.v_scale))

    def put(self, host_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v`` ``[layers, n, block_size, heads, dim]`` into ``host_ids``."""
        ids = torch.tensor(host_ids, dtype=torch.long)
        qk = quantize(k, self.bits, axis=2)  # per channel: a group spans the block's tokens
        qv = quantize(v, self.bits, axis=4)  # per token: a group spans the head's channels
        for store, value in ((self.k_codes, qk.codes), (self.k_min, qk.minimum), (self.k_scale, qk.scale),
                             (self.v_codes, qv.codes), (self.v_min, qv.minimum), (self.v_scale, qv.scale)):
            store.index_copy_(1, ids, value)

    def get(self, host_ids: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(host_ids, dtype=torch.long)
        shape = (self.k_codes.shape[0], len(host_ids), *self.block_shape[1:])

        def take(codes, minimum, scale) -> torch.Tensor:
            q = QuantizedTensor(codes.index_select(1, ids), minimum.index_select(1, ids), scale.index_select(1, ids), self.bits, shape)
            return dequantize(q, dtype)

        return take(self.k_codes, self.k_min, self.k_scale), take(self.v_codes, self.v_min, self.v_scale)


AUTO_BATCH_POOL_TOKENS = 1024  # pool tokens per sequence the auto batch size allows for
AUTO_BATCH_RANGE = (8, 256)


def auto_batch_size(num_blocks: int, block_size: int) -> int:
    """Sequences run at once when the setting is "auto": as many as the pool holds at
    AUTO_BATCH_POOL_TOKENS each, within AUTO_BATCH_RANGE. A decode step costs little more
    for a wider batch (the weights are read once per step whatever its width), so width is
    throughput; sequences that outgrow the pool are preempted, which the scheduler handles."""
    low, high = AUTO_BATCH_RANGE
    return max(low, min(high, num_blocks * block_size // AUTO_BATCH_POOL_TOKENS))


POOL_DTYPES = ("float32", "float16", "bfloat16")


def pool_dtype(name: str | None) -> torch.dtype | None:
    """The KV pool dtype ``name`` asks for (``memory.kv_dtype``); None for None or "auto" (the
    model's). Raises ValueError naming the choices for anything else."""
    if name is None or name == "auto":
        return None
    if name not in POOL_DTYPES:
        raise ValueError(f"kv_dtype {name!r} is not one of {', '.join(POOL_DTYPES)}")
    return getattr(torch, name)


def auto_num_blocks(
    model: torch.nn.Module, block_size: int, budget_bytes: int | None = None, kv_dtype: torch.dtype | None = None
) -> int:
    """Device blocks for ``model`` within ``budget_bytes`` (default: 1 GiB on CPU, 40% of
    the free memory on CUDA), K/V held in ``kv_dtype`` (default: the model's)."""
    param = next(model.parameters())
    if budget_bytes is None:
        if param.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(param.device)
            budget_bytes = int(free * CUDA_KV_FRACTION)
        else:
            budget_bytes = DEFAULT_CPU_KV_BYTES
    return max(4, budget_bytes // (KVShape.of(model.config).bytes_per_token(kv_dtype or param.dtype) * block_size))
