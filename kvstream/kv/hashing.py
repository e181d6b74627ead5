"""Chained, process-independent hashes of full KV blocks.

A block's hash covers its parent's hash, its own token ids and the model identity, so two
blocks hash equal only if the whole prefix up to and including them is equal (for the same
model). blake2b over fixed-width little-endian bytes is deterministic across processes and
machines, unlike Python's ``hash()``, so a hash can name a file on disk or be shared between
replicas.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_DIGEST_SIZE = 16


def model_key(identity: str) -> bytes:
    """The salt that ties hashes to one model (and anything else that changes its KV)."""
    return hashlib.blake2b(identity.encode(), digest_size=_DIGEST_SIZE).digest()


def tenant_root(salt: str | None) -> BlockHash | None:
    """The chain root of a tenant's blocks: its prefixes hash apart from everyone else's,
    so they can neither be matched nor confirmed by another tenant. None: no tenant."""
    if not salt:
        return None
    return hashlib.blake2b(salt.encode(), digest_size=_DIGEST_SIZE, person=b"kvstream-tenant").digest()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes) -> BlockHash:
    """Hash one full block, chained on its parent block's hash."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE, key=salt)
    h.update(parent or b"\0" * _DIGEST_SIZE)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes, root: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a partial tail block gets none), chained
    from ``root`` (a tenant's, or None)."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
