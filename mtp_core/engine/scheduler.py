"""In-flight batching: which rows run in the next step, with KV slots reserved for them.

Every running sequence gets one row per step: its next prefill chunk, or a decode row of 1+k tokens
([last token, d_1..d_k]), k <= K its drafts (the draft-length policy chose k when the row drafted: rows of
one step may differ, and the batch-size schedule or a paused acceptance window can cut a row's drafts here).
Rows are admitted up to max_batch_size sequences and max_num_tokens tokens (a decode row costs k+1).
Before a row runs, its block table is grown to cover every slot the step may write: the target's k+1
positions plus the MTP chain's K-1 overshoot. When the pool runs dry the most
recently admitted sequence is preempted: its blocks are freed and it is later prefilled again over
prompt + output so far (recompute), which leaves the output unchanged.

With block reuse on, an admission first maps the longest cached prefix (BlockManager.lookup: shared
blocks, private copies where the request will write) and its prefill starts after it; a running request's
full, final blocks are registered after every step (`settle`) and on finish and preemption, so a
preempted request finds its own blocks again when it is re-admitted.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from mtp_core.kv_cache.block_manager import BlockManager
from mtp_core.kv_cache.prefix_cache import PrefixHit, PrefixRecurrence, ReusePolicy, extend_digests
from mtp_core.request.sequence import Sequence, Status
from mtp_core.request.stats import SpecStats
from mtp_core.speculative.policy import DraftLenPolicy

log = logging.getLogger("mtp.scheduler")


class PreemptionNeeded(Exception):
    """Raised by schedule(allow_preempt=False) when the step cannot be placed without preempting."""


@dataclass
class ScheduledRow:
    seq: Sequence
    is_prefill: bool
    token_ids: list[int]          # tokens fed to the target this step
    start: int                    # position of token_ids[0]

    @property
    def is_final_chunk(self) -> bool:
        return self.is_prefill and self.start + len(self.token_ids) == self.seq.kv.prefill_target


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_tokens: int, num_draft_tokens: int,
                 enable_chunked_prefill: bool, reuse: ReusePolicy = ReusePolicy(),
                 policy: DraftLenPolicy | None = None) -> None:
        self.blocks = blocks
        self.reuse = reuse
        self.policy = policy if policy is not None else DraftLenPolicy(num_draft_tokens, policy="fixed")
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.draft_len = num_draft_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.finished_stats = SpecStats()      # the statistics of every finished request, summed
        self.recurrence = PrefixRecurrence()    # whether admitted prompts share prefixes (prefix caching on)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def overshoot(self) -> int:
        return max(self.draft_len - 1, 0)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, allow_preempt: bool = True, placeholder: bool = False) -> list[ScheduledRow]:
        """allow_preempt=False (the overlap scheduler's worker, while sequences are being drafted) raises
        PreemptionNeeded instead of freeing a running sequence's blocks. placeholder=True (the same worker):
        decode rows carry as many placeholder drafts as their limit allows; the engine fills in the real
        drafts (possibly fewer) once they exist."""
        rows: list[ScheduledRow] = []
        budget = self.max_num_tokens
        in_flight = self.policy.in_flight(len(self.running), len(self.waiting))
        # decode rows first: they hold blocks already and are latency-critical
        for seq in list(self.running):
            if seq.is_prefilling or seq not in self.running:
                continue
            limit = self.policy.row_limit(seq.mtp, in_flight) if self.draft_len else 0
            drafts = [0] * limit if placeholder else seq.mtp.drafts[:limit]
            if budget < len(drafts) + 1:
                break
            kv = seq.kv
            end = kv.num_cached + len(drafts) + 1 + self.overshoot()
            if not allow_preempt and not self.blocks.can_reserve(kv.block_table, end):
                raise PreemptionNeeded()
            if not self._reserve_or_preempt(seq, end):
                continue
            rows.append(ScheduledRow(seq, False, [seq.all_ids[-1], *drafts], kv.num_cached))
            budget -= len(drafts) + 1
        # then prefill chunks of running sequences, then new admissions (FIFO)
        candidates = [s for s in self.running if s.is_prefilling]
        num_new = 0
        while self.waiting and len(self.running) + num_new < self.max_batch_size:
            candidates.append(self.waiting.popleft())
            num_new += 1
        deferred: list[Sequence] = []
        for seq in candidates:
            admitted = seq in self.running
            plan = self._plan_prefill(seq, admitted, budget, alone=not rows)
            if plan is None:
                if not admitted:
                    deferred.append(seq)
                continue
            attempt, a, n, end = plan
            if not admitted:
                self.blocks.stats.record(len(seq.all_ids), len(seq.all_ids) // self.blocks.tokens_per_block, attempt)
                seq.start_prefill(a)
                seq.kv.num_settled_blocks = 0
                if attempt is not None:
                    self.blocks.map_prefix(seq.kv.block_table, attempt)
                    seq.kv.num_settled_blocks = attempt.copy_from
                seq.status = Status.RUNNING
                self.running.append(seq)
            self.blocks.reserve(seq.kv.block_table, end)
            a = seq.kv.num_prefilled
            rows.append(ScheduledRow(seq, True, seq.all_ids[a:a + n], a))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return rows

    def _plan_prefill(self, seq: Sequence, admitted: bool, budget: int, alone: bool
                      ) -> tuple[PrefixHit | None, int, int, int] | None:
        """(prefix hit, first position, chunk length, slots to reserve) of the sequence's next prefill chunk,
        or None when it cannot run in this step. A prefix hit that does not fit the pool (its copies, the
        hits taken off the LRU) is dropped and the request admitted as without reuse; one that does not
        fit this step's token budget waits for a later step."""
        hit = None if admitted else self._lookup(seq)
        while True:
            a = seq.kv.num_prefilled if admitted else (hit.start if hit else 0)
            target = seq.kv.prefill_target if admitted else len(seq.all_ids)
            remaining = target - a
            n = min(remaining, budget) if self.chunked else remaining
            if hit is not None and n < min(remaining, self.reuse.min_chunk):
                return None
            end = a + n + (self.overshoot() if a + n == target else 0)
            # without chunking a prefill longer than the budget still runs when it is alone in the step
            if n <= 0 or (n > budget and not (not self.chunked and alone)):
                return None
            if hit is not None and not self.blocks.can_map(hit, end):
                hit = None
                continue
            if hit is None and not self.blocks.can_reserve(seq.kv.block_table, end):
                return None
            return hit, a, n, end

    def _reserve_or_preempt(self, seq: Sequence, end: int) -> bool:
        while not self.blocks.can_reserve(seq.kv.block_table, end):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                log.warning("request %d needs %d KV slots but the whole pool holds %d; finishing it (length); "
                            "raise kv_cache_config.max_tokens", seq.request_id, end,
                            self.blocks.num_blocks * self.blocks.tokens_per_block)
                seq.finish_reason = "length"
                self.finish(seq)
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.reserve(seq.kv.block_table, end)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.settle(seq, final=True)
        self.blocks.free(seq.kv.block_table)
        seq.status = Status.WAITING
        seq.kv.num_cached = seq.kv.num_prefilled = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.info("preempted request %d (recompute later); %d free blocks", seq.request_id,
                 self.blocks.num_free_blocks)

    # ---- after the step ------------------------------------------------------------------
    def finish(self, seq: Sequence, cache: bool = True) -> None:
        """cache=False: the step that was running failed, its caches may be half-written: register nothing."""
        if seq in self.running:
            self.running.remove(seq)
            if cache:
                self.settle(seq, final=True)
        self.blocks.free(seq.kv.block_table)
        seq.status = Status.FINISHED
        self.finished_stats.merge(seq.stats)

    def abort(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = "abort"
        self.finish(seq)

    # ---- prefix cache ----------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> PrefixHit | None:
        if seq.wants_prompt_logprobs:       # every prompt position's logits are computed, none mapped
            return None
        if not self.blocks.enable_reuse:
            return None
        extend_digests(seq.kv.block_digests, seq.all_ids, self.blocks.tokens_per_block)
        self.recurrence.note(seq.kv.block_digests, seq.request_id)
        return self.blocks.lookup(seq.all_ids, seq.kv.block_digests, self.reuse.mtp, self.reuse.min_chunk)

    def settle(self, seq: Sequence, final: bool = False) -> None:
        """Registers the sequence's full blocks whose every layer is final: below num_cached (every layer
        holds valid KV there between steps), less the write lag while the sequence still runs."""
        if not self.blocks.enable_reuse or seq.status != Status.RUNNING:
            return
        # with MTP caches, a position is final only once its MTP entries are written too: a request that
        # skipped drafting (its MTP caches lag, see speculative/backlog.py) registers up to seq.mtp.num_valid
        kv = seq.kv
        valid = min(kv.num_cached, seq.mtp.num_valid) if self.reuse.mtp else kv.num_cached
        valid -= 0 if final else self.reuse.write_lag
        if valid < self.blocks.tokens_per_block * (kv.num_settled_blocks + 1):
            return
        ids = seq.all_ids
        extend_digests(kv.block_digests, ids, self.blocks.tokens_per_block)
        kv.num_settled_blocks = self.blocks.register(kv.block_table, ids, kv.block_digests, valid, self.reuse.mtp,
                                                     kv.num_settled_blocks)
