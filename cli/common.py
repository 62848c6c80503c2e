"""Shared CLI plumbing: logging, flags + YAML -> LLMConfig, exit codes."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Callable

import typer

import mtp_core

DEFAULT_MODEL_DIR = Path(mtp_core.__file__).parent / "assets" / "tiny-r1"
log = logging.getLogger("mtp.cli")


def setup_logging(level: str) -> None:
    lvl = getattr(logging, level.upper(), None)
    if not isinstance(lvl, int):
        fail(f"--log_level must be debug, info, warning or error, got {level!r}", 2)
    logging.basicConfig(level=lvl, stream=sys.stderr, format="[%(levelname)s] %(name)s: %(message)s", force=True)


def fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def build_llm_config(p: dict[str, Any], explicit: dict[str, Any]):
    from mtp_core.config import CudaGraphConfig, KvCacheConfig, LLMConfig, SpeculativeConfig

    model_dir = p["model_dir"]
    if model_dir is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise ValueError(f"no --model_dir given and the shipped model is not installed at {DEFAULT_MODEL_DIR}; "
                             "pass --model_dir (e.g. one written by `mtp make-tiny DIR`)")
        model_dir = DEFAULT_MODEL_DIR
    spec = None
    algo = p["spec_decode_algo"]
    if algo is not None:
        if algo.upper() != "MTP":
            raise ValueError(f"--spec_decode_algo {algo!r} is not supported; use MTP (or omit it for no speculation)")
        spec = SpeculativeConfig(num_nextn_predict_layers=p["spec_decode_max_draft_len"],
                                 use_relaxed_acceptance_for_thinking=p["use_relaxed_acceptance_for_thinking"],
                                 relaxed_topk=p["relaxed_topk"], relaxed_delta=p["relaxed_delta"],
                                 use_mtp_vanilla=p["use_mtp_vanilla"], mtp_mode=p["mtp_mode"].lower())
    cfg = LLMConfig(
        model_dir=str(model_dir), dtype=p["dtype"], max_batch_size=p["max_batch_size"],
        max_num_tokens=p["max_num_tokens"], max_seq_len=p["max_seq_len"], speculative_config=spec,
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=p["kv_cache_fraction"], dtype=p["kv_cache_dtype"]),
        cuda_graph_config=CudaGraphConfig() if p["use_cuda_graph"] else None,
        disable_overlap_scheduler=p["disable_overlap_scheduler"],
        enable_chunked_prefill=p["enable_chunked_prefill"], print_iter_log=p["print_iter_log"],
        tensor_parallel_size=p["tp_size"], keep_quantized=p.get("keep_quantized", False), moe_expert_parallel_size=p["moe_ep_size"],
    )
    if p.get("extra_llm_api_options") is not None:
        from mtp_core.yaml_config import apply_yaml_options, load_yaml_options

        path = p["extra_llm_api_options"]
        opts = load_yaml_options(path)
        try:
            cfg = apply_yaml_options(cfg, opts, explicit, lambda s: print(s, file=sys.stderr))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    cfg.validate()
    check_device_features(cfg)
    return cfg


def check_device_features(cfg) -> None:
    """GPU-only settings are accepted everywhere; on a CPU they are refused with the reason."""
    if cfg.device == "cpu":
        if cfg.kv_cache_config.dtype == "fp8":
            raise ValueError("an FP8 KV cache (--kv_cache_dtype fp8) needs an NVIDIA GPU; this machine has none. "
                             "Use --kv_cache_dtype auto")
        if cfg.cuda_graph_config is not None:
            log.warning("CUDA graphs were requested but this machine has no CUDA device; running eagerly")
            cfg.cuda_graph_config = None
    if cfg.tensor_parallel_size != 1 or cfg.moe_expert_parallel_size != 1:
        raise ValueError("tensor / expert parallelism (--tp_size, --moe_ep_size) is not implemented yet; use 1")


def run_or_exit(fn: Callable[[], None]) -> None:
    try:
        fn()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__, 2)
    except MemoryError as e:
        fail(f"out of memory: {e}", 1)
    except typer.Exit:
        raise
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback
        logging.getLogger("mtp.cli").debug("traceback", exc_info=True)
        fail(f"{type(e).__name__}: {e}", 1)
