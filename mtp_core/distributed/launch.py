"""Starting a parallel run: one process per rank (torchrun), each building its shard of the LLM.

    torchrun --nproc_per_node 2 -m cli quickstart --tp_size 2 --moe_ep_size 2 --model_dir DIR

`make_llm(config)` is the single entry point: a plain `LLM` when one process runs with
tp_size == moe_ep_size == 1, else a `DistributedLLM` after joining the process group that torchrun
describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Every
collective has a timeout (MTP_DIST_TIMEOUT_S, default 1800 s) so a dead rank never hangs the rest,
and a rank that fails to load makes every rank raise the same ValueError.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
from dataclasses import replace
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mtp_core.config import LLMConfig, runtime
from mtp_core.distributed.engine import DistributedEngine
from mtp_core.distributed.loader import load_model_sharded
from mtp_core.distributed.parallel_state import ParallelState, check_parallel_sizes
from mtp_core.llm import LLM
from mtp_core.tokenizer import Tokenizer

log = logging.getLogger("mtp.distributed")

DEFAULT_TIMEOUT_S = 1800.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; launch with torchrun") from None


def init_parallel(tp_size: int, ep_size: int, device: str = "cpu",
                  timeout_s: Optional[float] = None) -> ParallelState:
    """Join (or reuse) the default process group described by torchrun's environment variables."""
    world = _env_int("WORLD_SIZE", 1)
    if world == 1 and max(tp_size, ep_size) > 1:
        n = max(tp_size, ep_size)
        raise ValueError(f"--tp_size {tp_size} / --moe_ep_size {ep_size} need {n} processes, but this is a single "
                         f"process; launch with `torchrun --nproc_per_node {n} -m cli quickstart ...`")
    check_parallel_sizes(world, tp_size, ep_size)
    rank = _env_int("RANK", 0)
    if device.startswith("cuda"):
        device = f"cuda:{_env_int('LOCAL_RANK', 0)}"
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        # torch._dynamo is imported lazily by the first random init on the meta device (building the
        # model); imported after init_process_group it keeps the default group alive past
        # destroy_process_group, and gloo's worker threads then abort the interpreter at exit
        # ("terminate called without an active exception", about 1 run in 10). Import it first.
        importlib.import_module("torch._dynamo")
        timeout = runtime.dist_timeout_s(DEFAULT_TIMEOUT_S) if timeout_s is None else timeout_s
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        atexit.register(shutdown_parallel)
    elif dist.get_world_size() != world or dist.get_rank() != rank:
        raise ValueError("a process group of a different size is already initialised")
    return ParallelState(rank=rank, world_size=world, tp_size=tp_size, ep_size=ep_size, device=device)


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class DistributedLLM(LLM):
    """LLM whose model is this rank's shard and whose engine keeps every rank in lockstep."""

    def __init__(self, config: LLMConfig, par: ParallelState,
                 load_progress: Optional[Callable[[int, int], None]] = None,
                 iter_log: Optional[Callable[[str], None]] = None) -> None:
        config.validate()
        runtime.configure(config.runtime)     # process-wide switches (kernels, CPU ISA) before the model loads
        self.config, self.parallel = config, par
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        error: Optional[BaseException] = None
        try:
            self.model, self.checkpoint = load_model_sharded(
                config.model_dir, config.dtype, config.device, par, load_progress if par.is_output_rank else None,
                keep_quantized=config.keep_quantized)
            self.tokenizer = Tokenizer.from_dir(config.model_dir)
        except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
            error = e
        par.raise_if_any_failed(error)
        eos = list(self.tokenizer.eos_token_ids)
        cfg_eos = self.checkpoint.config.eos_token_id
        for e in (cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]):
            if isinstance(e, int) and e not in eos:
                eos.append(e)
        self.engine = DistributedEngine(self.model, config, eos, par, self.tokenizer.think_token_ids(),
                                        iter_log=iter_log)

    @property
    def is_output_rank(self) -> bool:
        return self.parallel.is_output_rank


def make_llm(config: LLMConfig, load_progress: Optional[Callable[[int, int], None]] = None,
             iter_log: Optional[Callable[[str], None]] = None, timeout_s: Optional[float] = None) -> LLM:
    """The LLM for this process: plain at world size 1 with no parallelism asked, else this rank's shard."""
    tp, ep = config.tensor_parallel_size, config.moe_expert_parallel_size
    if _env_int("WORLD_SIZE", 1) == 1 and tp == 1 and ep == 1:
        return LLM(config, load_progress, iter_log)
    par = init_parallel(tp, ep, config.device, timeout_s)
    if par.device != config.device:
        config = replace(config, device=par.device)
    return DistributedLLM(config, par, load_progress, iter_log)


def is_output_rank(llm: LLM) -> bool:
    """True on the process that prints results (rank 0, or the only process)."""
    return getattr(llm, "is_output_rank", True)
