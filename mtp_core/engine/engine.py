"""The step loop. One step (Engine.step) reads like the algorithm:

    rows, meta = schedule()          # prefill chunks / decode rows of 1+k tokens; KV slots reserved
    step   = forward(rows, meta)     # target forward -> hidden states, logits; verify -> emitted tokens per row
    inputs = commit(step)            # append tokens, stop checks, statistics, new valid lengths
    choose_drafts(inputs)            # next step's draft count per row (0..K), from measured costs
    drafts = propose(inputs, step)   # MTP forwards per row -> next drafts
    store_drafts(inputs, drafts)     # keep the drafts, drop the KV of rejected drafts, settle the prefix cache

Who does what: scheduler.py places the rows (overlap.py prepares the next step on a worker thread while
this one drafts); the step takes one of its routes (step.py): a fused step (static_step.py: a CUDA graph, or
one native call on a CPU) runs the forward, the verification and the drafting of a batch at once, otherwise
the general path's model_runner.py and the verifier do;
speculative/policy.py chooses the draft counts, speculative/backlog.py runs the drafter. Each request
records its statistics once, in seq.stats (the commit); Engine.stats sums them when read, the finished
requests' from the total the scheduler keeps.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional

import torch

from mtp_core.config import LLMConfig
from mtp_core.engine.model_runner import ModelRunner, TargetOutput, verify_rows
from mtp_core.engine.overlap import OverlapScheduler
from mtp_core.engine.scheduler import ScheduledRow, Scheduler
from mtp_core.engine.static_step import make_static_steps
from mtp_core.engine.step import FusedRoute, Route, StepOutput
from mtp_core.kv_cache.block_manager import BlockManager
from mtp_core.kv_cache.mla_cache import allocate_caches, copy_block, plan_num_blocks
from mtp_core.kv_cache.prefix_cache import PrefixCacheStats, PrefixRecurrence, ReusePolicy
from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM
from mtp_core.request.sequence import Sequence, Stops, Times
from mtp_core.request.stats import SpecStats
from mtp_core.sampling import SamplingParams
from mtp_core.speculative import backlog
from mtp_core.speculative.adaptive import DraftLimits
from mtp_core.speculative.draft_vocab import load_token_map
from mtp_core.speculative.drafter import DraftInput, Drafter, make_drafter
from mtp_core.native.forward_path import serving_forward
from mtp_core.speculative.costs import CostPrior
from mtp_core.speculative.policy import DraftLenPolicy
from mtp_core.speculative.verifier import Acceptance, VerifyResult
from mtp_core.structured import GrammarBackend, Guided

if TYPE_CHECKING:
    from mtp_core.engine.native_step import NativeStep
    from mtp_core.engine.static_step import GraphRunner
    from mtp_core.model.forward_path import ForwardPath

log = logging.getLogger("mtp.engine")


class NativeTargetRoute:
    """The general path's target forward and verification in one native call (NativeStep.target) for a greedy batch
    the call verifies (NativeStep.can_verify) but the fused native step does not take (a drafting row lacks the
    stored states its MTP forwards re-read): the hidden states go to the drafter in the engine's propose stage, as
    on the general path."""

    def __init__(self, native: "NativeStep") -> None:
        self.native = native

    def accepts(self, rows: list[ScheduledRow]) -> bool:
        return self.native.can_verify(rows)

    def step(self, rows: list[ScheduledRow], meta: Optional[AttentionMetadata]) -> StepOutput:
        verified, hidden = self.native.target(rows)
        return StepOutput(rows, verified, TargetOutput(hidden, [None] * len(rows)))


class GeneralRoute:
    """The general path as a route (engine/step.py): it accepts every batch; Engine._target runs the target forward
    (ModelRunner) and the verifier, the engine's propose stage the drafter."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def accepts(self, rows: list[ScheduledRow]) -> bool:
        return True

    def step(self, rows: list[ScheduledRow], meta: Optional[AttentionMetadata]) -> StepOutput:
        out, verified = self.engine._target(rows, meta)
        return StepOutput(rows, verified, out)


