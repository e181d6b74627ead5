"""The KV mechanism: a block pool, block tables with prefix sharing, copy-on-write and swap."""

from kvstream.kv.block_manager import UNKNOWN_TOKEN, BlockManager, BlockTable
from kvstream.kv.block_pool import Block, BlockPool, NoFreeBlocks
from kvstream.kv.hashing import block_hashes, hash_block, model_key

__all__ = [
    "UNKNOWN_TOKEN",
    "Block",
    "BlockManager",
    "BlockPool",
    "BlockTable",
    "NoFreeBlocks",
    "block_hashes",
    "hash_block",
    "model_key",
]
