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
    shared = set(a.block_table) & set(b.block_table)
    assert len(shared) == 3 and all(eng.blocks.ref_counts[x] == 2 for x in shared)
    eng.abort(a)
    assert all(eng.blocks.ref_counts[x] == 1 for x in shared)
    # a step that fails finishes its requests without registering their (possibly half-written) blocks
    registered = dict(eng.blocks.key_of)

    def boom(_rows):
        raise RuntimeError("drafter failed")
    eng.drafter.propose = boom
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
