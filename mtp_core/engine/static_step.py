"""The fused decode step: the target forward, verification and the next drafts of a batch in one call.

Two implementations, one contract:
- graph_runner.GraphRunner: the step over fixed-size buffers, captured as a CUDA graph per batch size (run
  eagerly over the same buffers without CUDA);
- native_step.NativeStep: its CPU twin, the whole step as one native call (mtp_core::mtp_step).

Both answer `step_for(rows)`: a step that can run this batch, or None (the batch then takes the engine's
general path); its `run(rows)` returns (emitted tokens per row, next drafts per row) and brings every row's
MTP state (seq.mtp) up to date; `num_replays` counts the steps run whole. A step drafts before the
draft-length policy has seen what it emits, so it drafts a count of its own for every row (K, or the count
the policy chose last); the engine cuts each row's drafts to the policy's choice once the step is committed.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Protocol

import torch

from mtp_core.config import LLMConfig
from mtp_core.engine.graph_runner import GraphRunner, default_batch_sizes, static_step_unsupported
from mtp_core.engine.native_step import NativeStep
from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.kv_cache.block_manager import BlockManager
from mtp_core.model import DeepseekV3ForCausalLM

log = logging.getLogger("mtp.engine")


class RunnableStep(Protocol):
    def run(self, rows: list[ScheduledRow]) -> tuple[list[list[int]], list[list[int]]]: ...


class FusedStep(Protocol):
    num_replays: int

    def step_for(self, rows: list[ScheduledRow]) -> Optional[RunnableStep]: ...


def make_static_steps(model: DeepseekV3ForCausalLM, cfg: LLMConfig, caches: list[torch.Tensor], blocks: BlockManager,
                      K: int, mode: Optional[str], relaxed: Optional[tuple[int, float]], max_seq_len: int,
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
        log.warning("CUDA graphs off: %s", why)
    elif cg is not None:
        scratch: list[int] = []
        blocks.reserve(scratch, 1)            # padded rows read and write only this block, forever
        sizes = [b for b in (cg.batch_sizes or default_batch_sizes(cg.max_batch_size or cfg.max_batch_size))
                 if b <= cfg.max_batch_size]
        graphs = GraphRunner(model, caches, K, sizes, cg.enable_padding, blocks.blocks_for(max_seq_len + 2 * K),
                             blocks.tokens_per_block, scratch[0],
                             relaxed if relaxed and relaxed[0] > 1 and relaxed[1] > 0 else None,
                             torch.device(cfg.device))
    use_native_step = cfg.native_step and os.environ.get("MTP_CORE_NATIVE_STEP", "1") != "0"
    native = (NativeStep(model, caches, K, relaxed, fixed_counts=fixed_counts, vanilla=mode == "vanilla",
                         confidence=confidence)
              if use_native_step and graphs is None and not overlap and not injected_drafter
              and model.native is not None else None)
    return graphs, native


def run_fused(fused: Optional[FusedStep], rows: list[ScheduledRow]
              ) -> Optional[tuple[list[list[int]], list[list[int]]]]:
    """(emitted tokens per row, next drafts per row) when the fused step can run this batch, else None."""
    step = fused.step_for(rows) if fused is not None else None
    if step is None:
        return None
    out = step.run(rows)
    fused.num_replays += 1
    return out
