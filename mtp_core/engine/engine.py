"""The step loop. One step reads like the algorithm:

    rows   = scheduler.schedule()        # prefill chunks / decode rows of 1+K tokens; KV slots reserved
    out    = runner.execute(rows)        # target forward -> hidden states, logits
    result = verify(out, rows)           # emitted tokens per row (accepted drafts + bonus)
    inputs = commit(rows, result, out)   # append tokens, stop checks, statistics, new valid lengths
    counts = policy.choose(inputs)       # next step's draft count per row (0..K), from measured costs
    drafts = drafter.propose(inputs)     # MTP forwards per row -> next drafts
    rewind(rows, drafts)                 # store drafts, drop KV of rejected drafts, free finished

Overlap scheduler (default on a GPU; --disable_overlap_scheduler turns it off; on a CPU, where host work
and compute share the cores, it is off unless LLMConfig.overlap_scheduler_on_cpu): once step N is committed, the
next step's schedule and attention metadata (positions, slots, block tables: everything but the draft
token ids) are prepared on a worker thread while step N's K MTP forwards run; the drafts are filled in
afterwards. Continuing sequences then keep their reserved tail blocks (the next step needs them again)
instead of rewinding them; every block still returns to the pool on finish, abort or preemption. The
computation itself is unchanged, so outputs are identical either way.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from mtp_core.config import LLMConfig
from mtp_core.engine.graph_runner import GraphRunner, default_batch_sizes, static_step_unsupported
from mtp_core.engine.model_runner import ModelRunner, TargetOutput
from mtp_core.engine.native_step import NativeStep
from mtp_core.model import AttentionMetadata
from mtp_core.engine.scheduler import PreemptionNeeded, ScheduledRow, Scheduler
from mtp_core.engine.sequence import Sequence
from mtp_core.kv_cache.block_manager import BlockManager
from mtp_core.kv_cache.mla_cache import allocate_caches, plan_num_blocks
from mtp_core.kv_cache.prefix_cache import PrefixCacheStats, ReusePolicy
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.model.forward_path import serving_forward
from mtp_core.sampling import SamplingParams, process_logits, token_logprobs
from mtp_core.speculative.adaptive import MAX_MTP_LAG
from mtp_core.speculative.drafter import DraftInput, Drafter, EagleDrafter, VanillaDrafter
from mtp_core.speculative.policy import DraftLenPolicy
from mtp_core.speculative.stats import SpecStats
from mtp_core.speculative.verifier import VerifyResult, verify
from mtp_core.structured import GrammarBackend, verify_guided_row

log = logging.getLogger("mtp.engine")
_STRICT = SamplingParams()


class Engine:
    def __init__(self, model: DeepseekV3ForCausalLM, cfg: LLMConfig, eos_token_ids: list[int],
                 think_ids: Optional[tuple[int, int]] = None, drafter: Optional[Drafter] = None,
                 iter_log: Optional[Callable[[str], None]] = None) -> None:
        self.model, self.cfg = model, cfg
        self.eos_token_ids = set(eos_token_ids)
        self.think_ids = think_ids
        spec = cfg.speculative_config
        self.K = spec.max_draft_len if spec else 0
        self.max_seq_len = cfg.max_seq_len or model.config.max_position_embeddings
        self.relaxed = (spec.relaxed_topk, spec.relaxed_delta) if spec and spec.use_relaxed_acceptance_for_thinking \
            else None
        if self.relaxed and think_ids is None:
            raise ValueError("relaxed acceptance for thinking needs <think> and </think> tokens, but the tokenizer "
                             "has neither; drop --use_relaxed_acceptance_for_thinking")
        self.forward_path = serving_forward(model)     # native or torch, for every eager forward of this engine
        kv = cfg.kv_cache_config
        device = cfg.device
        # the KV cache in the model's dtype, or e4m3 (kv_cache_config.dtype fp8: per-tensor scale 1, see
        # kv_cache/mla_cache.py), on every device
        dtype = torch.float8_e4m3fn if kv.dtype == "fp8" else next(model.parameters()).dtype
        num_layers = len(model.model.layers) if self.K else model.num_main_layers
        num_blocks = plan_num_blocks(model.config, kv, num_layers, dtype, device,
                                     cfg.max_batch_size * (self.max_seq_len + 2 * self.K))
        if num_blocks < 1:
            raise ValueError(f"the KV cache pool holds no block of {kv.tokens_per_block} tokens; raise "
                             "kv_cache_config.max_tokens or --kv_cache_fraction")
        self.caches = allocate_caches(model.config, num_layers, num_blocks, kv.tokens_per_block, dtype, device)
        self.pool_tokens = num_blocks * kv.tokens_per_block
        self.blocks = BlockManager(num_blocks, kv.tokens_per_block, enable_reuse=kv.enable_block_reuse)
        self.blocks.copy_block = self._copy_block
        self.policy = self._make_policy()
        self.scheduler = Scheduler(self.blocks, cfg.max_batch_size, max(cfg.max_num_tokens, self.K + 1), self.K,
                                   cfg.enable_chunked_prefill, policy=self.policy)
        self.runner = ModelRunner(self.forward_path, self.caches, kv.tokens_per_block, device)
        self.drafter = drafter if drafter is not None else self._make_drafter()
        mode = spec.resolved_mode(model.num_mtp_modules) if self.K and model.num_mtp_modules else None
        self.scheduler.reuse = ReusePolicy.for_drafting(mode, self.K)
        self.stats = SpecStats()
        self.iter_log = iter_log
        self.num_steps = 0
        self.graphs = self._make_graphs() if cfg.cuda_graph_config is not None else None
        self.overlap = (not cfg.disable_overlap_scheduler and self.drafter is not None
                        and (torch.device(cfg.device).type != "cpu" or cfg.overlap_scheduler_on_cpu))
        # on a CPU with the native forward: the whole decode step in one native call where the batch allows
        use_native_step = cfg.native_step and os.environ.get("MTP_CORE_NATIVE_STEP", "1") != "0"
        self.native_step = (NativeStep(model, self.forward_path, self.caches, self.K, self.relaxed,
                                       fixed_counts=self.policy.policy == "fixed", vanilla=mode == "vanilla",
                                       confidence=spec.draft_confidence_threshold if spec else 0.0)
                            if use_native_step and self.graphs is None and not self.overlap and drafter is None
                            and self.forward_path.name == "native" else None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mtp-overlap") if self.overlap else None
        self._prepared: Optional[tuple[list[ScheduledRow], AttentionMetadata]] = None
        self.grammar_factory: Optional[Callable[[], GrammarBackend]] = None   # set by LLM (it has the tokenizer)
        self.grammars: Optional[GrammarBackend] = None

    def _make_policy(self) -> DraftLenPolicy:
        """The draft-length policy (speculative/policy.py). Under tensor / expert parallelism every rank
        must choose the same counts, so measured (per-rank) costs cannot decide: fixed there."""
        spec, cfg = self.cfg.speculative_config, self.cfg
        if spec is None:
            return DraftLenPolicy.from_spec(None, cfg.max_batch_size)
        policy = spec.draft_len_policy
        if policy == "cost" and cfg.tensor_parallel_size * cfg.moe_expert_parallel_size > 1:
            log.warning("draft_len_policy cost chooses from this process's measured step times, which ranks do "
                        "not share; drafting %d per step (fixed)", self.K)
            policy = "fixed"
        if policy == "cost" and spec.use_relaxed_acceptance_for_thinking:
            log.warning("relaxed acceptance emits accepted drafts, so thinking-phase text depends on how many are "
                        "verified, which draft_len_policy cost chooses from measured timings: it may differ between "
                        "runs; set draft_len_policy: fixed for reproducible relaxed output")
        n = self.model.num_mtp_modules
        modules = self.K if n and spec.resolved_mode(n) == "vanilla" else 1    # MTP modules one catch-up runs
        log.info("draft length: %s", f"0..{self.K} per step, chosen from measured step costs (draft_len_policy "
                 f"cost)" if policy == "cost" else f"{self.K} per step (draft_len_policy fixed)")
        # on a CPU the step's cost is the engine thread's CPU time: a shared machine's other load and idle
        # gaps between requests stay out of it; a GPU's work runs beside the thread, so wall time there
        clock = time.thread_time if torch.device(cfg.device).type == "cpu" else time.perf_counter
        return DraftLenPolicy.from_spec(spec, cfg.max_batch_size, modules / max(self.model.num_main_layers, 1),
                                        policy, clock)

    def _make_drafter(self) -> Optional[Drafter]:
        spec = self.cfg.speculative_config
        if not spec:
            return None
        n = self.model.num_mtp_modules
        if n == 0:
            raise ValueError("--spec_decode_algo MTP needs MTP modules, but the checkpoint has "
                             "num_nextn_predict_layers = 0")
        mode = spec.resolved_mode(n)
        cls = VanillaDrafter if mode == "vanilla" else EagleDrafter
        log.info("MTP %s drafting, max_draft_len=%d, %d module(s) in the checkpoint", mode, self.K, n)
        return cls(self.model, self.forward_path, self.caches, self.blocks.tokens_per_block, self.K,
                   confidence_threshold=spec.draft_confidence_threshold)

    def _make_graphs(self) -> Optional[GraphRunner]:
        """The static (CUDA-graph) decode step for each batch size of cuda_graph_config; None, with a log
        line, when this model or drafting mode cannot run it (every step then runs eagerly)."""
        cg, spec = self.cfg.cuda_graph_config, self.cfg.speculative_config
        mode = spec.resolved_mode(self.model.num_mtp_modules) if spec else None
        why = static_step_unsupported(self.model, mode, self.K,
                                      spec.draft_confidence_threshold if spec else 0.0)
        if why is not None:
            log.warning("CUDA graphs off: %s", why)
            return None
        scratch: list[int] = []
        self.blocks.reserve(scratch, 1)            # padded rows read and write only this block, forever
        self.pool_tokens -= self.blocks.tokens_per_block
        sizes = [b for b in (cg.batch_sizes or default_batch_sizes(cg.max_batch_size or self.cfg.max_batch_size))
                 if b <= self.cfg.max_batch_size]
        relaxed = self.relaxed if self.relaxed and self.relaxed[0] > 1 and self.relaxed[1] > 0 else None
        return GraphRunner(self.model, self.caches, self.K, sizes, cg.enable_padding,
                           self.blocks.blocks_for(self.max_seq_len + 2 * self.K), self.blocks.tokens_per_block,
                           scratch[0], relaxed, torch.device(self.cfg.device))

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but max_seq_len is {self.max_seq_len}; "
                             "shorten the prompt or raise --max_seq_len")
        need = len(prompt_ids) + 1 + 2 * self.K
        if need > self.pool_tokens:
            raise ValueError(f"the prompt needs {need} KV slots but the whole KV cache pool holds "
                             f"{self.pool_tokens}; raise kv_cache_config.max_tokens or --kv_cache_fraction")
        seq = Sequence(list(prompt_ids), params, arrival_time=time.perf_counter())
        if params.guided is not None:
            if self.grammars is None:
                if self.grammar_factory is None:
                    raise ValueError("structured output needs the engine's tokenizer; create the engine through LLM")
                self.grammars = self.grammar_factory()
            seq.matcher = self.grammars.matcher(params.guided)        # a bad schema: ValueError
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]             # the first prompt token has no logprob
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.cfg.device).manual_seed(params.seed)
        if self.think_ids is not None:
            start, end = self.think_ids
            last = max((i for i, t in enumerate(prompt_ids) if t in (start, end)), default=-1)
            seq.in_thinking = last >= 0 and prompt_ids[last] == start
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Runs one engine step; returns the sequences that made progress (finished ones included)."""
        t0, c0 = time.perf_counter(), self.policy.clock()
        rows, meta = self._prepared if self._prepared is not None else self._prepare()
        self._prepared = None
        if not rows:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("the scheduler could not place any request in a step (KV pool or token budget "
                                   "too small); raise kv_cache_config.max_tokens or --max_num_tokens")
            return []
        try:
            # a request whose logits the engine must see (logprobs, penalties) takes the general path; the forward
            # is batch-invariant, so its tokens and every other row's are the same as on the fused steps
            fused = (self.graphs or self.native_step) if not self._needs_logits(rows) else None
            static = fused.step_for(rows) if fused is not None else None
            if static is not None:
                # target forward, verification and the draft forwards in one step: a captured static step (CUDA
                # graph) or one native call (CPU)
                tokens, drafts = static.run(rows)
                result = VerifyResult(tokens)
                inputs = self._commit(rows, result, None)   # run() brought the rows' MTP state up to date
                c1 = self.policy.clock()
                self._choose_drafts(inputs)      # the step drafted its count for every row; cut to the choices
                drafts_of = {id(r.seq): d for r, d in zip(rows, drafts)}
                self._store_drafts(inputs, [drafts_of[id(i.seq)][:i.max_drafts] for i in inputs], rewind=True)
                fused.num_replays += 1
                return self._finish_step(rows, result, t0, c0, c1)
            out, result = self._target(rows, meta)
            inputs = self._commit(rows, result, out)
            c1 = self.policy.clock()
            if self.drafter is not None:
                self._choose_drafts(inputs)
            # a step of one token per row (every row verified no draft): its output holds only states that
            # rows which skip drafting keep, so they may keep views of it instead of copies
            single = all(not r.is_prefill and len(r.token_ids) == 1 for r in rows)
            if self.overlap and any(i.needs_drafts for i in inputs):
                future = self._executor.submit(self._prepare_ahead)   # step N+1's host work ...
                try:
                    drafts = self._propose(inputs, single)            # ... while step N's drafts compute
                finally:
                    self._prepared = future.result()
                self._store_drafts(inputs, drafts, rewind=self._prepared is None)
                if self._prepared:
                    prepared, ragged = self._prepared[0], False
                    for row in prepared:
                        if not row.is_prefill:
                            # the worker reserved slots for as many drafts as the row's limit allowed then
                            d = row.seq.drafts[:len(row.token_ids) - 1]
                            ragged |= len(d) != len(row.token_ids) - 1
                            row.token_ids = [row.seq.all_ids[-1], *d]
                    if ragged:     # fewer drafts than the placeholders: positions and slots change
                        self._prepared = (prepared, self.runner.prepare(prepared))
            else:
                drafts = self._propose(inputs, single) if self.drafter else [[] for _ in inputs]
                self._store_drafts(inputs, drafts, rewind=True)
        except BaseException:
            # leave no half-done step behind: every sequence of this step is finished with "abort"
            self._prepared = None
            for r in rows:
                if not r.seq.is_finished:
                    r.seq.finish_reason = "abort"
                    self.scheduler.finish(r.seq, cache=False)
            raise
        return self._finish_step(rows, result, t0, c0, c1)

    def _target(self, rows: list[ScheduledRow], meta: Optional[AttentionMetadata]) -> tuple[TargetOutput, VerifyResult]:
        """The target forward and verification: one native call where the batch allows (NativeStep.target),
        else runner.execute and the verifier."""
        if self.native_step is not None and not self._needs_logits(rows) and self.native_step.can_verify(rows):
            tokens, hidden = self.native_step.target(rows)
            return TargetOutput(hidden, [None] * len(rows)), VerifyResult(tokens)
        out = self.runner.execute(rows, meta)
        return out, self._verify(rows, out)

    @staticmethod
    def _needs_logits(rows: list[ScheduledRow]) -> bool:
        return any(r.seq.params.needs_logits for r in rows)

    def _finish_step(self, rows: list[ScheduledRow], result: VerifyResult, t0: float, c0: float, c1: float
                     ) -> list[Sequence]:
        """t0: the step's start (perf_counter); c0, c1: its start and the end of its commit on the policy's clock."""
        self.policy.record_step(rows, c0, c1, self.policy.clock())
        self.num_steps += 1
        if self.iter_log:
            ntok = sum(len(r.token_ids) for r in rows)
            acc = sum(len(t) - 1 for r, t in zip(rows, result.tokens) if not r.is_prefill)
            self.iter_log(f"iter {self.num_steps}: batch {len(rows)} ({sum(r.is_prefill for r in rows)} prefill), "
                          f"tokens {ntok}, accepted drafts {acc}, step {1e3 * (time.perf_counter() - t0):.2f} ms")
        return [r.seq for r in rows]

    def _prepare(self) -> tuple[list[ScheduledRow], Optional[AttentionMetadata]]:
        """The step's rows; their attention metadata is built by the general path when it runs (a native or
        static step needs none)."""
        return self.scheduler.schedule(), None

    def _prepare_ahead(self) -> Optional[tuple[list[ScheduledRow], Optional[AttentionMetadata]]]:
        """The overlap worker's schedule: never preempts a sequence that is being drafted right now (the
        step is then scheduled normally once drafting is done)."""
        try:
            rows = self.scheduler.schedule(allow_preempt=False, placeholder=True)
        except PreemptionNeeded:
            return None
        return rows, (self.runner.prepare(rows) if rows else None)

    def _verify(self, rows: list[ScheduledRow], out: TargetOutput) -> VerifyResult:
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: Optional[list] = None
        # rows may carry different numbers of drafts (adaptive draft length): one verify call per count
        counts = sorted({len(r.token_ids) for r in rows if not r.is_prefill})
        for group in (
            *([i for i, r in enumerate(rows) if not r.is_prefill and len(r.token_ids) == n] for n in counts),
            [i for i, r in enumerate(rows) if r.is_final_chunk],
        ):
            if not group:
                continue
            logits = torch.stack([out.logits[i] for i in group])           # [B, K+1 or 1, V]
            drafts = torch.tensor([rows[i].token_ids[1:] if not rows[i].is_prefill else [] for i in group],
                                  dtype=torch.long, device=logits.device).view(len(group), -1)  # [B, K or 0]
            seqs = [rows[i].seq for i in group]
            if any(s.params.processes_logits for s in seqs):
                # penalties, bias, min_tokens: position j of a row sees the counts after drafts 1..j, so every
                # acceptance below compares a draft with exactly what plain decoding would choose there
                logits = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
                for b, (i, s) in enumerate(zip(group, seqs)):
                    if s.params.processes_logits:
                        stop_ids = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos
                                                                   else sorted(self.eos_token_ids))
                        logits[b] = process_logits(logits[b], s.params, s.prompt_ids, s.output_ids,
                                                   rows[i].token_ids[1:] if not rows[i].is_prefill else [], stop_ids)
            # (a guided row is verified below; here it is a cheap strict row that draws nothing from its generator)
            res = verify(logits, drafts, [s.params if s.matcher is None else _STRICT for s in seqs],
                         [self.relaxed if s.in_thinking and s.matcher is None else None for s in seqs],
                         [s.generator if s.matcher is None else None for s in seqs])
            for b, (i, s) in enumerate(zip(group, seqs)):
                if s.matcher is not None:      # the grammar's mask at every position, drafts accepted in order
                    after_think = s.params.guided_after_think and self.think_ids is not None
                    res.tokens[b] = verify_guided_row(self.grammars, s.matcher, logits[b], drafts[b].tolist(), s.params,
                                                      s.generator, after_think and s.in_thinking,
                                                      self.think_ids if after_think else None)
            for i, t in zip(group, res.tokens):
                tokens[i] = t
                lp = rows[i].seq.params.logprobs
                if lp is not None:          # the raw target logits at each emitted position
                    if logprobs is None:
                        logprobs = [None] * len(rows)
                    logprobs[i] = token_logprobs(out.logits[i], t, lp)
        return VerifyResult(tokens, logprobs)

    def _commit(self, rows: list[ScheduledRow], result: VerifyResult, out: Optional[TargetOutput]
                ) -> list[DraftInput]:
        """Appends the emitted tokens; the draft inputs carry the target hidden states (None after a static
        step, which drafted already)."""
        now = time.perf_counter()
        inputs: list[DraftInput] = []
        for n_row, (r, emitted, hidden) in enumerate(zip(rows, result.tokens,
                                                         out.hidden if out is not None else [None] * len(rows))):
            seq = r.seq
            if r.is_prefill:
                if out is not None and out.prompt_logits is not None and out.prompt_logits[n_row] is not None:
                    self._prompt_logprobs(seq, r.start, out.prompt_logits[n_row])
                seq.num_prefilled += len(r.token_ids)
            if emitted:
                n_emitted = self._append(seq, emitted)
                if result.logprobs is not None and result.logprobs[n_row] is not None:
                    seq.logprobs.extend(result.logprobs[n_row][:n_emitted])
                proposed = len(r.token_ids) - 1 if not r.is_prefill else 0
                seq.stats.record_step(n_emitted, proposed, len(emitted) - 1)
                self.stats.record_step(n_emitted, proposed, len(emitted) - 1)
                if not r.is_prefill and self.drafter is not None:
                    seq.stats.record_decode(proposed)
                    self.stats.record_decode(proposed)
                    pauses = seq.num_pauses
                    self.policy.observe(seq, proposed, len(emitted) - 1, seq.stats)
                    self.stats.num_window_pauses += seq.num_pauses - pauses
                if seq.first_token_time is None:
                    seq.first_token_time = now
            valid = r.start + (len(r.token_ids) if r.is_prefill else len(emitted))
            seq.num_cached = valid
            if seq.is_finished:
                seq.finish_time = now
                continue
            n_new = valid - r.start
            inputs.append(DraftInput(seq, r.start, seq.all_ids[r.start + 1: valid + 1],
                                     hidden[:n_new] if hidden is not None else None,
                                     needs_drafts=not (r.is_prefill and not r.is_final_chunk)))
        return inputs

    @staticmethod
    def _prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """A prefill chunk's logits [n, V] from position start: position p scores prompt token p + 1."""
        first = len(seq.prompt_logprobs) - 1 - start          # the chunk's first position not scored yet
        end = min(logits.shape[0], len(seq.prompt_ids) - 1 - start)
        if first < 0 or first >= end:
            return
        seq.prompt_logprobs.extend(token_logprobs(logits[first:end], seq.prompt_ids[start + first + 1: start + end + 1],
                                                  seq.params.prompt_logprobs))

    def _choose_drafts(self, inputs: list[DraftInput]) -> None:
        """Once per step: the policy's draft count for each row's next step (inp.max_drafts)."""
        in_flight = self.policy.in_flight(len(self.scheduler.running), len(self.scheduler.waiting))
        for inp, k in zip(inputs, self.policy.choose(inputs, in_flight)):
            inp.max_drafts = k
            if inp.needs_drafts and not inp.seq.spec_off:
                self.stats.record_limit(k)
                inp.seq.stats.record_limit(k)

    def _propose(self, inputs: list[DraftInput], views_ok: bool = False) -> list[list[int]]:
        """Runs the drafter on the rows that draft this step. A decode row whose count is 0 (the policy, the
        schedule, a paused window) or whose drafting is off skips it: its hidden states wait in
        seq.mtp_pending, so that the next drafting step brings its MTP caches up to date (see
        speculative/adaptive.py). views_ok: the step's output holds nothing else worth freeing."""
        drafts: list[list[int]] = [[] for _ in inputs]
        run: list[int] = []
        for n, inp in enumerate(inputs):
            seq = inp.seq
            if seq.spec_off:
                continue
            limit = inp.max_drafts if inp.needs_drafts and inp.max_drafts is not None else 0
            is_decode = inp.start + len(inp.next_tokens) > seq.prefill_target   # past its prefill
            if limit == 0 and is_decode:
                if seq.mtp_pending is None:
                    seq.mtp_pending = []
                # a view would otherwise keep the whole step's states (drafts, other rows) alive
                seq.mtp_pending.append(inp.hidden if views_ok else inp.hidden.clone())
                if inp.start + len(inp.next_tokens) - seq.mtp_valid > MAX_MTP_LAG:
                    seq.spec_off, seq.mtp_pending = True, None    # bounded memory: no more drafting
                continue
            if seq.mtp_pending and seq.mtp_valid < inp.start:
                # the MTP caches lag (drafting skipped in earlier steps): cover the missing positions too
                V = inp.start + len(inp.next_tokens)
                inp.hidden = torch.cat([*seq.mtp_pending, inp.hidden])
                inp.start, inp.next_tokens = seq.mtp_valid, seq.all_ids[seq.mtp_valid + 1: V + 1]
            inp.max_drafts = limit
            run.append(n)
        if run:
            out = self.drafter.propose([inputs[n] for n in run])
            for n, d in zip(run, out):
                drafts[n] = d
                seq = inputs[n].seq
                seq.mtp_valid, seq.mtp_pending = inputs[n].start + len(inputs[n].next_tokens), None
        return drafts

    def _append(self, seq: Sequence, emitted: list[int]) -> int:
        """Appends tokens one by one, stopping at EOS / stop ids / max_tokens / max_seq_len."""
        n = 0
        for tok in emitted:
            p = seq.params
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                seq.finish_reason = "stop"
                break
            seq.output_ids.append(tok)
            n += 1
            if seq.matcher is not None and not (p.guided_after_think and self.think_ids is not None
                                                and (seq.in_thinking or tok in self.think_ids)):
                seq.matcher.accept_token(tok)
            if self.think_ids is not None:
                if tok == self.think_ids[0]:
                    seq.in_thinking = True
                elif tok == self.think_ids[1]:
                    seq.in_thinking = False
            if len(seq.output_ids) >= p.max_tokens or len(seq.all_ids) >= self.max_seq_len:
                seq.finish_reason = "length"
                break
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
        return n

    def _store_drafts(self, inputs: list[DraftInput], drafts: list[list[int]], rewind: bool) -> None:
        """Keep each row's drafts for the next step; rewind drops the KV blocks past the valid length."""
        for inp, d in zip(inputs, drafts):
            inp.seq.drafts = d
            if rewind and not inp.seq.is_finished and inp.seq in self.scheduler.running:
                self.blocks.rewind(inp.seq.block_table, inp.seq.num_cached)
            if not inp.seq.is_finished:
                self.scheduler.settle(inp.seq)          # prefix cache: register the blocks now final

    def _copy_block(self, src: int, dst: int) -> None:
        """Prefix cache copy-on-write: block src's slots, every layer, into block dst."""
        for c in self.caches:
            c[dst].copy_(c[src])

    def reset_prefix_cache(self) -> None:
        """Drop every unreferenced cached block and zero the hit statistics (e.g. after a warm-up)."""
        self.blocks.clear_cache()
        self.blocks.stats = PrefixCacheStats()

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        self._prepared = None   # a prepared step may hold the aborted sequence
