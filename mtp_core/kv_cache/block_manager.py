"""Paged KV bookkeeping: fixed-size blocks, a free list with reference counts, per-sequence tables.

Main and MTP layers share one block table per sequence (same slot for the same position), so one
truncate rewinds every cache at once. Nothing is copied or zeroed on rewind: trailing blocks go back to
the pool and later writes overwrite stale slots.
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache pool has no blocks")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def can_reserve(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= len(self.free_blocks)

    def reserve(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place so that positions 0..num_tokens-1 have slots."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self.free_blocks):
            raise MemoryError(f"KV pool exhausted: need {need} blocks, {len(self.free_blocks)} free")
        for _ in range(max(need, 0)):
            b = self.free_blocks.popleft()
            assert self.ref_counts[b] == 0, f"block {b} on the free list is still referenced"
            self.ref_counts[b] = 1
            table.append(b)

    def rewind(self, table: list[int], num_tokens: int) -> None:
        """Keep slots for positions 0..num_tokens-1; return whole trailing blocks to the pool."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        while table:
            self._release(table.pop())

    def _release(self, b: int) -> None:
        assert self.ref_counts[b] > 0, f"double free of block {b}"
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.free_blocks.append(b)
