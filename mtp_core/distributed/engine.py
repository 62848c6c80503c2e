"""The engine under tensor / expert parallelism: every rank runs the same step loop on the same
batch (each computing its slice of every layer), and rank 0 decides.

Ranks stay in lockstep because everything the scheduler reads is identical on every rank:
  - the KV pool size: each rank plans it from its own free memory, the smallest plan wins;
  - the emitted tokens: every rank verifies (sampling needs the logits anyway) but rank 0's
    result is broadcast and used by all, so a sampled token, a relaxed-acceptance tie or a
    last-bit difference in the logits can never make two ranks commit different tokens;
  - the drafts: every rank runs the MTP forwards (they hold MTP weight slices too), then rank
    0's drafts are broadcast.
Each broadcast is one [rows, 1 + K + 1] int64 tensor per step.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Callable, Optional

from mtp_core.config import LLMConfig
from mtp_core.distributed.parallel_state import ParallelState
from mtp_core.engine.engine import Engine
from mtp_core.engine.model_runner import TargetOutput
from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.kv_cache.mla_cache import plan_num_blocks
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.native.forward_path import prepare_decode
from mtp_core.speculative.drafter import DraftInput, Drafter
from mtp_core.speculative.verifier import VerifyResult


log = logging.getLogger("mtp.distributed")


class BroadcastDrafter:
    """Runs the wrapped drafter on every rank (its MTP forwards are collective), returns rank 0's drafts."""

    def __init__(self, inner: Drafter, par: ParallelState) -> None:
        self.inner, self.par = inner, par
        self.num_draft_tokens = inner.num_draft_tokens

    def propose(self, rows: list[DraftInput]) -> list[list[int]]:
        return self.par.broadcast_token_lists(self.inner.propose(rows), self.num_draft_tokens)


def agreed_kv_config(model: DeepseekV3ForCausalLM, cfg: LLMConfig, par: ParallelState) -> LLMConfig:
    """cfg with kv_cache_config.max_tokens fixed to the same value on every rank (collective).

    Ranks that share a host's RAM (CPU runs) also share its free memory: each plans with its
    fraction divided by the number of local ranks."""
    kv = cfg.kv_cache_config
    if kv.max_tokens is not None:
        return cfg
    spec = cfg.speculative_config
    k = spec.max_draft_len if spec else 0
    max_seq_len = cfg.max_seq_len or model.config.max_position_embeddings
    num_layers = len(model.model.layers) if k else model.num_main_layers
    plan_kv = kv
    if not cfg.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", par.world_size))
        plan_kv = replace(kv, free_gpu_memory_fraction=kv.free_gpu_memory_fraction / max(local, 1))
    dtype = next(model.parameters()).dtype
    blocks = plan_num_blocks(model.config, plan_kv, num_layers, dtype, cfg.device,
                             cfg.max_batch_size * (max_seq_len + 2 * k))
    blocks = par.min_int(blocks)
    return replace(cfg, kv_cache_config=replace(kv, max_tokens=blocks * kv.tokens_per_block))


class DistributedEngine(Engine):
    def __init__(self, model: DeepseekV3ForCausalLM, cfg: LLMConfig, eos_token_ids: list[int], par: ParallelState,
                 think_ids: Optional[tuple[int, int]] = None, drafter: Optional[Drafter] = None,
                 iter_log: Optional[Callable[[str], None]] = None) -> None:
        self.par = par
        prepare_decode(model)   # before the KV pool is sized from the memory that is left
        if cfg.cuda_graph_config is not None and par.world_size > 1:
            # the static step commits its own tokens; rank 0's broadcast (_verify, BroadcastDrafter) is not in it
            log.warning("CUDA graphs are not combined with tensor / expert parallelism yet; running eagerly")
            cfg = replace(cfg, cuda_graph_config=None)
        super().__init__(model, agreed_kv_config(model, cfg, par), eos_token_ids, think_ids, drafter,
                         iter_log if par.is_output_rank else None)
        if self.spec.drafter is not None and par.world_size > 1:
            self.spec.drafter = BroadcastDrafter(self.spec.drafter, par)

    def _verify(self, rows: list[ScheduledRow], out: TargetOutput) -> VerifyResult:
        result = super()._verify(rows, out)
        # rank 0's tokens for every rank; logprobs (reported by rank 0 only) are those of rank 0's tokens
        return VerifyResult(self.par.broadcast_token_lists(result.tokens, self.spec.draft_len + 1), result.logprobs)
