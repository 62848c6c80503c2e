"""The public facade: tokenizer + chat template + engine."""
from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Sequence as Seq, Union

import torch

from mtp_core.config import LLMConfig, runtime
from mtp_core.engine.engine import Engine
from mtp_core.loader import load_model
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.request.sequence import Sequence
from mtp_core.request.stats import SpecStats
from mtp_core.sampling import SamplingParams
from mtp_core.structured import GrammarBackend
from mtp_core.tokenizer import Tokenizer

log = logging.getLogger("mtp.llm")

Prompt = Union[str, list[int]]


@dataclass
class RequestOutput:
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    stats: SpecStats = field(default_factory=SpecStats)
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    # SamplingParams.logprobs / prompt_logprobs: (id, logprob, [(id, logprob)] top) per token (prompt: None first)
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None


class LLM:
    def __init__(self, config: LLMConfig, load_progress: Optional[Callable[[int, int], None]] = None,
                 iter_log: Optional[Callable[[str], None]] = None) -> None:
        config.validate()
        runtime.configure(config.runtime)     # process-wide switches (kernels, CPU ISA) before the model loads
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.checkpoint = load_model(config.model_dir, config.dtype, config.device, load_progress,
                                                   keep_quantized=config.keep_quantized,
                                                   make_model=DeepseekV3ForCausalLM)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        eos = list(self.tokenizer.eos_token_ids)
        cfg_eos = self.checkpoint.config.eos_token_id
        for e in (cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]):
            if isinstance(e, int) and e not in eos:
                eos.append(e)
        self.engine = Engine(self.model, config, eos, self.tokenizer.think_token_ids(), iter_log=iter_log)
        # structured output: xgrammar over this tokenizer, built on the first guided request
        # (no reference to self: the engine is frozen below, and a cycle through it would keep this LLM alive)
        tok, vocab, rollback = self.tokenizer, self.model.config.vocab_size, self.engine.spec.draft_len + 1
        self.engine.grammar.factory = lambda: GrammarBackend(tok, vocab, eos, rollback,
                                                             tuple(tok.think_token_ids() or ()))
        # everything built so far lives as long as the engine: keep the cyclic GC from re-scanning it on every
        # collection a decode step's small allocations trigger (measured: ~17% of a native decode call's time)
        gc.collect()
        gc.freeze()
        # ... but frozen objects are never collected: when this LLM goes away, unfreeze so that the engine's
        # reference cycles (and with them the weights and KV cache) can be freed by the next collection
        self._unfreeze = weakref.finalize(self, gc.unfreeze)

    def close(self) -> None:
        """Release the engine, the weights and the KV cache now (also what deleting the LLM does, at the next
        garbage collection)."""
        self._unfreeze()
        if self.engine is not None:
            self.engine.close()
        self.engine = self.model = None
        gc.collect()

    # ---- prompts -------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, apply_chat_template: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if not prompt.strip():
            raise ValueError("a prompt is empty; give non-empty text")
        if apply_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)   # the template already has BOS
        return self.tokenizer.encode(prompt)

    def _output(self, prompt: Prompt, seq: Sequence) -> RequestOutput:
        ttft = seq.times.first_token_time - seq.times.arrival_time if seq.times.first_token_time else None
        e2e = seq.times.finish_time - seq.times.arrival_time if seq.times.finish_time else None
        return RequestOutput(prompt if isinstance(prompt, str) else "", seq.prompt_ids, list(seq.output_ids),
                             self.tokenizer.decode(seq.output_ids), seq.finish_reason, seq.stats, ttft, e2e,
                             list(seq.returned.logprobs) if seq.params.logprobs is not None else None,
                             list(seq.returned.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts: Seq[Prompt], params: Union[SamplingParams, Seq[SamplingParams], None] = None,
                 apply_chat_template: bool = False,
                 on_finish: Optional[Callable[[int, RequestOutput], None]] = None) -> list[RequestOutput]:
        """Runs every prompt to completion with in-flight batching; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one or one per prompt")
        seqs = []
        for n, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self.engine.add_request(self.encode_prompt(prompt, apply_chat_template), replace(p)))
            except ValueError as e:
                for s in seqs:
                    self.engine.abort(s)
                raise ValueError(f"prompt [{n}]: {e}") from None
        index = {s.request_id: n for n, s in enumerate(seqs)}
        try:
            while self.engine.has_unfinished():
                for s in self.engine.step():
                    if s.is_finished and on_finish:
                        on_finish(index[s.request_id], self._output(prompts[index[s.request_id]], s))
        except BaseException:
            for s in seqs:
                if not s.is_finished:
                    self.engine.abort(s)
            raise
        return [self._output(p, s) for p, s in zip(prompts, seqs)]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               apply_chat_template: bool = False) -> Iterator[str]:
        """Yields text pieces as they are generated (never splitting a multi-byte character)."""
        seq = self.engine.add_request(self.encode_prompt(prompt, apply_chat_template), replace(params or SamplingParams()))
        decoder = self.tokenizer.stream_decoder()
        sent = 0
        try:
            while not seq.is_finished:
                self.engine.step()
                for tok in seq.output_ids[sent:]:
                    piece = decoder.feed(tok)
                    if piece:
                        yield piece
                sent = len(seq.output_ids)
            tail = decoder.flush()
            if tail:
                yield tail
        finally:
            if not seq.is_finished:
                self.engine.abort(seq)