@dataclass
class Drafting:
    """The speculative side of the engine: the most drafts a row verifies (0: no MTP), which rule verifies each
    row (speculative/verifier.py), the draft-length policy, the drafter (None without MTP), and for benchmarks
    only a replay that replaces the proposed drafts to meet a given acceptance (speculative/replay.py)."""
    draft_len: int
    acceptance: Acceptance
    policy: DraftLenPolicy
    drafter: Optional[Drafter]
    replay: Optional[Callable[[Sequence, list[int]], list[int]]] = None


@dataclass
class StepPaths:
    """How a step runs: the forward path (native or torch) of every eager forward, the general path's runner, the
    overlap worker (None: off), the fused steps (CUDA graphs, the native CPU step; None where absent) and the
    routes in the order the engine tries them (engine/step.py)."""
    forward_path: ForwardPath
    runner: ModelRunner
    overlap: Optional[OverlapScheduler]
    graphs: Optional[GraphRunner]
    native_step: Optional[NativeStep]
    routes: list[Route] = field(default_factory=list)


@dataclass
class Grammars:
    """Structured output: the factory LLM sets (it has the tokenizer), the backend built from it on first use."""
    factory: Optional[Callable[[], GrammarBackend]] = None
    backend: Optional[GrammarBackend] = None


