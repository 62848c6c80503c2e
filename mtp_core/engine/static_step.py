"""The fused decode step: the target forward, verification and the next drafts of a batch in one call.

Two implementations, one contract: the static step here (fixed-size buffers, captured as a CUDA graph per
batch size; run eagerly over the same buffers without CUDA), and its CPU twin native_step.NativeStep (the
whole step as one native call, mtp_core::mtp_step). Both answer `step_for(rows)`: a step that can run this
batch, or None (the batch then takes the engine's general path); its `run(rows)` returns (the verification:
emitted tokens per row and the logprobs asked for, next drafts per row) and brings every row's MTP state
(seq.mtp) up to date with backlog.settle, as the general path does; `num_replays` counts
the steps run whole. A fused step drafts before the draft-length policy has seen what it emits, so it
drafts a count of its own for every row (K, or the count the policy chose last); the engine cuts each
row's drafts to the policy's choice once the step is committed. `make_static_steps` builds them; the
engine takes them as routes (engine/step.py: FusedRoute).

The static step: a pure-decode batch of B rows, each feeding [t, d_1..d_K] at positions start..start+K, runs as one
function of fixed-size buffers, with no host sync anywhere inside:

    target  = model([t, d_1..d_K])                      # writes main KV at start..start+K
    m       = accepted drafts per row                   # greedy strict, or relaxed for thinking rows
    emitted = [d_1..d_m, target argmax at m]            # n = m + 1 tokens, padded to K+1
    g       = MTP(emitted, target hidden)               # Eagle forward 1 over all K+1 positions
    D_1     = argmax head(g[m]);  D_j = MTP chain at start+m+j (j = 1..K-1)

Forward 1 covers the fixed K+1 positions instead of only the m+1 newly valid ones; the entries past
start+m are rewritten by the chain in this step or by the next step's forward 1 before anything reads
them (each query only sees keys at or before its own position), so the MTP caches hold exactly what
the eager drafter writes and eager and graph steps can alternate freely.

Graphs are captured per batch size (cuda_graph_config.batch_sizes, default 1, 2, 4, 8, ... up to
max_batch_size); a batch pads up to the nearest captured size with rows that read and write only a
reserved scratch block. On a CPU the same function runs eagerly over the same buffers (that is what the
CPU tests check against the regular step); on CUDA it is captured once and replayed.
Out of scope (the step then runs eagerly): prefill rows, sampled rows (temperature > 0), rows that need their
logits (logprobs, penalties, logit_bias, min_tokens, grammars: the native step serves those), MTP Vanilla,
and models whose MoE layers cannot run without a host sync (large experts: see MoE.fuse_for_decode).
Adaptive draft length: a batch whose rows do not all carry K drafts (ragged rows, a batch-size schedule
or paused window below K) or that holds a row whose MTP caches lag (it skipped drafting) runs eagerly,
step by step; the static step drafts K for every row and the engine cuts them to each row's limit.
Confidence-gated drafting turns the static step off altogether (its chain would need a data-dependent
length).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from mtp_core.config import LLMConfig, runtime
from mtp_core.engine.native_step import NativeStep
from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.kv_cache.block_manager import BlockManager
from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM
from mtp_core.model.forward_path import ForwardPath, draft_tokens
from mtp_core.native.native_decode import NativeDecoder
from mtp_core.speculative import backlog
from mtp_core.speculative.verifier import Acceptance, Relaxed, VerifyResult, verify_static

log = logging.getLogger("mtp.graphs")


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, ... and max_batch_size itself."""
    return [1 << i for i in range((max_batch_size - 1).bit_length())] + [max_batch_size]


