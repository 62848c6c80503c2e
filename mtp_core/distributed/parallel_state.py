"""Who holds what across ranks, and the few collectives the sharded model needs.

Sizes follow TensorRT-LLM: the world is `tp_size` ranks; attention, dense MLPs, shared experts,
the embedding and lm_head are split over all of them; the routed experts are split over `ep_size`
expert-parallel groups and, inside a group, each expert's intermediate dimension over
`moe_tp_size = world // ep_size` ranks. One extension: `tp_size == 1` with `ep_size == world`
replicates attention and splits only the experts (the "EP only" layout).

    world 8, tp 8, ep 2 -> moe_tp 4: ranks 0-3 hold experts 0..E/2-1, each rank a quarter of every
                           expert's intermediate columns; ranks 4-7 the other half of the experts.
    world 2, tp 1, ep 2 -> attention replicated, rank 0 holds experts 0..E/2-1, rank 1 the rest.

Every collective runs over the whole world (one process group), so one all-reduce after the MoE
sums the expert-parallel and the expert-tensor-parallel partial results at once. At world size 1
every collective returns its input unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


def check_parallel_sizes(world_size: int, tp_size: int, ep_size: int) -> None:
    """ValueError unless (world, tp, ep) is a layout this engine runs."""
    for flag, v in (("--tp_size", tp_size), ("--moe_ep_size", ep_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if world_size != max(tp_size, ep_size):
        raise ValueError(f"{world_size} process(es) are running but --tp_size {tp_size} / --moe_ep_size {ep_size} "
                         f"need {max(tp_size, ep_size)}; launch with `torchrun --nproc_per_node "
                         f"{max(tp_size, ep_size)} ...` (one process per rank)")
    if tp_size not in (1, world_size):
        raise ValueError(f"--tp_size {tp_size} must be 1 or the number of processes ({world_size})")
    if world_size % ep_size:
        raise ValueError(f"--moe_ep_size {ep_size} must divide the number of processes ({world_size})")


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when `total` items are cut into `parts` contiguous pieces of
    ceil(total / parts) (the last piece may be shorter, even empty): split_range(10, 4, 3) == (9, 10)."""
    chunk = -(-total // parts)
    return min(index * chunk, total), min((index + 1) * chunk, total)


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    device: str = "cpu"
    group: Optional[Any] = None          # a torch.distributed ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        check_parallel_sizes(self.world_size, self.tp_size, self.ep_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")

    # ---- derived ranks -------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp_size > 1 else 0

    @property
    def moe_tp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def is_output_rank(self) -> bool:
        """Rank 0 decides (verification, drafts) and is the only one that prints."""
        return self.rank == 0

    # ---- collectives (no-ops at world size 1) --------------------------------------------
    @torch.no_grad()
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over every rank, in place; returns x."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    @torch.no_grad()
    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] (the same n on every rank) -> [..., world * n], rank 0's columns first."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def broadcast_token_lists(self, lists: list[list[int]], max_len: int) -> list[list[int]]:
        """Rank 0's lists (each at most max_len ids) on every rank. Every rank passes the same
        number of lists; one broadcast of a [len(lists), 1 + max_len] int64 tensor (count, ids)."""
        if self.world_size == 1 or not lists:
            return lists
        buf = torch.zeros(len(lists), 1 + max_len, dtype=torch.long)
        if self.rank == 0:
            for i, ids in enumerate(lists):
                assert len(ids) <= max_len, f"list {i} holds {len(ids)} ids, more than {max_len}"
                buf[i, 0] = len(ids)
                buf[i, 1:1 + len(ids)] = torch.tensor(ids, dtype=torch.long)
        buf = buf.to(self.device)
        dist.broadcast(buf, src=0, group=self.group)
        rows = buf.cpu().tolist()
        return [row[1:1 + row[0]] for row in rows]

    @torch.no_grad()
    def min_int(self, value: int) -> int:
        """The smallest of every rank's value."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def raise_if_any_failed(self, error: Optional[BaseException]) -> None:
        """Collective: every rank passes its own error (or None). If any rank failed, every rank
        raises a ValueError naming the first failed rank and its message; nobody is left waiting."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        mine = None if error is None else (str(error).splitlines()[0] if str(error) else type(error).__name__)
        messages: list[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(messages, mine, group=self.group)
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            r, m = failed[0]
            raise ValueError(f"rank {r} of {self.world_size} failed: {m}") from error
