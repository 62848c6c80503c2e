"""BlockManager: hand tables for reserve / rewind / free, and a hypothesis state machine that drives it
through simulated MTP request lifecycles (prefill with overshoot, decode reservations of 2K slots,
random acceptance, rewind, preemption, finish) and checks after every operation that no block leaks
and none is owned twice."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mtp_core.kv_cache.block_manager import BlockManager

torch.set_num_threads(1)


@pytest.mark.parametrize("tokens,blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (17, 5)])
def test_blocks_for(tokens, blocks):
    assert BlockManager(8, 4).blocks_for(tokens) == blocks


def test_reserve_rewind_free_table():
    bm = BlockManager(6, 4)
    t: list[int] = []
    bm.reserve(t, 10)                  # positions 0..9 -> 3 blocks, taken in free-list order
    assert t == [0, 1, 2] and bm.num_free_blocks == 3 and bm.ref_counts[:4] == [1, 1, 1, 0]
    bm.reserve(t, 12)                  # still 3 blocks
    assert t == [0, 1, 2]
    bm.reserve(t, 13)
    assert t == [0, 1, 2, 3] and bm.num_free_blocks == 2
    bm.rewind(t, 9)                    # keep ceil(9/4) = 3 blocks; block 3 back to the pool's tail
    assert t == [0, 1, 2] and list(bm.free_blocks) == [4, 5, 3]
    bm.rewind(t, 8)
    assert t == [0, 1]
    bm.rewind(t, 8)                    # idempotent
    assert t == [0, 1] and bm.num_free_blocks == 4
    u: list[int] = []
    bm.reserve(u, 5)                   # reuses freed blocks
    assert u == [4, 5]
    bm.free(t)
    bm.free(u)
    assert t == [] and u == [] and bm.num_free_blocks == 6 and bm.ref_counts == [0] * 6


def test_can_reserve_and_exhaustion():
    bm = BlockManager(3, 4)
    t: list[int] = []
    assert bm.can_reserve(t, 12) and not bm.can_reserve(t, 13)
    bm.reserve(t, 8)
    assert bm.can_reserve(t, 12) and not bm.can_reserve(t, 13)
    with pytest.raises(MemoryError, match="need 2 blocks, 1 free"):
        bm.reserve(t, 16)
    assert t == [0, 1] and bm.num_free_blocks == 1          # a failed reserve changes nothing


def test_double_free_is_detected():
    bm = BlockManager(4, 2)
    t: list[int] = []
    bm.reserve(t, 4)
    alias = list(t)
    bm.free(t)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(alias)


def test_no_blocks_is_refused():
    with pytest.raises(ValueError):
        BlockManager(0, 4)


# ---- state machine ---------------------------------------------------------------------------

class Lifecycle(RuleBasedStateMachine):
    """Each simulated request: prompt length L, draft length K (0 = no MTP).
    prefill   reserve L + max(K-1, 0) (Eagle's overshoot), then rewind to num_cached = L
    decode    reserve num_cached + 2K (K+1 verified + K-1 overshoot), accept a in 0..K, num_cached += a+1,
              rewind to num_cached; when the pool is dry the request is preempted (freed)
    finish / preempt   free the table"""

    @initialize(num_blocks=st.integers(1, 24), tpb=st.sampled_from([1, 2, 3, 4, 8]))
    def setup(self, num_blocks, tpb):
        self.bm = BlockManager(num_blocks, tpb)
        self.seqs: dict[int, dict] = {}
        self.next_id = 0

    @rule(L=st.integers(1, 20), K=st.integers(0, 4))
    def admit(self, L, K):
        table: list[int] = []
        end = L + max(K - 1, 0)
        if not self.bm.can_reserve(table, end):
            with pytest.raises(MemoryError):
                self.bm.reserve(table, end)
            assert table == []
            return
        self.bm.reserve(table, end)
        assert len(table) == self.bm.blocks_for(end)
        self.bm.rewind(table, L)
        self.seqs[self.next_id] = {"table": table, "cached": L, "K": K}
        self.next_id += 1

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def decode(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        K = s["K"]
        end = s["cached"] + 2 * K + (1 if K == 0 else 0)
        if not self.bm.can_reserve(s["table"], end):
            self.bm.free(s["table"])                            # preempted
            del self.seqs[sid]
            return
        self.bm.reserve(s["table"], end)
        assert len(s["table"]) == self.bm.blocks_for(end)
        a = data.draw(st.integers(0, K))
        s["cached"] += a + 1
        self.bm.rewind(s["table"], s["cached"])

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(self.seqs.pop(sid)["table"])

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        held = [b for s in self.seqs.values() for b in s["table"]]
        free = list(self.bm.free_blocks)
        assert len(held) == len(set(held)), "a block is owned twice"
        assert not set(held) & set(free), "a held block is on the free list"
        assert sorted(held + free) == list(range(self.bm.num_blocks)), "a block leaked"
        assert self.bm.num_free_blocks == len(free)
        for b in range(self.bm.num_blocks):
            assert self.bm.ref_counts[b] == (1 if b in set(held) else 0)
        for s in self.seqs.values():
            assert len(s["table"]) == self.bm.blocks_for(s["cached"])

    def teardown(self):
        if hasattr(self, "bm"):
            for s in self.seqs.values():
                self.bm.free(s["table"])
            assert self.bm.num_free_blocks == self.bm.num_blocks


Lifecycle.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLifecycle = Lifecycle.TestCase
