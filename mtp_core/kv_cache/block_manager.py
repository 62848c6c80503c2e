"""Paged KV bookkeeping: fixed-size blocks, a free list with reference counts, per-sequence tables, and
(with reuse on) a content-addressed cache of full blocks that outlive their request.

Main and MTP layers share one block table per sequence (same slot for the same position), so one
truncate rewinds every cache at once. Nothing is copied or zeroed on rewind: trailing blocks go back to
the pool and later writes overwrite stale slots.

Block reuse (prefix caching; the design and why it is exact with MTP: docs/architecture.md, "Prefix caching"):
a full block whose every layer is final is registered under a key (digest of the tokens from position 0
to its end, and, with MTP caches, the token right after it). A registered block whose reference count
drops to zero is not freed but kept in an LRU; it is evicted (unregistered and handed out) only when the
free list is empty. `num_free_blocks` counts both: cached blocks are reclaimable. A registered block is
never written again: a request that must write into one maps a private copy instead (`map_prefix`).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Optional

from mtp_core.kv_cache.prefix_cache import BlockKey, PrefixCacheStats, PrefixHit


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_reuse: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache pool has no blocks")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.enable_reuse = enable_reuse
        # the prefix cache: registered blocks, and the unreferenced ones among them, oldest use first
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.key_of: dict[int, BlockKey] = {}
        self.by_key: dict[BlockKey, int] = {}
        self.by_digest: dict[bytes, dict[int, None]] = {}      # the same tokens, any next token
        self.copy_block: Optional[Callable[[int, int], None]] = None   # (src, dst): copy every layer
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation can take: the free list plus the unreferenced cached blocks."""
        return len(self.free_blocks) + len(self.lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def can_reserve(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_free_blocks

    def reserve(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place so that positions 0..num_tokens-1 have slots."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free_blocks:
            raise MemoryError(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(max(need, 0)):
            table.append(self._take())

    def rewind(self, table: list[int], num_tokens: int) -> None:
        """Keep slots for positions 0..num_tokens-1; return whole trailing blocks to the pool."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        while table:
            self._release(table.pop())

    def _take(self) -> int:
        """A block for exclusive use: from the free list, else the least recently used cached block."""
        if self.free_blocks:
            b = self.free_blocks.popleft()
        else:
            b, _ = self.lru.popitem(last=False)
            self._unregister(b)
            self.stats.evicted_blocks += 1
        assert self.ref_counts[b] == 0, f"block {b} on the free list is still referenced"
        self.ref_counts[b] = 1
        return b

    def _release(self, b: int) -> None:
        assert self.ref_counts[b] > 0, f"double free of block {b}"
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if b in self.key_of:
                self.lru[b] = None
            else:
                self.free_blocks.append(b)

    # ---- prefix cache --------------------------------------------------------------------
    def lookup(self, tokens: list[int], digests: list[bytes], mtp: bool, min_chunk: int) -> Optional[PrefixHit]:
        """The longest cached prefix of `tokens` (digests: one per full block of tokens) and the first
        position the request must compute; None when nothing can be reused. Changes nothing.

        With MTP caches (mtp=True) a block's key holds the token after it (its last MTP entry is built
        from that token), so a hit needs that token to agree; a block with the same tokens but another
        next token is still used, as the last one, and its last position is recomputed (a "boundary").
        The request computes at least its last token and, with min_chunk > 1 (Vanilla: the window of K
        positions needs their main hidden states), at least min_chunk tokens."""
        if not self.enable_reuse or not digests:
            return None
        B, L = self.tokens_per_block, len(tokens)
        hits: list[int] = []
        boundary = False
        for j, d in enumerate(digests):
            end = (j + 1) * B
            if end > L:
                break
            b = self.by_key.get((d, tokens[end] if mtp and end < L else None)) \
                if not (mtp and end == L) else None
            if b is None:
                alt = self.by_digest.get(d) if mtp else None
                if alt:
                    hits.append(next(iter(alt)))
                    boundary = True
                break
            hits.append(b)
        if not hits:
            return None
        M = len(hits) * B
        start = max(0, min(M - (1 if boundary else 0), L - max(min_chunk, 1)))
        if start == 0:
            return None
        return PrefixHit(hits, start, start // B)

    def can_map(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether map_prefix(hit) and then reserve(num_tokens) fit (counting the hits taken off the LRU
        and the private copies)."""
        in_lru = sum(1 for b in hit.blocks if b in self.lru)
        new = self.blocks_for(num_tokens) - len(hit.blocks) + (len(hit.blocks) - hit.copy_from)
        return new <= self.num_free_blocks - in_lru

    def map_prefix(self, table: list[int], hit: PrefixHit) -> None:
        """Fill an empty table with the hit: shared blocks for table[:copy_from], private copies after
        (the request writes positions >= hit.start, which fall in those)."""
        assert not table, "map_prefix needs an empty block table"
        for b in hit.blocks:
            if self.ref_counts[b] == 0:
                del self.lru[b]
            self.ref_counts[b] += 1
            table.append(b)
        for i in range(hit.copy_from, len(hit.blocks)):
            src = table[i]
            dst = self._take()
            if self.copy_block is None:
                raise RuntimeError("block reuse needs BlockManager.copy_block to copy a block's contents")
            self.copy_block(src, dst)
            table[i] = dst
            self._release(src)
        self.stats.copied_blocks += len(hit.blocks) - hit.copy_from

    def register(self, table: list[int], tokens: list[int], digests: list[bytes], num_valid: int, mtp: bool,
                 first: int = 0) -> int:
        """Register table[first:] blocks that lie wholly below num_valid (every layer final there and never
        written again); returns the number of leading blocks now settled (pass it back as `first`)."""
        if not self.enable_reuse:
            return first
        B = self.tokens_per_block
        limit = min(num_valid, len(tokens) - 1 if mtp else len(tokens)) // B
        limit = min(limit, len(table), len(digests))
        for j in range(first, limit):
            b = table[j]
            if b in self.key_of:
                continue
            key = (digests[j], tokens[(j + 1) * B] if mtp else None)
            if key in self.by_key:          # the same content is cached already (another copy of it)
                continue
            self.key_of[b] = key
            self.by_key[key] = b
            self.by_digest.setdefault(key[0], {})[b] = None
        return max(first, limit)

    def _unregister(self, b: int) -> None:
        key = self.key_of.pop(b)
        del self.by_key[key]
        same = self.by_digest[key[0]]
        del same[b]
        if not same:
            del self.by_digest[key[0]]

    def clear_cache(self) -> None:
        """Unregister every unreferenced cached block (back to the free list)."""
        while self.lru:
            b, _ = self.lru.popitem(last=False)
            self._unregister(b)
            self.free_blocks.append(b)
