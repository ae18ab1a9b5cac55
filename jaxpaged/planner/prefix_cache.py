"""The prefix cache's key: a chained digest per full page, so equal prefixes find equal pages.

    page 0 key: (None,            cache_salt, tokens[0:ps])   -> digest d0
    page 1 key: (d0,              cache_salt, tokens[ps:2ps]) -> digest d1
    page i key: (d(i-1),          cache_salt, tokens of page i)

A page's digest covers every token before it (through its parent's digest) and the tenant's salt,
so two sequences share page i exactly when they share pages 0..i and the salt. After the engine's
weights change (`update_params`), sequences admitted from then on carry the new weight epoch in
their salt (`versioned_salt`): pages computed under other weights are never served to them. A
request under a LoRA adapter carries the adapter's (lora_int_id, version) in its salt too: pages
computed under adapter A never serve adapter B, the base model, or A after its weights were replaced
(version). The block manager
(block_manager.py) keeps the digest -> page index and confirms every hit against the stored key.
Pure Python (no jax).
"""

from __future__ import annotations

import array
import hashlib

from jaxpaged.planner.sequence import Sequence

# A sequence's salt: the tenant's cache_salt (None or str), paired with the weight epoch once the
# weights have changed at least once: (cache_salt, epoch), epoch >= 1; under a LoRA adapter
# (cache_salt, epoch >= 0, (lora_int_id, adapter version)).
Salt = str | None | tuple[str | None, int] | tuple[str | None, int, tuple[int, int]]
# (parent page's digest or None for page 0, salt, this page's token ids): what a page's digest covers.
PageKey = tuple[bytes | None, Salt, tuple[int, ...]]


def versioned_salt(cache_salt: Salt, weight_epoch: int, adapter: tuple[int, int] | None = None) -> Salt:
    """The salt of a sequence computed under weight epoch `weight_epoch` (0: the weights it was
    built with, where the salt stays the plain cache_salt) and LoRA `adapter` (lora_int_id, version).
    Re-salting keeps the tenant's part, and the adapter's when none is given."""
    tenant = cache_salt[0] if isinstance(cache_salt, tuple) else cache_salt
    if adapter is None and isinstance(cache_salt, tuple) and len(cache_salt) == 3:
        adapter = cache_salt[2]
    if adapter is not None:
        return (tenant, weight_epoch, adapter)
    return tenant if weight_epoch == 0 else (tenant, weight_epoch)


def hash_page(parent_hash: bytes | None, cache_salt: Salt, token_ids: tuple[int, ...]) -> bytes:
    """Chained 32-byte blake2b digest of one full page; a hit is also confirmed against the stored key.

    The stored key names the parent by digest, so the chain is only as safe as the digest: a
    fast hash without a secret (Python's hash) lets two different parents collide, and a child
    page computed after one would be served after the other. The input is unambiguous:

        parent digest (32 bytes, or 1 byte 0x00 for page 0) | salt (0x00, or 0x01 + 8-byte
        length + UTF-8, or 0x02 + 8-byte weight epoch + one of the two before, or 0x03 + 8-byte
        lora_int_id + 8-byte adapter version + one of the three before) | token ids (8 bytes
        each, native byte order: keys never leave the process)
    """
    h = hashlib.blake2b(parent_hash if parent_hash is not None else b"\x00", digest_size=32)
    if isinstance(cache_salt, tuple) and len(cache_salt) == 3:
        cache_salt, weight_epoch, (lora_int_id, adapter_version) = cache_salt
        h.update(b"\x03" + lora_int_id.to_bytes(8, "little") + adapter_version.to_bytes(8, "little"))
        cache_salt = cache_salt if weight_epoch == 0 else (cache_salt, weight_epoch)
    if isinstance(cache_salt, tuple):
        cache_salt, weight_epoch = cache_salt
        h.update(b"\x02" + weight_epoch.to_bytes(8, "little"))
    if cache_salt is None:
        h.update(b"\x00")
    else:
        salt = cache_salt.encode("utf-8", "surrogatepass")
        h.update(b"\x01" + len(salt).to_bytes(8, "little") + salt)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def page_key(seq: Sequence, page_idx: int, page_size: int) -> PageKey:
    """What page `page_idx` of `seq` is cached under (its parent's digest must be in seq.page_hashes)."""
    parent_hash = seq.page_hashes[page_idx - 1] if page_idx else None
    return (parent_hash, seq.cache_salt, tuple(seq.token_ids[page_idx * page_size : (page_idx + 1) * page_size]))
