"""Per-forward attention metadata for a flattened batch of rows over the paged latent cache.

A forward call carries T tokens from B rows (prefill chunks, or decode rows of 1+K tokens) laid out
row after row. Each token writes its latent KV at `slot_mapping[t]` (block_id * tokens_per_block + offset)
and attends, causally, to every cached position of its own row up to and including its own.

Worked example (tokens_per_block=4): row 0 is a decode row holding positions 5,6 with block table [3, 8];
row 1 is a 3-token prefill at positions 0..2 with block table [1].
    positions    = [5, 6, 0, 1, 2]
    slot_mapping = [8*4+1, 8*4+2, 1*4+0, 1*4+1, 1*4+2]
    query_start  = [0, 2, 5]        context_lens = [7, 3]
    q_index      = [[0, 1, 5], [2, 3, 4]]   (5 = T, the padding index)
    kv_slots[0]  = slots of positions 0..6 of row 0 = [12,13,14,15,32,33,34]  (padded to max_context_len)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor      # [T] int64
    slot_mapping: torch.Tensor   # [T] int64
    query_start: list[int]       # [B+1] cumulative query lengths (host ints)
    context_lens: list[int]      # [B] KV length of each row after this call's writes
    q_index: torch.Tensor        # [B, Qmax] int64: flat token index, T for padding
    q_positions: torch.Tensor    # [B, Qmax] int64: position of each padded query (0 for padding)
    q_valid: torch.Tensor        # [B, Qmax] bool
    kv_slots: torch.Tensor       # [B, Lmax] int64: cache slot of each key position (0 for padding)
    use_absorbed: bool           # absorbed MLA over the latent cache (decode) vs naive (prefill)
    block_tables_i32: torch.Tensor  # [B, max_blocks] int32 (0-padded): the paged-kernel view
    seqlens_i32: torch.Tensor       # [B] int32 = context_lens
    uniform_q: bool                 # every row feeds the same number of queries (decode / verify batches)

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    def visible(self) -> torch.Tensor:
        """[B, Q, L] bool: key position l is visible to padded query q (causal within the row).
        Computed once per forward and shared by every layer."""
        cached = self.__dict__.get("_visible")
        if cached is None:
            key_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            cached = key_pos[None, None, :] <= self.q_positions[:, :, None]
            self.__dict__["_visible"] = cached
        return cached

    @classmethod
    def build(cls, positions: list[list[int]], block_tables: list[list[int]], tokens_per_block: int,
              use_absorbed: bool | None = None, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """positions[b]: the consecutive positions row b feeds in this call; block_tables[b]: its blocks."""
        # one snapshot per table: the overlap scheduler's worker may be appending to these lists right now
        block_tables = [list(t) for t in block_tables]
        num_rows = len(positions)
        query_start = [0]
        for p in positions:
            query_start.append(query_start[-1] + len(p))
        num_tokens = query_start[-1]
        context_lens = [p[-1] + 1 for p in positions]
        q_max = max(len(p) for p in positions)
        l_max = max(context_lens)

        bs = tokens_per_block
        flat_pos = [x for p in positions for x in p]
        slot_mapping = [block_tables[b][x // bs] * bs + x % bs for b, p in enumerate(positions) for x in p]
        q_index = torch.full((num_rows, q_max), num_tokens, dtype=torch.long)
        q_positions = torch.zeros((num_rows, q_max), dtype=torch.long)
        kv_slots = torch.zeros((num_rows, l_max), dtype=torch.long)
        ar = torch.arange(l_max)
        for b, p in enumerate(positions):
            n = len(p)
            q_index[b, :n] = torch.arange(query_start[b], query_start[b] + n)
            q_positions[b, :n] = torch.tensor(p)
            table = torch.tensor(block_tables[b], dtype=torch.long)
            L = context_lens[b]
            kv_slots[b, :L] = table[ar[:L] // bs] * bs + ar[:L] % bs
        q_valid = q_index < num_tokens
        max_blocks = max(len(t) for t in block_tables)
        tables_i32 = torch.zeros((num_rows, max_blocks), dtype=torch.int32)
        for b, t in enumerate(block_tables):
            tables_i32[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        if use_absorbed is None:
            use_absorbed = q_max <= 8
        dev = torch.device(device)
        return cls(
            positions=torch.tensor(flat_pos, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            query_start=query_start,
            context_lens=context_lens,
            q_index=q_index.to(dev),
            q_positions=q_positions.to(dev),
            q_valid=q_valid.to(dev),
            kv_slots=kv_slots.to(dev),
            use_absorbed=use_absorbed,
            block_tables_i32=tables_i32.to(dev),
            seqlens_i32=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            uniform_q=all(len(p) == q_max for p in positions),
        )
