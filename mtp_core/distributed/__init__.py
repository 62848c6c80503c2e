"""Tensor-parallel attention and expert-parallel MoE over torch.distributed (see docs/distributed.md).

At world size 1 nothing here is used: `make_llm` returns a plain LLM and every collective of
`ParallelState` returns its input.
"""
from mtp_core.distributed.parallel_state import ParallelState, check_parallel_sizes, split_range
from mtp_core.distributed.shard import check_model_shardable, collect_shards, shard_model


def __getattr__(name: str):
    # The loader / engine / launcher pull in the whole engine; import them only when asked.
    if name == "load_model_sharded":
        from mtp_core.distributed.loader import load_model_sharded
        return load_model_sharded
    if name in ("DistributedEngine", "BroadcastDrafter"):
        from mtp_core.distributed import engine
        return getattr(engine, name)
    if name in ("make_llm", "init_parallel", "DistributedLLM", "is_output_rank", "shutdown_parallel"):
        from mtp_core.distributed import launch
        return getattr(launch, name)
    raise AttributeError(name)


__all__ = ["ParallelState", "check_parallel_sizes", "split_range", "check_model_shardable", "collect_shards",
           "shard_model", "load_model_sharded", "DistributedEngine", "BroadcastDrafter", "make_llm",
           "init_parallel", "DistributedLLM", "is_output_rank", "shutdown_parallel"]