def static_step_unsupported(model: DeepseekV3ForCausalLM, mode: Optional[str], K: int,
                            confidence_threshold: float = 0.0) -> Optional[str]:
    """Why this model / drafting mode cannot run the static step (None when it can)."""
    if model.config.is_dsa:
        return "DeepSeek-V3.2 sparse attention selects keys per query from host metadata; it runs eagerly"
    if K and mode != "eagle":
        return "the static step drafts in MTP Eagle mode only (Vanilla runs eagerly)"
    if K and confidence_threshold > 0:
        return "confidence-gated drafting (draft_confidence_threshold > 0) stops chains per row; it runs eagerly"
    for i, layer in enumerate(model.model.layers[: model.num_main_layers + (1 if K else 0)]):
        mlp = layer.mlp
        if hasattr(mlp, "experts") and getattr(mlp, "stacked", None) is None:
            return f"layer {i}'s MoE has no static (dense) form; its experts are too large or quantized"
    return None


@dataclass
class StaticInputs:
    """What the static computation reads: the batch (loaded each step) and two index constants."""
    input_ids: torch.Tensor      # [B, K+1] each row's [t, d_1..d_K]
    start: torch.Tensor          # [B] the position of t
    block_tables: torch.Tensor   # [B, max_blocks] int32 (scratch rows: the scratch block)
    thinking: torch.Tensor       # [B] bool: relaxed acceptance applies
    offsets: torch.Tensor        # [K+1] 0..K
    rows: torch.Tensor           # [B] 0..B-1


@dataclass
class StaticOutputs:
    """What it writes, read back with one device-to-host copy."""
    emitted: torch.Tensor        # [B, K+1] the emitted tokens, then the target's choices past them
    num_emitted: torch.Tensor    # [B]
    drafts: torch.Tensor         # [B, K] the next drafts


class Staging(NamedTuple):
    """load()'s one host-to-device copy: every input in one int64 host buffer (pinned on CUDA), sent with one
    asynchronous copy; the device then spreads it over the input buffers (int32 / bool casts included)."""
    layout: tuple[int, int, int, int]    # ids, start, tables, thinking
    host: torch.Tensor
    staged: torch.Tensor