class Engine:
    def __init__(self, model: DeepseekV3ForCausalLM, cfg: LLMConfig, eos_token_ids: list[int],
                 think_ids: Optional[tuple[int, int]] = None, drafter: Optional[Drafter] = None,
                 iter_log: Optional[Callable[[str], None]] = None) -> None:
        self.model, self.cfg = model, cfg
        spec = cfg.speculative_config
        draft_len = spec.max_draft_len if spec else 0
        self.stops = Stops(set(eos_token_ids), think_ids, cfg.max_seq_len or model.config.max_position_embeddings)
        # which rule verifies each row (speculative/verifier.py): strict, relaxed where it is on, sampled, guided
        acceptance = Acceptance.of(spec, Guided.pair(think_ids))
        if spec and spec.use_relaxed_acceptance_for_thinking and think_ids is None:
            raise ValueError("relaxed acceptance for thinking needs <think> and </think> tokens, but the tokenizer "
                             "has neither; drop --use_relaxed_acceptance_for_thinking")
        # native or torch, for every eager forward of this engine (drafts scored over the draft vocabulary when
        # the config names one: speculative/draft_vocab.py)
        draft_vocab = load_token_map(spec.draft_token_map, model.config.vocab_size) \
            if draft_len and spec.draft_token_map else None
        forward_path = serving_forward(model, draft_vocab)
        kv = cfg.kv_cache_config
        device = cfg.device
        # the KV cache in the model's dtype, or e4m3 (kv_cache_config.dtype fp8: per-tensor scale 1, see
        # kv_cache/mla_cache.py), on every device
        dtype = torch.float8_e4m3fn if kv.dtype == "fp8" else next(model.parameters()).dtype
        num_layers = len(model.model.layers) if draft_len else model.num_main_layers
        num_blocks = plan_num_blocks(model.config, kv, num_layers, dtype, device,
                                     cfg.max_batch_size * (self.stops.max_seq_len + 2 * draft_len))
        if num_blocks < 1:
            raise ValueError(f"the KV cache pool holds no block of {kv.tokens_per_block} tokens; raise "
                             "kv_cache_config.max_tokens or --kv_cache_fraction")
        self.caches = allocate_caches(model.config, num_layers, num_blocks, kv.tokens_per_block, dtype, device)
        self.blocks = BlockManager(num_blocks, kv.tokens_per_block, enable_reuse=kv.enable_block_reuse)
        self.blocks.copy_block = partial(copy_block, self.caches)
        policy = self._make_policy(draft_len, len(draft_vocab) if draft_vocab is not None else 0)
        self.scheduler = Scheduler(self.blocks, cfg.max_batch_size, max(cfg.max_num_tokens, draft_len + 1),
                                   draft_len, cfg.enable_chunked_prefill, policy=policy)
        self.spec = Drafting(draft_len, acceptance, policy,
                             drafter if drafter is not None else make_drafter(model, forward_path, self.caches,
                                                                              kv.tokens_per_block, spec))
        runner = self._make_runner(forward_path)
        mode = spec.resolved_mode(model.num_mtp_modules) if draft_len and model.num_mtp_modules else None
        self.scheduler.reuse = ReusePolicy.for_drafting(mode, draft_len)
        self.iter_log = iter_log
        self.num_steps = 0
        overlap = (not cfg.disable_overlap_scheduler and self.spec.drafter is not None
                   and (torch.device(cfg.device).type != "cpu" or cfg.overlap_scheduler_on_cpu))
        graphs, native_step = make_static_steps(
            model, forward_path, cfg, self.caches, self.blocks, draft_len, mode, acceptance,
            self.stops.max_seq_len, fixed_counts=policy.policy == "fixed", overlap=overlap,
            injected_drafter=drafter is not None)
        self.paths = StepPaths(forward_path, runner, OverlapScheduler(self.scheduler, runner) if overlap else None,
                               graphs, native_step)
        if native_step is not None and draft_len:
            policy.fuse_drafting()            # its cost cells hold the drafting too (speculative/costs.CostPrior)
        # a static step's padded rows hold one block of the pool for good
        self.pool_tokens = (num_blocks - (graphs is not None)) * kv.tokens_per_block
        self.grammar = Grammars()
        self._make_routes(graphs, native_step)

    def _make_runner(self, forward_path: ForwardPath) -> ModelRunner:
        """The general path's runner. Without a drafter nothing reads a prompt's hidden states but the last; under a
        policy that defers prompts' MTP forwards, a prompt's stay Unfinished until its request drafts (unless
        prompts share prefixes: a shared block needs its MTP entries now, backlog.propose)."""
        runner = ModelRunner(forward_path, self.caches, self.blocks.tokens_per_block, self.cfg.device,
                             keep_hidden=self.spec.drafter is not None)
        if self.spec.drafter is not None and self.spec.policy.defers_prompts() and self.model.num_main_layers > 1:
            runner.split_prompts = lambda: not self._shared_block()
            runner.split_max_len = backlog.MAX_MTP_LAG // 2
        return runner

    def _make_routes(self, graphs, native_step) -> None:
        """The routes a step can take (engine/step.py), in order: the fused step where the batch allows, else the
        general path, which takes any batch."""
        if native_step is not None:
            native_step.bind(self.stops, self.paths.runner.finish)
        self.paths.routes = [FusedRoute(f) for f in (graphs, native_step) if f is not None]
        self.paths.routes += [NativeTargetRoute(native_step)] if native_step is not None else []
        self.paths.routes.append(GeneralRoute(self))

    def _make_policy(self, draft_len: int, draft_vocab: int) -> DraftLenPolicy:
        """The draft-length policy (speculative/policy.py); draft_vocab: the rows a draft's LM head reads (0: all).
        Under tensor / expert parallelism every rank
        must choose the same counts, so measured (per-rank) costs cannot decide: fixed there."""
        spec, cfg = self.cfg.speculative_config, self.cfg
        if spec is None:
            return DraftLenPolicy(0, policy="fixed")
        policy = spec.draft_len_policy
        if policy == "cost" and cfg.tensor_parallel_size * cfg.moe_expert_parallel_size > 1:
            log.warning("draft_len_policy cost chooses from this process's measured step times, which ranks do "
                        "not share; drafting %d per step (fixed)", draft_len)
            policy = "fixed"
        if policy == "cost" and spec.use_relaxed_acceptance_for_thinking:
            log.warning("relaxed acceptance emits accepted drafts, so thinking-phase text depends on how many are "
                        "verified, which draft_len_policy cost chooses from measured timings: it may differ between "
                        "runs; set draft_len_policy: fixed for reproducible relaxed output")
        n = self.model.num_mtp_modules
        modules = draft_len if n and spec.resolved_mode(n) == "vanilla" else 1    # MTP modules one catch-up runs
        log.info("draft length: %s", f"0..{draft_len} per step, chosen from measured step costs (draft_len_policy "
                 f"cost)" if policy == "cost" else f"{draft_len} per step (draft_len_policy fixed)")
        # on a CPU the step's cost is the engine thread's CPU time: a shared machine's other load and idle
        # gaps between requests stay out of it; a GPU's work runs beside the thread, so wall time there
        clock = time.thread_time if torch.device(cfg.device).type == "cpu" else time.perf_counter
        prior = CostPrior(modules / max(self.model.num_main_layers, 1), self.model.draft_read_share(draft_vocab))
        return DraftLenPolicy(draft_len, DraftLimits.from_spec(spec, cfg.max_batch_size), policy, prior, clock)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.stops.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but max_seq_len is {self.stops.max_seq_len}; "
                             "shorten the prompt or raise --max_seq_len")
        need = len(prompt_ids) + 1 + 2 * self.spec.draft_len
        if need > self.pool_tokens:
            raise ValueError(f"the prompt needs {need} KV slots but the whole KV cache pool holds "
                             f"{self.pool_tokens}; raise kv_cache_config.max_tokens or --kv_cache_fraction")
        seq = Sequence(list(prompt_ids), params, times=Times(arrival_time=time.perf_counter()))
        if params.guided is not None:
            if self.grammar.backend is None:
                if self.grammar.factory is None:
                    raise ValueError("structured output needs the engine's tokenizer; create the engine through LLM")
                self.grammar.backend = self.grammar.factory()
            seq.decoding.matcher = self.grammar.backend.matcher(params.guided)   # a bad schema: ValueError
        if params.prompt_logprobs is not None:
            seq.returned.prompt_logprobs = [None]    # the first prompt token has no logprob
        if params.seed is not None:
            seq.decoding.generator = torch.Generator(device=self.cfg.device).manual_seed(params.seed)
        if self.stops.think_ids is not None:
            start, end = self.stops.think_ids
            last = max((i for i, t in enumerate(prompt_ids) if t in (start, end)), default=-1)
            seq.decoding.in_thinking = last >= 0 and prompt_ids[last] == start
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def overlap(self) -> bool:
        return self.paths.overlap is not None

    @property
    def stats(self) -> SpecStats:
        """The speculative-decoding statistics of every request so far: each request's own (seq.stats), summed
        (the finished ones' by the scheduler when they finished)."""
        total, sch = SpecStats(), self.scheduler
        total.merge(sch.finished_stats)
        for q in (*sch.running, *sch.waiting):
            if q.stats.num_steps:          # a request that has not run a step has nothing to add
                total.merge(q.stats)
        return total

    # ---- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Runs one engine step; returns the sequences that made progress (finished ones included)."""
        # t0 for the iteration log; c0, c1 on the policy's clock: the step's start and the end of its commit (None:
        # a step the policy does not time)
        policy = self.spec.policy
        clock = policy.clock if policy.times_next_step else None
        t0, c0 = time.perf_counter(), clock() if clock else None
        rows, meta = self._schedule()
        if not rows:
            return []
        try:
            step = self._forward(rows, meta)
            inputs = self._commit(step)
            c1 = clock() if clock else None
            self._choose_drafts(inputs, step)
            drafts = self._propose(inputs, step)
            self._store_drafts(inputs, drafts)
        except BaseException:
            self._abort_step(rows)
            raise
        self._finish_step(step, t0, c0, c1, clock)
        return [r.seq for r in rows]

    def _abort_step(self, rows: list[ScheduledRow]) -> None:
        """Leaves no half-done step behind: every sequence of a failed step is finished with "abort"."""
        if self.paths.overlap is not None:
            self.paths.overlap.prepared = None
        for r in rows:
            if not r.seq.is_finished:
                r.seq.finish_reason = "abort"
                self.scheduler.finish(r.seq, cache=False)

    def _schedule(self) -> tuple[list[ScheduledRow], Optional[AttentionMetadata]]:
        """The step's rows: prepared ahead by the overlap worker, or scheduled now (their attention metadata is
        then built by the general path when it runs; a fused step needs none)."""
        prepared = self.paths.overlap.take() if self.paths.overlap is not None else None
        rows, meta = prepared if prepared is not None else (self.scheduler.schedule(), None)
        if not rows and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not place any request in a step (KV pool or token budget "
                               "too small); raise kv_cache_config.max_tokens or --max_num_tokens")
        return rows, meta

    def _forward(self, rows: list[ScheduledRow], meta: Optional[AttentionMetadata]) -> StepOutput:
        """The target forward and verification by the first route that accepts the batch (engine/step.py): the fused
        step where the batch allows (it drafts too), else the general path. Greedy requests whose logits the engine must see (logprobs, penalties, logit_bias,
        min_tokens, grammars) stay on the native CPU step, which prepares what they need along their drafts; the
        CUDA-graph step leaves them to the general path. The forward is batch-invariant, so every row's tokens and
        logprobs are the same on every path."""
        return next(r for r in self.paths.routes if r.accepts(rows)).step(rows, meta)

    def _target(self, rows: list[ScheduledRow], meta: Optional[AttentionMetadata]
                ) -> tuple[TargetOutput, VerifyResult]:
        """The general path's target forward (runner.execute) and verification (the verifier)."""
        out = self.paths.runner.execute(rows, meta)
        return out, self._verify(rows, out)

    def _verify(self, rows: list[ScheduledRow], out: TargetOutput) -> VerifyResult:
        return verify_rows(rows, out, self.stops.eos_token_ids, self.spec.acceptance)

    def _commit(self, step: StepOutput) -> list[DraftInput]:
        """Appends the emitted tokens and records each request's statistics; the draft inputs carry the target
        hidden states (None after a fused step, which drafted already)."""
        now = time.perf_counter()
        out, verified = step.target, step.verified
        inputs: list[DraftInput] = []
        for n_row, (r, emitted) in enumerate(zip(step.rows, verified.tokens)):
            seq = r.seq
            if r.is_prefill:
                if out is not None and out.prompt_logits is not None and out.prompt_logits[n_row] is not None:
                    seq.score_prompt(r.start, out.prompt_logits[n_row])
                seq.kv.num_prefilled += len(r.token_ids)
            # the positions this step wrote: valid before finishing, which registers a request's blocks up to it
            seq.kv.num_cached = valid = r.start + (len(r.token_ids) if r.is_prefill else len(emitted))
            if emitted:
                n_emitted = seq.append(emitted, self.stops.eos_token_ids, self.stops.think_ids, self.stops.max_seq_len)
                if verified.logprobs is not None and verified.logprobs[n_row] is not None:
                    seq.returned.logprobs.extend(verified.logprobs[n_row][:n_emitted])
                proposed = len(r.token_ids) - 1 if not r.is_prefill else 0
                seq.stats.record_step(n_emitted, proposed, len(emitted) - 1)
                if not r.is_prefill and self.spec.drafter is not None:
                    seq.stats.record_decode(proposed)
                    self.spec.policy.observe(seq.mtp, proposed, len(emitted) - 1, seq.stats)
                if seq.finish_reason is not None:      # its statistics are complete: the scheduler sums them
                    self.scheduler.finish(seq)
                if seq.times.first_token_time is None:
                    seq.times.first_token_time = now
            if seq.is_finished:
                seq.times.finish_time = now
                continue
            inputs.append(DraftInput(seq, r.start, seq.all_ids[r.start + 1: valid + 1],
                                     out.hidden[n_row][:valid - r.start] if out is not None else None,
                                     needs_drafts=not (r.is_prefill and not r.is_final_chunk)))
        return inputs

    def _choose_drafts(self, inputs: list[DraftInput], step: StepOutput) -> None:
        """Once per step: the policy's draft count for each row's next step (inp.max_drafts), recorded in the
        request's statistics. Without MTP only a fused step chooses (0 for every row: it drafts none)."""
        if self.spec.drafter is None and step.drafts is None:
            return
        in_flight = self.spec.policy.in_flight(len(self.scheduler.running), len(self.scheduler.waiting))
        for inp, k in zip(inputs, self.spec.policy.choose(inputs, in_flight)):
            inp.max_drafts = k
            if inp.needs_drafts and not inp.seq.mtp.is_off:
                inp.seq.stats.record_limit(k)

    def _propose(self, inputs: list[DraftInput], step: StepOutput) -> list[list[int]]:
        """Each row's next drafts: the fused step's, cut to the chosen counts; else the drafter's, through the
        backlog (speculative/backlog.py), while the overlap worker prepares the next step. With an acceptance
        replay (benchmarks only, speculative/replay.py) the drafts are then replaced."""
        drafts = self._drafts(inputs, step)
        if self.spec.replay is not None:
            drafts = [self.spec.replay(i.seq, d) for i, d in zip(inputs, drafts)]
        return drafts

    def _drafts(self, inputs: list[DraftInput], step: StepOutput) -> list[list[int]]:
        if step.drafts is not None:
            return [step.drafts[i.seq.request_id][:i.max_drafts] for i in inputs]
        if self.spec.drafter is None:
            return [[] for _ in inputs]
        # a step of one token per row (every row verified no draft): its output holds only states that rows
        # which skip drafting keep, so they may keep views of it instead of copies
        views_ok = all(not r.is_prefill and len(r.token_ids) == 1 for r in step.rows)
        propose = partial(backlog.propose, self.spec.drafter, inputs, views_ok, self.spec.policy.defers_prompts(),
                          self._shared_block(), self.paths.runner.finish)
        if self.paths.overlap is not None and any(i.needs_drafts for i in inputs):
            return self.paths.overlap.while_drafting(propose)
        return propose()

    def _shared_block(self) -> int:
        """Prefix caching shares only blocks whose MTP entries are written: once prompts are seen to share prefixes
        (scheduler.recurrence), a deferred prompt still fills its full ones (the pool's tokens per block), else 0."""
        sch = self.scheduler
        return self.blocks.tokens_per_block if self.blocks.enable_reuse and sch.reuse.mtp and sch.recurrence.seen \
            else 0

    def _store_drafts(self, inputs: list[DraftInput], drafts: list[list[int]]) -> None:
        """Keeps each row's drafts for the next step and drops the KV blocks past its valid length (unless the
        next step was prepared ahead: it keeps them); registers the blocks now final in the prefix cache."""
        rewind = self.paths.overlap is None or self.paths.overlap.prepared is None
        for inp, d in zip(inputs, drafts):
            seq = inp.seq
            seq.mtp.drafts = d
            if rewind and not seq.is_finished and seq in self.scheduler.running:
                self.blocks.rewind(seq.kv.block_table, seq.kv.num_cached)
            if not seq.is_finished:
                self.scheduler.settle(seq)          # prefix cache: register the blocks now final
        if self.paths.overlap is not None:
            self.paths.overlap.fill_drafts()

    def _finish_step(self, step: StepOutput, t0: float, c0: Optional[float], c1: Optional[float],
                     clock: Optional[Callable[[], float]]) -> None:
        """t0: the step's start (perf_counter); c0, c1: its start and the end of its commit on the policy's clock
        (None, and no clock, in a step the policy does not time)."""
        rows = step.rows
        self.spec.policy.record_step(rows, c0, c1, clock() if clock else None)
        self.num_steps += 1
        if self.iter_log:
            ntok = sum(len(r.token_ids) for r in rows)
            acc = sum(len(t) - 1 for r, t in zip(rows, step.verified.tokens) if not r.is_prefill)
            self.iter_log(f"iter {self.num_steps}: batch {len(rows)} ({sum(r.is_prefill for r in rows)} prefill), "
                          f"tokens {ntok}, accepted drafts {acc}, step {1e3 * (time.perf_counter() - t0):.2f} ms")

    def close(self) -> None:
        """Stops the overlap scheduler's worker thread; the engine takes no more steps after this."""
        if self.paths.overlap is not None:
            self.paths.overlap.close()

    def reset_prefix_cache(self) -> None:
        """Drop every unreferenced cached block, zero the hit statistics and forget which prompts were seen (e.g.
        after a warm-up, whose prompts would otherwise count as recurring: scheduler.recurrence)."""
        self.blocks.clear_cache()
        self.blocks.stats = PrefixCacheStats()
        self.scheduler.recurrence = PrefixRecurrence()

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        if self.paths.overlap is not None:
            self.paths.overlap.prepared = None   # a prepared step may hold the aborted sequence
