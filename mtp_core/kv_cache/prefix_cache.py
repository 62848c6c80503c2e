"""Prefix caching (KV block reuse) helpers: block digests, the lookup result, the drafting-mode policy and
hit statistics. The cache itself lives in BlockManager (it shares the free list and reference counts)."""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Optional

BlockKey = tuple[bytes, Optional[int]]      # (digest of tokens 0..end of the block, token after it or None)


def extend_digests(digests: list[bytes], tokens: list[int], tokens_per_block: int) -> list[bytes]:
    """Appends, in place, the digest of every full block of `tokens` not digested yet. Block j's digest
    covers tokens 0..(j+1)*B-1 (its parent's digest and its own tokens), so equal digests mean equal
    prefixes (BLAKE2b, 128 bits)."""
    B = tokens_per_block
    for j in range(len(digests), len(tokens) // B):
        h = hashlib.blake2b(digests[-1] if digests else b"", digest_size=16)
        h.update(array("q", tokens[j * B:(j + 1) * B]).tobytes())
        digests.append(h.digest())
    return digests


class PrefixRecurrence:
    """Whether prompts in this engine share prefixes: the digest of each admitted prompt's first full block,
    with the request that brought it. A prompt whose first block another request brought before recurs (equal
    digests mean equal prefixes), and from then on `seen` stays true. An engine with MTP caches uses it to
    decide whether a prompt whose MTP forward is deferred still runs it over its full blocks so that they
    can be shared (engine.py, backlog.propose): that forward costs ~8% of a run of ~390-token prompts that
    share nothing (the shipped model, general text), and until some prefix recurs nothing would reuse it."""

    MAX_TRACKED = 1 << 16      # first-block digests remembered; past it the oldest half is dropped

    def __init__(self) -> None:
        self.first: dict[bytes, int] = {}
        self.seen = False

    def note(self, digests: list[bytes], request_id: int) -> None:
        if self.seen or not digests:
            return
        owner = self.first.setdefault(digests[0], request_id)
        if owner != request_id:
            self.seen, self.first = True, {}
        elif len(self.first) > self.MAX_TRACKED:
            for key in list(self.first)[:len(self.first) // 2]:
                del self.first[key]


@dataclass
class PrefixHit:
    blocks: list[int]      # cached blocks for table positions 0..len-1
    start: int             # first position the request computes (everything before it is reused)
    copy_from: int         # table index from which the request gets private copies (it writes there)


@dataclass(frozen=True)
class ReusePolicy:
    """What exact reuse needs from a drafting mode (see docs/architecture.md, "Prefix caching").

    mtp        the pool holds MTP caches: a block's key includes the token after it
    min_chunk  the first computed chunk after a hit is at least this long (Vanilla: K, so that its window
               of the last K positions comes from main hidden states computed in that chunk)
    write_lag  a running request may rewrite this many positions before its valid length (Vanilla
               re-runs its window), so only blocks below num_cached - write_lag are registered while it runs
    """
    mtp: bool = False
    min_chunk: int = 1
    write_lag: int = 0

    @classmethod
    def for_drafting(cls, mode: Optional[str], num_draft_tokens: int) -> "ReusePolicy":
        if not num_draft_tokens:
            return cls()
        if mode == "vanilla":
            return cls(True, num_draft_tokens, max(num_draft_tokens - 1, 0))
        return cls(True, 1, 0)


@dataclass
class PrefixCacheStats:
    lookups: int = 0             # admissions (first admissions and re-admissions after preemption)
    prompt_tokens: int = 0       # tokens those admissions had to prefill without reuse
    reused_tokens: int = 0       # tokens not computed thanks to the cache
    queried_blocks: int = 0      # full blocks of those prompts
    hit_blocks: int = 0          # of them found in the cache (copied ones included)
    copied_blocks: int = 0       # hits copied into a private block (the request writes into them)
    evicted_blocks: int = 0      # cached blocks handed out for new contents

    @property
    def token_hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0

    def record(self, num_tokens: int, num_full_blocks: int, hit: Optional[PrefixHit]) -> None:
        self.lookups += 1
        self.prompt_tokens += num_tokens
        self.queried_blocks += num_full_blocks
        if hit is not None:
            self.reused_tokens += hit.start
            self.hit_blocks += len(hit.blocks)

    def summary_line(self) -> str:
        return (f"prefix cache: {self.reused_tokens} of {self.prompt_tokens} prompt tokens reused "
                f"({100 * self.token_hit_rate:.1f}%), {self.hit_blocks} of {self.queried_blocks} full blocks hit "
                f"({100 * self.block_hit_rate:.1f}%)")

    def as_dict(self) -> dict:
        return {"lookups": self.lookups, "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
                "token_hit_rate": self.token_hit_rate, "queried_blocks": self.queried_blocks,
                "hit_blocks": self.hit_blocks, "block_hit_rate": self.block_hit_rate,
                "copied_blocks": self.copied_blocks, "evicted_blocks": self.evicted_blocks}
