"""Prefix caching (KV block reuse): exact with and without MTP.

Ground truth is the greedy nextn=0 run of one request alone (`conftest.reference`). Every test checks, after
every engine step, that each running request's caches (main and every MTP module) equal a fresh prefill of
its tokens (`_check_caches`), that no registered block is ever written while it stays registered, and at the
end that the pool is whole again (free + cached-and-unreferenced = every block, no reference left).
"""
from __future__ import annotations

import pytest
import torch

from conftest import greedy, make_engine, reference
from mtp_core.engine.engine import Engine
from mtp_core.kv_cache.block_manager import BlockManager
from mtp_core.kv_cache.prefix_cache import PrefixCacheStats, ReusePolicy, extend_digests
from test_mtp_decoding import _check_caches

torch.set_num_threads(1)

B = 4                                   # tokens per block in these tests
TAIL_A = [300, 12, 77, 401, 89]
TAIL_B = [150, 151, 152, 153, 154, 155]
BASE = [9, 99, 199, 299, 399, 499, 19, 29, 39, 49, 59, 69, 79, 89, 109, 119, 129, 139, 149, 169, 179, 189]


class Watch:
    """Snapshots every registered block; a registered block must keep its contents (every layer) until it
    is evicted (then its key leaves key_of)."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.seen = eng, {}

    def check(self) -> None:
        bm = self.eng.blocks
        for b in list(self.seen):
            if bm.key_of.get(b) != self.seen[b][0]:
                del self.seen[b]
        for b, key in bm.key_of.items():
            data = torch.stack([c[b] for c in self.eng.caches])
            if b in self.seen:
                assert torch.equal(self.seen[b][1], data), f"registered block {b} was written"
            else:
                self.seen[b] = (key, data.clone())


def assert_pool_whole(eng: Engine) -> None:
    bm = eng.blocks
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted([*bm.free_blocks, *bm.lru]) == list(range(bm.num_blocks))
    assert all(c == 0 for c in bm.ref_counts)
    assert set(bm.lru) == set(bm.key_of)


def drive(eng: Engine, model, mode: str, K: int, arrivals: dict[int, list[tuple[list[int], int]]],
          check_every_step: bool = True) -> list:
    """Steps the engine to the end; arrivals[step] = [(prompt, max_tokens)] added before that step.
    Checks the caches of every running request and the registered blocks after every step."""
    watch = Watch(eng)
    seqs = []
    step = 0
    while eng.has_unfinished() or any(s >= step for s in arrivals):
        for prompt, n in arrivals.get(step, []):
            seqs.append((prompt, n, eng.add_request(prompt, greedy(n))))
        if eng.has_unfinished():
            eng.step()
            watch.check()
            if check_every_step:
                _check_caches(model, eng, [s for _, _, s in seqs], mode, K)
        step += 1
    for prompt, n, s in seqs:
        assert s.output_ids == reference(model, prompt, n), f"prompt of {len(prompt)} tokens"
    assert_pool_whole(eng)
    return [s for _, _, s in seqs]


SHARED = [0, B - 1, B, B + 1, 5 * B + 2]
MODES = [("tiny1", "eagle", k) for k in (1, 2, 3)] + [("tiny3", "vanilla", k) for k in (1, 2, 3)] \
    + [("tiny1", "vanilla", 0)]       # vanilla/0 = no MTP (nextn=0)


@pytest.mark.parametrize("ckpt,mode,K", MODES)
@pytest.mark.parametrize("shared", SHARED)
def test_second_request_reuses_the_shared_prefix(models, ckpt, mode, K, shared):
    """Batch 1: the owner runs to the end, then a request sharing `shared` tokens with it arrives."""
    model = models[ckpt]
    prefix = BASE[:shared]
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=B, max_batch_size=1)
    first, second = prefix + TAIL_A, prefix + TAIL_B
    drive(eng, model, mode, K, {0: [(first, 9)], 1: [(second, 9)]})
    st = eng.blocks.stats
    full = shared // B
    assert st.hit_blocks == full
    # reused = the full shared blocks; with MTP caches a block that ends the shared part is a boundary
    # (the tokens after it differ) and its last position is recomputed
    assert st.reused_tokens == full * B - (1 if K and full and shared == full * B else 0)


@pytest.mark.parametrize("ckpt,mode,K", MODES)
def test_multi_turn_reuses_prompt_and_output(models, ckpt, mode, K):
    """The next turn resends prompt + output + a new message: every full block of it hits."""
    model = models[ckpt]
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=B, max_batch_size=1)
    first = BASE[:10]
    s1 = drive(eng, model, mode, K, {0: [(first, 12)]}, check_every_step=False)[0]
    turn2 = first + s1.output_ids + [71, 46, 75]
    hits_before = eng.blocks.stats.reused_tokens
    drive(eng, model, mode, K, {0: [(turn2, 6)]})
    reused = eng.blocks.stats.reused_tokens - hits_before
    # the first request's last step emitted at most K+1 tokens; every block below where it began is cached
    assert reused >= (len(first) + len(s1.output_ids) - K - 2) // B * B and reused % B == 0
    # the prompt ends exactly at a block boundary: the last position is recomputed (Vanilla: its last K)
    same = first + s1.output_ids[:(len(first) + 8) // B * B - len(first)]
    assert len(same) % B == 0
    hits_before = eng.blocks.stats.reused_tokens
    drive(eng, model, mode, K, {0: [(same, 4)]})
    assert eng.blocks.stats.reused_tokens - hits_before == len(same) - (K if mode == "vanilla" and K else 1)


def test_a_request_that_ends_in_its_prefill_step_shares_its_prompt(models):
    """max_tokens 1 (a prefill-only request: scoring, classification): the step that finishes it registers the
    blocks it wrote (before, the engine finished it before counting that step's positions, so nothing was
    registered and the same prompt was computed again). Without MTP: every full block of the prompt hits."""
    model = models["tiny1"]
    eng = make_engine(model, nextn=0, mode="vanilla", tokens_per_block=B, max_batch_size=1)
    prompt = BASE[:10]
    drive(eng, model, "vanilla", 0, {0: [(prompt, 1)]})
    drive(eng, model, "vanilla", 0, {0: [(prompt, 1)]})
    assert eng.blocks.stats.hit_blocks == len(prompt) // B and eng.blocks.stats.reused_tokens == len(prompt) // B * B


@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 2), ("tiny3", "vanilla", 3), ("tiny1", "vanilla", 0)])
@pytest.mark.parametrize("overlap", [False, True])
def test_batch_of_eight_arriving_while_the_owner_runs(models, ckpt, mode, K, overlap):
    """Batch 8: requests sharing prefixes of every length arrive at steps 0..5 while earlier ones (the
    owners of the cached blocks) still run; also with chunked prefill."""
    model = models[ckpt]
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=B, max_batch_size=8,
                      enable_chunked_prefill=True, max_num_tokens=12, disable_overlap_scheduler=not overlap)
    arrivals = {0: [(BASE[:17] + TAIL_A, 14)],
                2: [(BASE[:17] + TAIL_B, 10), (BASE[:4] + TAIL_A, 12)],
                3: [(BASE[:8] + [71], 10), (BASE[:17] + TAIL_A[:2], 8)],
                5: [(BASE[:20], 9), (BASE[:3] + TAIL_B, 11), (BASE[:17] + TAIL_A + [46], 7)]}
    drive(eng, model, mode, K, arrivals)
    # every full block a later request shares with an earlier one is found: 4+1 + 2+4 + 4+0+5
    assert eng.blocks.stats.hit_blocks == 20


@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 3), ("tiny3", "vanilla", 2), ("tiny1", "vanilla", 0)])
def test_preemption_and_eviction_under_a_small_pool(models, ckpt, mode, K):
    """A pool of 14 blocks of 4: requests preempt each other (and find their own blocks again when
    re-admitted) and new contents evict cached blocks; outputs stay exact."""
    model = models[ckpt]
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=B, max_tokens_kv=14 * B, max_batch_size=4)
    arrivals = {0: [(BASE[:13] + TAIL_A, 16), (BASE[:13] + TAIL_B, 16)],
                1: [(BASE[:9] + [71, 72], 14), (TAIL_B + BASE[:6], 12)],
                6: [(BASE[:13] + TAIL_A, 8), ([480, 40, 460, 60, 440] * 3, 10)]}
    drive(eng, model, mode, K, arrivals)
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.stats.evicted_blocks > 0
    assert eng.blocks.stats.hit_blocks > 0


@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 2), ("tiny3", "vanilla", 3)])
def test_reuse_off_equals_reuse_on(models, ckpt, mode, K):
    """The same workload with reuse off: no block is ever registered, the same text; with reuse on fewer
    tokens are computed."""
    model = models[ckpt]
    work = {0: [(BASE[:13] + TAIL_A, 10)], 1: [(BASE[:13] + TAIL_B, 10), (BASE[:9] + [71], 10)]}
    outs = []
    for reuse in (False, True):
        eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=B)
        eng.blocks.enable_reuse = reuse
        outs.append([s.output_ids for s in drive(eng, model, mode, K, work, check_every_step=False)])
        assert (eng.blocks.num_cached_blocks > 0) == reuse and (eng.blocks.stats.reused_tokens > 0) == reuse
    assert outs[0] == outs[1]


def test_abort_and_failed_step_release_every_block(tiny1_model):
    eng = make_engine(tiny1_model, nextn=2, mode="eagle", tokens_per_block=B)
    a = eng.add_request(BASE[:13] + TAIL_A, greedy(20))
    eng.step()
    eng.step()
    b = eng.add_request(BASE[:13] + TAIL_B, greedy(20))
    eng.step()
    assert eng.blocks.stats.hit_blocks == 3
    shared = set(a.kv.block_table) & set(b.kv.block_table)
    assert len(shared) == 3 and all(eng.blocks.ref_counts[x] == 2 for x in shared)
    eng.abort(a)
    assert all(eng.blocks.ref_counts[x] == 1 for x in shared)
    # a step that fails finishes its requests without registering their (possibly half-written) blocks
    registered = dict(eng.blocks.key_of)

    def boom(_rows):
        raise RuntimeError("drafter failed")
    eng.spec.drafter.propose = boom
    with pytest.raises(RuntimeError, match="drafter failed"):
        eng.step()
    assert b.is_finished and b.finish_reason == "abort"
    assert eng.blocks.key_of == registered
    assert_pool_whole(eng)


# ---- the block manager alone -----------------------------------------------------------------

def _digests(tokens: list[int], tpb: int) -> list[bytes]:
    return extend_digests([], tokens, tpb)


def test_digests_chain_the_whole_prefix():
    a, b = _digests([1, 2, 3, 4, 5, 6, 7, 8], 4), _digests([1, 2, 3, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]            # same second block, other first
    assert _digests([1, 2, 3, 4, 5, 6, 7], 4) == a[:1]
    d = a[:1]
    assert extend_digests(d, [1, 2, 3, 4, 5, 6, 7, 8], 4) == a          # incremental = from scratch


def test_register_lookup_lru_and_eviction():
    bm = BlockManager(4, 2, enable_reuse=True)
    bm.copy_block = lambda s, d: copies.append((s, d))
    copies: list[tuple[int, int]] = []
    toks = [10, 11, 12, 13, 14]
    t: list[int] = []
    bm.reserve(t, 5)
    assert bm.register(t, toks, _digests(toks, 2), 5, mtp=False) == 2
    assert bm.num_cached_blocks == 2
    bm.free(t)
    assert list(bm.lru) == [1, 0] and list(bm.free_blocks) == [3, 2] and bm.num_free_blocks == 4
    # same 4 tokens then others: both blocks hit, the request computes from position 4
    other = [10, 11, 12, 13, 20, 21]
    hit = bm.lookup(other, _digests(other, 2), mtp=False, min_chunk=1)
    assert hit.blocks == [0, 1] and hit.start == 4 and hit.copy_from == 2
    assert bm.can_map(hit, 7) and not bm.can_map(hit, 9)
    u: list[int] = []
    bm.map_prefix(u, hit)
    assert u == [0, 1] and bm.ref_counts[:2] == [1, 1] and not bm.lru and copies == []
    # the whole prompt cached: the last position is recomputed in a private copy of the last block
    same = [10, 11, 12, 13]
    hit = bm.lookup(same, _digests(same, 2), mtp=False, min_chunk=1)
    assert hit.start == 3 and hit.copy_from == 1
    v: list[int] = []
    bm.map_prefix(v, hit)
    assert v[0] == 0 and v[1] not in (0, 1) and copies == [(1, v[1])] and bm.ref_counts[0] == 2
    bm.free(u)
    bm.free(v)
    # a full pool evicts the least recently used cached block first (free list first)
    w: list[int] = []
    bm.reserve(w, 6)
    assert bm.stats.evicted_blocks == 1 and bm.num_cached_blocks == 1
    bm.reserve(w, 8)
    assert bm.stats.evicted_blocks == 2 and bm.num_cached_blocks == 0 and bm.num_free_blocks == 0
    bm.free(w)
    assert bm.num_free_blocks == 4 and not bm.lru


def test_mtp_keys_hold_the_next_token():
    """With MTP caches a block's key holds the token after it; another next token makes the block a
    boundary (used, copied, last position recomputed) and stops the walk."""
    bm = BlockManager(8, 2, enable_reuse=True)
    bm.copy_block = lambda s, d: None
    owner = [1, 2, 3, 4, 5, 6]
    t: list[int] = []
    bm.reserve(t, 6)
    bm.register(t, owner, _digests(owner, 2), 5, mtp=True)        # block 2 (positions 4, 5) not final
    assert bm.num_cached_blocks == 2
    same_next = [1, 2, 3, 4, 5, 9, 9]
    hit = bm.lookup(same_next, _digests(same_next, 2), mtp=True, min_chunk=1)
    assert hit.blocks == t[:2] and hit.start == 4 and hit.copy_from == 2
    other_next = [1, 2, 3, 4, 7, 9, 9]
    hit = bm.lookup(other_next, _digests(other_next, 2), mtp=True, min_chunk=1)
    assert hit.blocks == t[:2] and hit.start == 3 and hit.copy_from == 1
    other_mid = [1, 2, 8, 4, 5]
    hit = bm.lookup(other_mid, _digests(other_mid, 2), mtp=True, min_chunk=1)
    assert hit.blocks == t[:1] and hit.start == 1 and hit.copy_from == 0
    # Vanilla K=3: at least 3 tokens computed
    hit = bm.lookup(same_next, _digests(same_next, 2), mtp=True, min_chunk=3)
    assert hit.start == 4 and bm.lookup(owner[:5], _digests(owner[:5], 2), mtp=True, min_chunk=3).start == 2
    # the copy registered with its own next token is a second entry for the same tokens
    u: list[int] = []
    bm.map_prefix(u, bm.lookup(other_next, _digests(other_next, 2), mtp=True, min_chunk=1))
    bm.reserve(u, 7)
    bm.register(u, other_next, _digests(other_next, 2), 6, mtp=True)
    assert bm.by_key[(_digests(other_next, 2)[1], 7)] == u[1] and len(bm.by_digest[_digests(owner, 2)[1]]) == 2
    hit = bm.lookup(other_next, _digests(other_next, 2), mtp=True, min_chunk=1)
    assert hit.blocks == [t[0], u[1], u[2]] and hit.start == 6


def test_reuse_policy_per_drafting_mode():
    assert ReusePolicy.for_drafting(None, 0) == ReusePolicy(False, 1, 0)
    assert ReusePolicy.for_drafting("eagle", 3) == ReusePolicy(True, 1, 0)
    assert ReusePolicy.for_drafting("vanilla", 3) == ReusePolicy(True, 3, 2)
    s = PrefixCacheStats()
    assert s.token_hit_rate == 0.0 and s.block_hit_rate == 0.0


# ---- state machine: the block manager under random request lifecycles, with a shadow of every slot ---

from hypothesis import settings, strategies as st                                   # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

GARBAGE = ("garbage",)


class PrefixLifecycle(RuleBasedStateMachine):
    """Requests over a 2-token alphabet (so prefixes collide all the time) go through admit (lookup, map,
    compute the rest), decode steps (K+1 target slots, random acceptance, MTP entries for the newly
    valid positions, K-1 garbage overshoot, Vanilla's window rewrite, rewind), finish, abort, preemption
    (re-admitted later over prompt + output) and eviction pressure. Each slot's shadow records what it
    holds: main = the tokens up to its position, MTP = those plus the next token. Checked: no write ever
    lands in a shared or registered block; every request's valid slots hold its own tokens; every
    registered block holds exactly the content its key names; reference counts and the free / cached /
    held partition are exact; the pool is whole at the end."""

    @initialize(num_blocks=st.integers(3, 16), tpb=st.integers(1, 4), K=st.integers(0, 3),
                vanilla=st.booleans())
    def setup(self, num_blocks, tpb, K, vanilla):
        self.bm = BlockManager(num_blocks, tpb, enable_reuse=True)
        self.K = K
        self.policy = ReusePolicy.for_drafting("vanilla" if vanilla else "eagle", K)
        self.shadow: dict[tuple[int, int], tuple[tuple, tuple]] = {}
        self.bm.copy_block = self._copy
        self.running: dict[int, dict] = {}
        self.waiting: list[list[int]] = []
        self.next_id = 0

    # ---- simulated device ----
    def _copy(self, src: int, dst: int) -> None:
        for o in range(self.bm.tokens_per_block):
            if (src, o) in self.shadow:
                self.shadow[(dst, o)] = self.shadow[(src, o)]

    def _write(self, s: dict, q: int, main: tuple | None, mtp: tuple | None) -> None:
        bs = self.bm.tokens_per_block
        b = s["table"][q // bs]
        assert self.bm.ref_counts[b] == 1, f"write into block {b} shared by {self.bm.ref_counts[b]} tables"
        assert b not in self.bm.key_of, f"write into registered block {b}"
        old = self.shadow.get((b, q % bs), (GARBAGE, GARBAGE))
        self.shadow[(b, q % bs)] = (main if main is not None else old[0], mtp if mtp is not None else old[1])

    def _truth(self, toks: list[int], q: int) -> tuple[tuple, tuple]:
        return tuple(toks[:q + 1]), (tuple(toks[:q + 2]) if self.K else GARBAGE)

    def _settle(self, s: dict, final: bool) -> None:
        valid = s["cached"] - (0 if final else self.policy.write_lag)
        s["settled"] = self.bm.register(s["table"], s["toks"], extend_digests(s["digests"], s["toks"],
                                        self.bm.tokens_per_block), valid, self.policy.mtp, s["settled"])

    # ---- rules ----
    @rule(prompt=st.lists(st.integers(7, 8), min_size=1, max_size=14), out=st.integers(7, 8))
    def add(self, prompt, out):
        self.waiting.append(prompt)
        self._admit(out)

    @precondition(lambda self: bool(getattr(self, "waiting", None)))
    @rule(out=st.integers(7, 8))
    def admit_waiting(self, out):
        self._admit(out)

    def _admit(self, out: int) -> None:
        toks = self.waiting[0]
        L, over = len(toks), max(self.K - 1, 0)
        digests = extend_digests([], toks, self.bm.tokens_per_block)
        hit = self.bm.lookup(toks, digests, self.policy.mtp, self.policy.min_chunk)
        if hit is not None and not self.bm.can_map(hit, L + over):
            hit = None
        if hit is None and not self.bm.can_reserve([], L + over):
            return                                          # stays waiting
        self.waiting.pop(0)
        s = {"toks": list(toks), "table": [], "cached": 0, "settled": 0, "digests": digests}
        if hit is not None:
            self.bm.map_prefix(s["table"], hit)
            s["settled"] = hit.copy_from
            self.bm.stats.record(L, len(digests), hit)
        start = hit.start if hit else 0
        if start:
            assert L - start >= min(self.policy.min_chunk, L)
        self.bm.reserve(s["table"], L + over)
        s["toks"].append(out)                               # the prefill's output token
        for q in range(start, L):
            self._write(s, q, *self._truth(s["toks"], q))
        for q in range(L, L + over):
            self._write(s, q, None, GARBAGE)                # the draft chain's overshoot
        s["cached"] = L
        self.bm.rewind(s["table"], L)
        self._settle(s, final=False)
        self.running[self.next_id] = s
        self.next_id += 1

    @precondition(lambda self: bool(getattr(self, "running", None)))
    @rule(data=st.data())
    def decode(self, data):
        sid = data.draw(st.sampled_from(sorted(self.running)))
        s, K = self.running[sid], self.K
        V0 = s["cached"]
        end = V0 + K + 1 + max(K - 1, 0)
        if not self.bm.can_reserve(s["table"], end):
            self._preempt(sid)
            return
        self.bm.reserve(s["table"], end)
        a = data.draw(st.integers(0, K))
        s["toks"] += data.draw(st.lists(st.integers(7, 8), min_size=a + 1, max_size=a + 1))
        V = V0 + a + 1
        lo = max(min(V - K, V0), 0) if self.policy.min_chunk > 1 else V0      # Vanilla re-runs its window
        for q in range(lo, V0):
            self._write(s, q, None, self._truth(s["toks"], q)[1])
        for q in range(V0, V0 + K + 1):
            self._write(s, q, *(self._truth(s["toks"], q) if q < V else (GARBAGE, GARBAGE)))
        for q in range(V, V + max(K - 1, 0)):
            self._write(s, q, None, GARBAGE)
        s["cached"] = V
        self.bm.rewind(s["table"], V)
        self._settle(s, final=False)

    def _preempt(self, sid: int) -> None:
        s = self.running.pop(sid)
        self._settle(s, final=True)
        self.bm.free(s["table"])
        self.waiting.insert(0, s["toks"][:-1])              # recompute over prompt + output (the last is redrawn)

    @precondition(lambda self: bool(getattr(self, "running", None)))
    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data, abort):
        s = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        if not abort:
            self._settle(s, final=True)
        self.bm.free(s["table"])

    @precondition(lambda self: bool(getattr(self, "running", None)))
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(sorted(self.running))))

    @rule(n=st.integers(1, 16))
    def pressure(self, n):
        """Another user of the pool takes up to n blocks (evicting cached ones) and gives them back."""
        t: list[int] = []
        n = min(n, self.bm.num_free_blocks) * self.bm.tokens_per_block if hasattr(self, "bm") else 0
        if n:
            self.bm.reserve(t, n)
            for b in t:
                for o in range(self.bm.tokens_per_block):
                    self.shadow[(b, o)] = (GARBAGE, GARBAGE)
            self.bm.free(t)

    # ---- invariants ----
    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        bm, bs = self.bm, self.bm.tokens_per_block
        held: dict[int, int] = {}
        for s in self.running.values():
            for b in s["table"]:
                held[b] = held.get(b, 0) + 1
        free, lru = list(bm.free_blocks), list(bm.lru)
        assert sorted(free + lru + list(held)) == list(range(bm.num_blocks)), "a block leaked or is in two places"
        assert all(bm.ref_counts[b] == held.get(b, 0) for b in range(bm.num_blocks))
        assert set(lru) == {b for b in bm.key_of if b not in held}
        assert bm.num_free_blocks == len(free) + len(lru)
        for s in self.running.values():
            for q in range(s["cached"]):
                got = self.shadow.get((s["table"][q // bs], q % bs))
                assert got == self._truth(s["toks"], q), f"position {q} holds {got}"
        for b, (digest, nxt) in bm.key_of.items():
            main, mtp = self.shadow[(b, bs - 1)]
            assert extend_digests([], list(main), bs)[-1] == digest, f"block {b} holds other tokens"
            assert (nxt is None) == (not self.policy.mtp)
            if self.policy.mtp:
                assert mtp == main + (nxt,), f"block {b}'s last MTP entry is for another next token"
            for o in range(bs):
                assert self.shadow[(b, o)][0] == main[:len(main) - bs + 1 + o]
                if self.policy.mtp and o < bs - 1:
                    assert self.shadow[(b, o)][1] == main[:len(main) - bs + 2 + o]

    def teardown(self):
        if hasattr(self, "bm"):
            for s in self.running.values():
                self.bm.free(s["table"])
            assert self.bm.num_free_blocks == self.bm.num_blocks
            assert all(c == 0 for c in self.bm.ref_counts)


PrefixLifecycle.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestPrefixLifecycle = PrefixLifecycle.TestCase


# ---- configuration, statistics, datasets ---------------------------------------------------------

def test_flag_and_yaml_key_turn_reuse_off(tmp_path, tiny1_model):
    from cli.common import build_llm_config

    p = {"model_dir": "x"}             # every other flag absent: its default
    assert build_llm_config(p, {}).kv_cache_config.enable_block_reuse is True          # default on
    assert build_llm_config({**p, "disable_kv_cache_reuse": True}, {}).kv_cache_config.enable_block_reuse is False
    y = tmp_path / "o.yml"
    y.write_text("kv_cache_config:\n  enable_block_reuse: false\n")
    notes: list[str] = []
    cfg = build_llm_config({**p, "extra_llm_api_options": y}, {}, notes.append)
    assert cfg.kv_cache_config.enable_block_reuse is False and not any("no effect" in n for n in notes)
    y.write_text("kv_cache_config:\n  enable_block_reuse: true\n")
    cfg = build_llm_config({**p, "extra_llm_api_options": y, "disable_kv_cache_reuse": True},
                           {"disable_kv_cache_reuse": True}, notes.append)
    assert cfg.kv_cache_config.enable_block_reuse is True
    assert any("overrides --disable_kv_cache_reuse" in n for n in notes)
    # the engine honours it: nothing is registered, nothing reused
    from mtp_core.config import KvCacheConfig
    from conftest import llm_config
    c = llm_config(nextn=1, mode="eagle", tokens_per_block=B)
    c.kv_cache_config = KvCacheConfig(max_tokens=4096, tokens_per_block=B, enable_block_reuse=False)
    eng = Engine(tiny1_model, c, [2], None)
    drive(eng, tiny1_model, "eagle", 1, {0: [(BASE[:13], 5)], 1: [(BASE[:13], 5)]}, check_every_step=False)
    assert eng.blocks.num_cached_blocks == 0 and eng.blocks.stats.reused_tokens == 0


def test_summary_line_and_reset(tiny1_model):
    eng = make_engine(tiny1_model, nextn=1, mode="eagle", tokens_per_block=B, max_batch_size=1)
    drive(eng, tiny1_model, "eagle", 1, {0: [(BASE[:13], 5)], 1: [(BASE[:13] + [71], 5)]}, check_every_step=False)
    st = eng.blocks.stats
    assert (st.prompt_tokens, st.reused_tokens, st.queried_blocks, st.hit_blocks) == (27, 12, 6, 3)
    assert st.summary_line() == "prefix cache: 12 of 27 prompt tokens reused (44.4%), 3 of 6 full blocks hit (50.0%)"
    assert st.as_dict()["token_hit_rate"] == pytest.approx(12 / 27)
    eng.reset_prefix_cache()
    assert eng.blocks.num_cached_blocks == 0 and eng.blocks.stats.lookups == 0
    assert sorted(eng.blocks.free_blocks) == list(range(eng.blocks.num_blocks))


def test_shared_prefix_dataset(tiny1_dir):
    from mtp_core.bench.dataset import BenchRequest, shared_prefix_ids, synthetic_requests, with_shared_prefix
    from mtp_core.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny1_dir)
    allowed = list(range(10, 200))
    reqs = with_shared_prefix(synthetic_requests(4, 5, 3, 200, frozenset(range(10)), seed=1),
                              shared_prefix_ids(7, tok, allowed, seed=0), tok)
    assert all(len(r.input_ids) == 12 and r.input_ids[:7] == reqs[0].input_ids[:7] for r in reqs)
    assert len({tuple(r.input_ids[7:]) for r in reqs}) == 4 and reqs[0].extra["shared_prefix"] == 7
    prefix = shared_prefix_ids(20, tok)
    assert len(prefix) == 20 and (tok.bos_token_id is None or prefix[0] == tok.bos_token_id)
    text = with_shared_prefix([BenchRequest("a", 3, prompt="hello there")], prefix, tok)[0]
    own = tok.encode("hello there", add_special_tokens=True)
    assert text.input_ids[:20] == prefix and text.input_ids[20:] == [t for t in own if t != tok.bos_token_id][
        -(len(text.input_ids) - 20):]
    with pytest.raises(ValueError, match="shared_prefix"):
        shared_prefix_ids(0, tok)
