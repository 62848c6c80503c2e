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
    use_absorbed: bool           # absorbed MLA over the latent cache (decode) vs naive (prefill)
    block_tables_i32: torch.Tensor  # [B, max_blocks] int32 (0-padded): the paged-kernel view
    seqlens_i32: torch.Tensor       # [B] int32 = context_lens
    uniform_q: bool                 # every row feeds the same number of queries (decode / verify batches)
    # host copies the padded views below are built from, on first use (the paged decode path needs none)
    row_positions: list[list[int]]
    block_tables: list[list[int]]
    tokens_per_block: int

    num_rows: int
    query_start_i32: torch.Tensor | None = None   # [B+1] int32 (build() only: the native forward reads it)
    static_shapes: bool = False   # uniform() only: the captured step; every op keeps fixed shapes (dense MoE)

    @classmethod
    def uniform(cls, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables_i32: torch.Tensor,
                seqlens_i32: torch.Tensor) -> "AttentionMetadata":
        """Decode-shaped metadata straight from device tensors (every row feeds Q = T / B tokens): no host
        list, no host sync, so it can be computed inside a CUDA graph. Only the paged absorbed path
        reads it; the padded views below (naive attention) are not available."""
        num_rows = block_tables_i32.shape[0]
        q = positions.shape[0] // num_rows
        return cls(positions=positions, slot_mapping=slot_mapping, query_start=list(range(0, q * num_rows + 1, q)),
                   context_lens=[], use_absorbed=True, block_tables_i32=block_tables_i32, seqlens_i32=seqlens_i32,
                   uniform_q=True, row_positions=[], block_tables=[], tokens_per_block=0, num_rows=num_rows,
                   static_shapes=True)

    def _cached(self, name: str, make) -> torch.Tensor:
        value = self.__dict__.get(name)
        if value is None:
            if not self.row_positions:
                raise RuntimeError("AttentionMetadata.uniform() carries no host positions; padded views need build()")
            value = self.__dict__[name] = make().to(self.positions.device)
        return value

    @property
    def q_index(self) -> torch.Tensor:
        """[B, Qmax] int64: flat token index of each padded query, T for padding."""
        def make() -> torch.Tensor:
            q_max = max(len(p) for p in self.row_positions)
            out = torch.full((self.num_rows, q_max), self.query_start[-1], dtype=torch.long)
            for b, p in enumerate(self.row_positions):
                out[b, :len(p)] = torch.arange(self.query_start[b], self.query_start[b] + len(p))
            return out
        return self._cached("_q_index", make)

    @property
    def q_positions(self) -> torch.Tensor:
        """[B, Qmax] int64: position of each padded query (0 for padding)."""
        def make() -> torch.Tensor:
            out = torch.zeros((self.num_rows, max(len(p) for p in self.row_positions)), dtype=torch.long)
            for b, p in enumerate(self.row_positions):
                out[b, :len(p)] = torch.tensor(p)
            return out
        return self._cached("_q_positions", make)

    @property
    def q_valid(self) -> torch.Tensor:
        """[B, Qmax] bool: which padded queries are real."""
        return self._cached("_q_valid", lambda: self.q_index < self.query_start[-1])

    @property
    def kv_slots(self) -> torch.Tensor:
        """[B, Lmax] int64: cache slot of each key position (0 for padding)."""
        def make() -> torch.Tensor:
            bs = self.tokens_per_block
            out = torch.zeros((self.num_rows, max(self.context_lens)), dtype=torch.long)
            ar = torch.arange(out.shape[1])
            for b, L in enumerate(self.context_lens):
                table = torch.tensor(self.block_tables[b], dtype=torch.long)
                out[b, :L] = table[ar[:L] // bs] * bs + ar[:L] % bs
            return out
        return self._cached("_kv_slots", make)

    def visible(self) -> torch.Tensor:
        """[B, Q, L] bool: key position l is visible to padded query q (causal within the row).
        Computed once per forward and shared by every layer."""
        def make() -> torch.Tensor:
            key_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            return key_pos[None, None, :] <= self.q_positions[:, :, None]
        return self._cached("_visible", make)

    @classmethod
    def build(cls, positions: list[list[int]], block_tables: list[list[int]], tokens_per_block: int,
              use_absorbed: bool | None = None, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """positions[b]: the consecutive positions row b feeds in this call; block_tables[b]: its blocks."""
        # one snapshot per table: the overlap scheduler's worker may be appending to these lists right now
        block_tables = [list(t) for t in block_tables]
        query_start = [0]
        for p in positions:
            query_start.append(query_start[-1] + len(p))
        context_lens = [p[-1] + 1 for p in positions]
        q_max = max(len(p) for p in positions)
        bs = tokens_per_block
        flat_pos = [x for p in positions for x in p]
        slot_mapping = [block_tables[b][x // bs] * bs + x % bs for b, p in enumerate(positions) for x in p]
        max_blocks = max(len(t) for t in block_tables)
        if use_absorbed is None:
            use_absorbed = q_max <= 8
        dev = torch.device(device)
        # two host->tensor conversions per forward: int64 [positions | slots], int32 [seqlens | starts | tables]
        B = len(positions)
        i64 = torch.tensor([flat_pos, slot_mapping], dtype=torch.long).to(dev)
        i32 = torch.tensor(context_lens + query_start + [b for t in block_tables for b in t + [0] * (max_blocks - len(t))],
                           dtype=torch.int32).to(dev)
        return cls(
            positions=i64[0],
            slot_mapping=i64[1],
            query_start=query_start,
            context_lens=context_lens,
            use_absorbed=use_absorbed,
            block_tables_i32=i32[2 * B + 1:].view(B, max_blocks),
            seqlens_i32=i32[:B],
            uniform_q=all(len(p) == q_max for p in positions),
            row_positions=[list(p) for p in positions],
            block_tables=block_tables,
            tokens_per_block=tokens_per_block,
            num_rows=len(positions),
            query_start_i32=i32[B:2 * B + 1],
        )
