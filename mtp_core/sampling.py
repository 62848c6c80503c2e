"""Sampling parameters and pure sampling functions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # logits processing (see process_logits), applied per position of a verify row
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0               # EOS and stop_token_ids are masked until this many tokens were emitted
    min_p: float = 0.0                # sampling only: drop tokens below min_p x the top probability
    # log-probabilities of the target's raw logits: None = off; N = the emitted token's and the top N
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # structured output (mtp_core/structured.py): (kind, spec), kind json_object | json_schema | regex | choice
    guided: Optional[tuple[str, str]] = None
    guided_after_think: bool = False  # the grammar starts after </think> (a reasoning parser is on), else at once

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        if self.guided is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output (the grammar ends at EOS)")
        for t, b in self.logit_bias.items():
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias must map token ids to values in [-100, 100], got {b} for {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Some logits processing changes the target's choice (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def needs_logits(self) -> bool:
        """The engine must see this request's logits: the native CPU step prepares what they need along the drafts
        (engine/native_step.py), the CUDA-graph step returns only tokens (the general path runs such a batch)."""
        return (self.processes_logits or self.logprobs is not None or self.prompt_logprobs is not None
                or self.guided is not None)


MAX_LOGPROBS = 20                     # OpenAI's top_logprobs limit


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   drafts: list[int], stop_ids: list[int]) -> torch.Tensor:
    """logits [N, V] of one row's positions -> the processed logits [N, V] (float32) the choice is made from.

    Position i continues prompt_ids + output_ids + drafts[:i]: it sees the token counts after the drafts
    before it, exactly what plain decoding sees at that position once those drafts are accepted. In order
    (vLLM's): min_tokens masks EOS and stop_token_ids while fewer than min_tokens are emitted; logit_bias is
    added; the repetition penalty divides a positive logit (multiplies a negative one) of every token seen in
    the prompt or the output; the frequency penalty subtracts count x penalty and the presence penalty
    subtracts the penalty once, over the output tokens.

    Worked example (V = 4, repetition 1 off, frequency 1.0, output [2], drafts [2]): logits [[1, 1, 3, 0],
    [1, 1, 3, 0]] -> position 0 counts {2: 1}: [1, 1, 2, 0]; position 1 counts {2: 2}: [1, 1, 1, 0]."""
    N, V = logits.shape
    x = logits.float().clone()
    p = params
    counts = torch.zeros(V, dtype=torch.float32, device=x.device)
    if output_ids:
        counts += torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=x.device), minlength=V)[:V]
    in_prompt = None
    if p.repetition_penalty != 1.0:
        in_prompt = torch.zeros(V, dtype=torch.bool, device=x.device)
        in_prompt[torch.tensor(prompt_ids, dtype=torch.long, device=x.device)] = True
    bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=x.device) if p.logit_bias else None
    bias_vals = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=x.device) if p.logit_bias \
        else None
    stops = [t for t in stop_ids if 0 <= t < V]
    for i in range(N):
        if i:
            counts[drafts[i - 1]] += 1
        row = x[i]
        if p.min_tokens and len(output_ids) + i < p.min_tokens and stops:
            row[stops] = float("-inf")
        if bias_ids is not None:
            row.index_add_(0, bias_ids, bias_vals)
        if in_prompt is not None:
            seen = in_prompt | (counts > 0)
            row.copy_(torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty),
                                  row))
        if p.frequency_penalty:
            row -= p.frequency_penalty * counts
        if p.presence_penalty:
            row -= p.presence_penalty * (counts > 0).float()
    return x


class PenaltyRules:
    """One request's process_logits as the native step takes it (mtp_step's rule entries, applied by LogitsRules in
    csrc/cpu/mtp_step_cpu.cpp): at each position i of a verify row [t, d_1..d_k], one entry per token that
    process_logits changes there, (token, bias, rep, freq, pres) in float32, such that

        y = bias == -inf ? -inf : x + bias;  y = y > 0 ? y / rep : y * rep;  y = y - freq;  y = y - pres

    is process_logits' value at that token (the same float32 operations in the same order; the sign of a zero
    aside) and every other token keeps its raw logit. bias: logit_bias's value, -inf where min_tokens masks a stop
    token at that position; rep: the repetition penalty for a token seen in the prompt, the output or d_1..d_i,
    else 1; freq: float32(frequency_penalty) x the token's count over the output and d_1..d_i; pres: the presence
    penalty if that count is > 0, else 0. Every position lists the same tokens (the ones any of them touches).

    Worked example (process_logits' docstring; V = 4, frequency 1.0, output [2], drafts [2]): tokens [2] at both
    positions, freq 1.0 then 2.0: logits [1, 1, 3, 0] -> [1, 1, 2, 0] and [1, 1, 1, 0].

    Built once per request; it keeps one entry per token touched so far (logit_bias's, the prompt's with a
    repetition penalty, the output's and the drafts' with any penalty, the stop tokens with min_tokens) and updates
    it as the output grows (`at` is called with the output so far, which only grows, preemption included); a
    position's entries are those, with the counts of the drafts before it added."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], stop_ids: list[int], vocab: int) -> None:
        p = params
        self.min_tokens = p.min_tokens
        self.stops = sorted({t for t in stop_ids if 0 <= t < vocab})
        # as float32 values (process_logits multiplies float32 tensors by them); count x freq is exact in a double
        # (24 + 31 bits at most), so storing it into float32 rounds it once, as a float32 product does
        self.rep, self.freq, self.pres = (float(np.float32(p.repetition_penalty)), float(np.float32(p.frequency_penalty)),
                                          float(np.float32(p.presence_penalty)))
        self.counted = bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)
        self.bias = {t: float(np.float32(b)) for t, b in p.logit_bias.items()}
        self.in_prompt = set(prompt_ids) if p.repetition_penalty != 1.0 else set()
        # the entries so far: logit_bias's tokens, then the prompt's (a repetition penalty), none counted yet
        first = list(self.bias) + sorted(self.in_prompt.difference(self.bias))
        self.index: dict[int, int] = {t: i for i, t in enumerate(first)}   # token -> its entry
        self.counts: list[int] = [0] * len(first)                           # per entry: its count over the output
        size = max(64, 1 << len(first).bit_length())
        self.ids, self.vals = np.empty(size, dtype=np.int64), np.empty((size, 4), dtype=np.float32)
        self.ids[:len(first)] = first
        self.vals[:len(first)] = (0.0, 1.0, 0.0, 0.0)
        self.vals[:len(self.bias), 0] = list(self.bias.values())
        if self.in_prompt:
            self.vals[:len(first), 1] = [self.rep if t in self.in_prompt else 1.0 for t in first]
        self.num_counted = 0

    def _entry(self, t: int, count: int) -> tuple:
        """(bias, rep, freq, pres) of token t after `count` occurrences (process_logits' float32 values)."""
        seen = count > 0 or t in self.in_prompt
        return self.bias.get(t, 0.0), self.rep if seen else 1.0, self.freq * count, self.pres if count > 0 else 0.0

    def _touch(self, t: int) -> int:
        i = self.index.get(t)
        if i is None:
            i = self.index[t] = len(self.counts)
            self.counts.append(0)
            if i == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
                self.vals = np.concatenate([self.vals, np.empty_like(self.vals)])
            self.ids[i] = t
            self.vals[i] = self._entry(t, 0)
        return i

    def at(self, output_ids: list[int], drafts: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """-> (ids [n * u] int64, vals [n * u, 4] float32, u): the entries of the row's n = len(drafts) + 1
        positions in order, u per position."""
        if self.counted:
            for t in output_ids[self.num_counted:]:
                i = self._touch(t)
                self.counts[i] += 1
                self.vals[i] = self._entry(t, self.counts[i])
            for t in drafts:
                self._touch(t)
        self.num_counted = len(output_ids)
        n = len(drafts) + 1
        masked = [i for i in range(n) if len(output_ids) + i < self.min_tokens] if self.stops else []
        for t in self.stops if masked else ():
            self._touch(t)
        u = len(self.counts)
        ids, vals = np.empty((n, u), dtype=np.int64), np.empty((n, u, 4), dtype=np.float32)
        ids[:] = self.ids[:u]
        vals[:] = self.vals[:u]
        ids, vals = ids.reshape(n * u), vals.reshape(n * u, 4)
        if self.counted and drafts:           # position i: the counts of d_1..d_i added
            extra: dict[int, int] = {}
            for i, d in enumerate(drafts, 1):
                extra[d] = extra.get(d, 0) + 1
                for t, e in extra.items():
                    j = self.index[t]
                    vals[i * u + j] = self._entry(t, self.counts[j] + e)
        for i in masked:                      # min_tokens: the stop tokens cannot be chosen here
            for t in self.stops:
                vals[i * u + self.index[t], 0] = -np.inf
        return ids, vals, u


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """logits [>= len(tokens), V] (raw) -> per token: (id, log-probability, the top_n (id, log-probability)),
    position j scoring tokens[j]. Log-softmax in float32; the top ones by value, ties to the lower id."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=lp.device).view(-1, 1)).view(-1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n:
        vals, ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1, sorted=True)
        for j, (v, i) in enumerate(zip(vals.tolist(), ids.tolist())):
            tops[j] = sorted(zip(i, v), key=lambda e: (-e[1], e[0]))
    return [(t, c, top) for t, c, top in zip(tokens, chosen, tops)]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> the request's sampling distribution [N, V] (temperature, top-k, top-p)."""
    x = logits.float() / params.temperature
    if params.min_p > 0:
        p0 = torch.softmax(x, dim=-1)
        x = x.masked_fill(p0 < params.min_p * p0.max(-1, keepdim=True).values, float("-inf"))
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= params.top_p          # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits [N, V] -> tokens [N] for one request (greedy when temperature is 0)."""
    if params.greedy:
        return logits.argmax(-1)
    return torch.multinomial(target_probs(logits, params), 1, generator=generator).squeeze(-1)