class StaticDecodeStep:
    """Buffers and the static computation for one batch size B (see the module docstring)."""

    def __init__(self, model: DeepseekV3ForCausalLM, head: ForwardPath, caches: list[torch.Tensor], K: int,
                 batch_size: int, max_blocks: int, tokens_per_block: int, scratch_block: int,
                 relaxed: Optional[Relaxed], device: torch.device) -> None:
        # relaxed: the rule of thinking rows (None: strict for every row).
        # head: the engine's forward path, whose LM head the step uses (the torch one on a GPU; on a CPU with the
        # native decoder its batch-invariant head, so the static step scores tokens as the eager steps do)
        self.model, self.head, self.caches, self.draft_len, self.B = model, head, caches, K, batch_size
        self.bs, self.scratch, self.relaxed = tokens_per_block, scratch_block, relaxed
        B, Q = batch_size, K + 1
        self.inputs = StaticInputs(torch.zeros(B, Q, dtype=torch.long, device=device),
                                   torch.zeros(B, dtype=torch.long, device=device),
                                   torch.full((B, max_blocks), scratch_block, dtype=torch.int32, device=device),
                                   torch.zeros(B, dtype=torch.bool, device=device),
                                   torch.arange(Q, device=device), torch.arange(B, device=device))
        self.outputs = StaticOutputs(torch.zeros(B, Q, dtype=torch.long, device=device),
                                     torch.ones(B, dtype=torch.long, device=device),
                                     torch.zeros(B, K, dtype=torch.long, device=device))
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        layout = (B * Q, B, B * max_blocks, B)
        pinned = device.type == "cuda"
        self.staging = Staging(layout, torch.zeros(sum(layout), dtype=torch.long, pin_memory=pinned),
                               torch.zeros(sum(layout), dtype=torch.long, device=device))

    # ---- the static computation -------------------------------------------------------------
    def _meta(self, positions: torch.Tensor) -> AttentionMetadata:
        """positions [B, Q] -> metadata of a uniform step (slots looked up in the block tables on device)."""
        tables = self.inputs.block_tables
        slots = tables.long().gather(1, positions // self.bs) * self.bs + positions % self.bs
        return AttentionMetadata.uniform(positions.flatten(), slots.flatten(), tables,
                                         (positions[:, -1] + 1).to(torch.int32))

    def _verify(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.inputs
        return verify_static(logits, i.input_ids[:, 1:], i.thinking, self.relaxed, i.offsets)

    def forward(self) -> None:
        """The step over the input buffers: the model's torch modules over device-only metadata (every MoE dense:
        AttentionMetadata.static_shapes) and the engine's LM head, so a CUDA graph can capture it."""
        model, caches, K, i, o = self.model, self.caches, self.draft_len, self.inputs, self.outputs
        positions = i.start[:, None] + i.offsets                                # [B, K+1]
        meta = self._meta(positions)
        hidden = model(i.input_ids.flatten(), meta, caches)                     # [B*(K+1), H]
        logits = self.head.logits(hidden).view(self.B, K + 1, -1)
        m, emitted = self._verify(logits)
        o.emitted.copy_(emitted)
        o.num_emitted.copy_(m + 1)
        if not K:
            return
        # Eagle forward 1 over every position: (x_{q+1}, h_q) entries, the valid ones are q <= start+m
        g = model.mtp_forward(0, emitted.flatten(), hidden, meta, caches).view(self.B, K + 1, -1)
        g = g[i.rows, m]                                                        # [B, H] at q = start+m
        d = draft_tokens(self.head, self.head.draft_logits(g).argmax(-1))
        o.drafts[:, 0].copy_(d)
        for j in range(1, K):
            pos = (i.start + m + j)[:, None]                                    # [B, 1]
            g = model.mtp_forward(0, d, g, self._meta(pos), caches)
            d = draft_tokens(self.head, self.head.draft_logits(g).argmax(-1))
            o.drafts[:, j].copy_(d)

    # ---- host side ---------------------------------------------------------------------------
    def load(self, rows: list[ScheduledRow]) -> None:
        """Copies a batch (<= B rows) into the input buffers; the rest become scratch rows.

        One host-to-device copy per step, from a pinned buffer and non-blocking: the previous step's
        staging buffer is free again because run() ended with a device-to-host copy (a stream sync)."""
        i, staging = self.inputs, self.staging
        Q, max_blocks = self.draft_len + 1, i.block_tables.shape[1]
        n_ids, n_start, n_tables, n_think = staging.layout
        flat = [0] * (n_ids + n_start) + [self.scratch] * n_tables + [0] * n_think     # scratch rows by default
        o_start, o_tables, o_think = n_ids, n_ids + n_start, n_ids + n_start + n_tables
        for b, r in enumerate(rows):
            table = r.seq.kv.block_table
            if len(r.token_ids) != Q or len(table) > max_blocks:
                raise ValueError(f"static step: a row brings {len(r.token_ids)} tokens and {len(table)} blocks, "
                                 f"the buffers hold {Q} and at most {max_blocks}")
            flat[b * Q:(b + 1) * Q] = r.token_ids
            flat[o_start + b] = r.start
            flat[o_tables + b * max_blocks:o_tables + b * max_blocks + len(table)] = table
            flat[o_think + b] = int(r.seq.decoding.in_thinking)
        staging.host.copy_(torch.tensor(flat, dtype=torch.long))
        staging.staged.copy_(staging.host, non_blocking=True)
        parts = staging.staged.split(staging.layout)
        i.input_ids.copy_(parts[0].view(self.B, Q))
        i.start.copy_(parts[1])
        i.block_tables.copy_(parts[2].view(self.B, max_blocks))        # int64 -> int32 on the device
        i.thinking.copy_(parts[3] != 0)

    def capture(self, pool=None) -> None:
        """CUDA only: two warm-up runs on a side stream, then capture (the buffers hold scratch rows, so
        capture-time writes land in the scratch block)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.inference_mode():
            self.forward()

    def run(self, rows: list[ScheduledRow]) -> tuple[VerifyResult, list[list[int]]]:
        """-> (emitted tokens per row, next drafts per row), one device-to-host copy."""
        self.load(rows)
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self.forward()
        K = self.draft_len
        o = self.outputs
        out = torch.cat([o.emitted, o.num_emitted[:, None], o.drafts], dim=1)[: len(rows)].cpu().tolist()
        for r, row in zip(rows, out):
            backlog.settle(r.seq.mtp, r.start + row[K + 1], True)   # every row drafted: MTP caches up to date
        return VerifyResult([row[: row[K + 1]] for row in out]), [row[K + 2:] for row in out]


class GraphRunner:
    """One StaticDecodeStep per captured batch size; picks the smallest that holds a batch."""

    def __init__(self, model: DeepseekV3ForCausalLM, head: ForwardPath, caches: list[torch.Tensor], K: int,
                 batch_sizes: list[int], enable_padding: bool, max_blocks: int, tokens_per_block: int,
                 scratch_block: int, acceptance: Acceptance, device: torch.device) -> None:
        self.draft_len, self.enable_padding, self.acceptance = K, enable_padding, acceptance
        self.steps = {b: StaticDecodeStep(model, head, caches, K, b, max_blocks, tokens_per_block, scratch_block,
                                          acceptance.relaxed, device) for b in sorted(set(batch_sizes))}
        self.num_replays = 0
        if device.type == "cuda":
            pool = None
            for b in sorted(self.steps, reverse=True):        # largest first: smaller graphs reuse its pool
                self.steps[b].capture(pool)
                pool = self.steps[b].graph.pool()
            log.info("captured CUDA graphs of the decode step for batch sizes %s", sorted(self.steps))
        else:
            log.info("static decode step for batch sizes %s (no CUDA: run eagerly, not captured)",
                     sorted(self.steps))

    def step_for(self, rows: list[ScheduledRow]) -> Optional[StaticDecodeStep]:
        """The static step that can run this batch, or None (it then runs eagerly)."""
        K = self.draft_len
        if not rows or any(r.is_prefill or len(r.token_ids) != K + 1 or (K and r.seq.mtp.num_valid != r.start)
                           or r.seq.params.needs_logits for r in rows) \
                or not self.acceptance.fused("static", [r.seq for r in rows]):
            return None
        fits = [b for b in self.steps if b >= len(rows) and (b == len(rows) or self.enable_padding)]
        return self.steps[min(fits)] if fits else None


def make_static_steps(model: DeepseekV3ForCausalLM, path: ForwardPath, cfg: LLMConfig, caches: list[torch.Tensor],
                      blocks: BlockManager,
                      K: int, mode: Optional[str], acceptance: Acceptance, max_seq_len: int,
                      fixed_counts: bool, overlap: bool, injected_drafter: bool
                      ) -> tuple[Optional[GraphRunner], Optional[NativeStep]]:
    """The engine's fused steps: the static (CUDA-graph) step for each batch size of cuda_graph_config, or
    None with a log line when this model or drafting mode cannot run it (every step then runs eagerly); on a
    CPU with the native forward, the native step where nothing else drives the step (no graphs, no overlap
    scheduler, no injected drafter)."""
    spec, cg = cfg.speculative_config, cfg.cuda_graph_config
    confidence = spec.draft_confidence_threshold if spec else 0.0
    graphs = None
    why = static_step_unsupported(model, mode, K, confidence) if cg is not None else None
    if why is not None:
        logging.getLogger("mtp.engine").warning("CUDA graphs off: %s", why)
    elif cg is not None:
        scratch: list[int] = []
        blocks.reserve(scratch, 1)            # padded rows read and write only this block, forever
        sizes = [b for b in (cg.batch_sizes or default_batch_sizes(cg.max_batch_size or cfg.max_batch_size))
                 if b <= cfg.max_batch_size]
        graphs = GraphRunner(model, path, caches, K, sizes, cg.enable_padding, blocks.blocks_for(max_seq_len + 2 * K),
                             blocks.tokens_per_block, scratch[0],
                             acceptance, torch.device(cfg.device))
    use_native_step = runtime.native_step(cfg.native_step)
    native = (NativeStep(model, path, caches, K, acceptance, fixed_counts=fixed_counts, vanilla=mode == "vanilla",
                         confidence=confidence)
              if use_native_step and graphs is None and not overlap and not injected_drafter
              and isinstance(path, NativeDecoder) else None)
    return graphs, native
