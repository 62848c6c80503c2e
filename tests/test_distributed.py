"""Tensor / expert parallelism: layout arithmetic, per-rank memory, sliced loading (bf16, FP8, NVFP4),
and 2-process gloo runs whose greedy output must equal the single-process output token for token.

The 2-process runs spawn fresh interpreters (torch.multiprocessing "spawn"), join them with a
deadline and kill them past it, so a hang fails the test instead of blocking it; every collective
inside also has a timeout (make_llm(timeout_s=...)).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from conftest import PROMPTS, llm_config
from mtp_core import kernels
from mtp_core.config import CudaGraphConfig, ModelConfig
from mtp_core.distributed import ParallelState, check_parallel_sizes, collect_shards, shard_model, split_range
from mtp_core.distributed.loader import load_model_sharded
from mtp_core.distributed.memory import deepseek_v3_671b_config, rank_memory
from mtp_core.distributed.sharded_read import read_quant_slice
from mtp_core.distributed.layers import Shard
from mtp_core.loader import load_model
from mtp_core.loader.quant import Fp8BlockFormat, Nvfp4Format
from mtp_core.loader.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from mtp_core.loader.quant.linear import Fp8BlockLinear, Nvfp4Linear
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from mtp_core.llm import LLM
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.quantize import quantize_checkpoint
from mtp_core.sampling import SamplingParams

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
BATCH = PROMPTS[:4]
MAX_TOKENS = 12
TIMEOUT_S = 90          # every collective; the whole spawn gets 4x that
LAYOUTS = [(2, 1), (1, 2), (2, 2)]                       # (tp_size, moe_ep_size) on 2 processes
MODES = [(0, "auto"), (2, "eagle"), (3, "vanilla")]     # (nextn, mtp_mode)
LOGIT_IDS = [[71, 46, 75, 300, 12, 77, 401, 89, 9], [150, 151, 152, 153, 154, 155, 156, 157, 158]]


# ---- layout arithmetic -------------------------------------------------------------------------

@pytest.mark.parametrize("world,tp,ep,error", [
    (2, 2, 1, None), (2, 1, 2, None), (2, 2, 2, None), (8, 8, 2, None), (8, 1, 8, None),
    (2, 1, 1, "need 1"), (4, 2, 4, "must be 1 or the number of processes"), (8, 8, 3, "must divide"),
    (2, 0, 1, "positive integer"),
])
def test_parallel_sizes(world, tp, ep, error) -> None:
    if error is None:
        check_parallel_sizes(world, tp, ep)
    else:
        with pytest.raises(ValueError, match=error):
            check_parallel_sizes(world, tp, ep)


def test_rank_layout_tp8_ep2() -> None:
    # ranks 0-3 form expert group 0 (a quarter of each expert's columns each), ranks 4-7 group 1
    got = [(p.tp_rank, p.ep_rank, p.moe_tp_rank) for p in
           (ParallelState(rank=r, world_size=8, tp_size=8, ep_size=2) for r in range(8))]
    assert got == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 1, 0), (5, 1, 1), (6, 1, 2), (7, 1, 3)]
    ep_only = ParallelState(rank=1, world_size=2, tp_size=1, ep_size=2)
    assert (ep_only.tp_rank, ep_only.ep_rank, ep_only.moe_tp_size) == (0, 1, 1)
    assert [split_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_shard_model_needs_meta_and_divisible_sizes(tiny1_model) -> None:
    with pytest.raises(ValueError, match="meta device"):
        shard_model(tiny1_model, ParallelState(rank=0, world_size=2, tp_size=2))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(tiny1_model.config)       # 4 heads, 8 experts
    with pytest.raises(ValueError, match="n_routed_experts = 8 is not divisible by --moe_ep_size = 3"):
        shard_model(model, ParallelState(rank=0, world_size=3, tp_size=1, ep_size=3))


# ---- per-rank memory ---------------------------------------------------------------------------

def _tiny_memory_config() -> ModelConfig:
    return ModelConfig.from_dict({
        "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": 8, "kv_lora_rank": 8,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "intermediate_size": 32,
        "moe_intermediate_size": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "vocab_size": 10, "num_nextn_predict_layers": 1})


def test_rank_memory_tiny_by_hand() -> None:
    m = rank_memory(_tiny_memory_config(), tp_size=2, ep_size=2, weight_format="bf16")
    # layers: 0 dense, 1 MoE, MTP 2 MoE. tp 2 -> 2 heads, qk 6; ep 2 -> 2 experts, moe_tp 1.
    assert m.embedding == m.lm_head == 5 * 16 * 2                   # ceil(10 / 2) rows
    # q_a 8x16 + q_b 12x8 + kv_a 10x16 + kv_b 16x8 + o 16x8 = 640, norms 8 + 8; three layers
    assert m.attention == 3 * (640 + 16) * 2
    assert m.dense_mlp == 3 * 16 * 16 * 2                            # gate, up [16, 16], down [16, 16]
    assert m.routed_experts == 2 * 2 * 3 * 8 * 16 * 2                # 2 layers x 2 experts x 3 [8x16]
    assert m.shared_experts == 2 * 3 * 4 * 16 * 2                    # intermediate 8 / tp 2
    assert m.router == 2 * (4 * 16 + 4) * 4                          # float32
    assert m.other == (7 * 16 + 3 * 16 + 16 * 32) * 2                # 6 layer norms + final, MTP norms, eh_proj
    assert m.kv_cache_per_token == (8 + 2) * 3 * 2
    assert m.weights == 11520
    fp8 = rank_memory(_tiny_memory_config(), tp_size=2, ep_size=2, weight_format="fp8")
    assert fp8.attention == 3 * (640 + 5 * 4 + 16 * 2)              # 1 byte each, one 4-byte scale per linear
    assert fp8.routed_experts == 2 * 2 * 3 * (8 * 16 + 4)


def test_rank_memory_counts_what_shard_model_holds() -> None:
    cfg = _tiny_memory_config()
    for tp, ep in LAYOUTS + [(1, 1)]:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(cfg)
        shard_model(model, ParallelState(rank=1 % max(tp, ep), world_size=max(tp, ep), tp_size=tp, ep_size=ep))
        n_router = sum(p.numel() for n, p in model.state_dict().items() if ".mlp.gate." in n)
        n_all = sum(p.numel() for p in model.state_dict().values())
        assert rank_memory(cfg, tp, ep, "bf16").weights == 2 * n_all + 2 * n_router, (tp, ep)


def test_rank_memory_deepseek_v3_attention_tp8_fp8() -> None:
    cfg = deepseek_v3_671b_config()
    # per layer at tp 8, FP8 (weights + 4 bytes per 128x128 block) and bf16 norms:
    per_layer = ((576 * 7168 + 5 * 56 * 4) + 512 * 2 + (4096 * 512 + 32 * 4 * 4) + (7168 * 2048 + 56 * 16 * 4)
                 + (1536 * 7168 + 12 * 56 * 4) + 1536 * 2 + (3072 * 1536 + 24 * 12 * 4))
    for ep in (8, 2):
        m = rank_memory(cfg, 8, ep, "fp8")
        assert m.attention == 62 * per_layer == 2_272_162_112
        assert m.routed_experts == 59 * 32 * 3 * (2048 * 7168 + 16 * 56 * 4)    # 1/8 of the experts' weights
    assert rank_memory(cfg, 8, 8, "fp8").kv_cache_per_token == 576 * 62 * 2


# ---- sliced reads of quantized weights ---------------------------------------------------------

def _opener(path: Path):
    from safetensors import safe_open
    f = safe_open(str(path), framework="pt")
    return lambda name: f


def test_fp8_slices_on_and_off_the_block_grid(tmp_path: Path) -> None:
    w, s = quantize_fp8_block(torch.randn(300, 256))                       # scales [3, 2]
    save_file({"x.weight": w, "x.weight_scale_inv": s}, str(tmp_path / "m.safetensors"))
    full = dequantize_fp8_block(w, s)
    fmt, names = Fp8BlockFormat(), ["x.weight", "x.weight_scale_inv"]
    for shard, read, narrow in [(Shard(0, 128, 256), (128, 256), None), (Shard(0, 100, 200), (256, 256), (100, 200)),
                                (Shard(1, 0, 128), (300, 128), None), (Shard(1, 64, 192), (300, 256), (64, 192))]:
        piece = read_quant_slice(_opener(tmp_path / "m.safetensors"), fmt, "x.weight", names, (300, 256), shard)
        assert piece.shape == read and piece.aligned == (narrow is None)
        got = fmt.dequantize("x.weight", piece.tensors, piece.shape)
        if narrow:
            assert piece.narrow == Shard(shard.dim, *narrow)
            got = got.narrow(shard.dim, narrow[0], narrow[1] - narrow[0])
        assert torch.equal(got, full.narrow(shard.dim, shard.lo, shard.hi - shard.lo))
    piece = read_quant_slice(_opener(tmp_path / "m.safetensors"), fmt, "x.weight", names, (300, 256), Shard(0, 128, 256))
    assert piece.tensors["x.weight_scale_inv"].shape == (1, 2)            # one block row of scales was read


def test_nvfp4_slices_rows_and_groups(tmp_path: Path) -> None:
    w, s, s2 = quantize_nvfp4(torch.randn(8, 64))
    save_file({"x.weight": w, "x.weight_scale": s, "x.weight_scale_2": s2}, str(tmp_path / "m.safetensors"))
    full = dequantize_nvfp4(w, s, s2)
    fmt, names = Nvfp4Format(), ["x.weight", "x.weight_scale", "x.weight_scale_2"]
    for shard, packed, narrow in [(Shard(0, 2, 5), (3, 32), None), (Shard(1, 16, 48), (8, 16), None),
                                  (Shard(1, 8, 40), (8, 24), (8, 40))]:
        piece = read_quant_slice(_opener(tmp_path / "m.safetensors"), fmt, "x.weight", names, (8, 64), shard)
        assert tuple(piece.tensors["x.weight"].shape) == packed
        got = fmt.dequantize("x.weight", piece.tensors, piece.shape)
        if narrow:
            got = got.narrow(1, narrow[0], narrow[1] - narrow[0])
        assert torch.equal(got, full.narrow(shard.dim, shard.lo, shard.hi - shard.lo))


# ---- sharded loading: every rank holds exactly its slice ---------------------------------------

@pytest.fixture(scope="module")
def quantized_dirs(tiny3_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist-quant")
    out = {"bf16": tiny3_dir}
    for fmt in ("fp8", "nvfp4"):
        quantize_checkpoint(tiny3_dir, root / fmt, fmt)
        out[fmt] = root / fmt
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_sharded_load_holds_the_slices_of_the_full_model(quantized_dirs, fmt: str) -> None:
    full = load_model(quantized_dirs[fmt], "float32", keep_quantized=False,
                      make_model=DeepseekV3ForCausalLM)[0].state_dict()
    for tp, ep in [(2, 1), (1, 2)]:
        for rank in range(2):
            par = ParallelState(rank=rank, world_size=2, tp_size=tp, ep_size=ep)
            model = load_model_sharded(quantized_dirs[fmt], "float32", "cpu", par, keep_quantized=True)[0]
            shards = collect_shards(model)
            tensors = dict(model.state_dict())
            packed = {n + ".weight": m.weight for n, m in model.named_modules()
                      if isinstance(m, (Fp8BlockLinear, Nvfp4Linear))}
            tensors = {n: t for n, t in tensors.items() if n.rsplit(".", 1)[0] + ".weight" not in packed} | packed
            sliced_packed = [n for n in packed if n in shards]
            # tiny FP8 slices are never on the 128 grid (dequantized); NVFP4 row slices always are
            assert bool(sliced_packed) == (fmt == "nvfp4" and tp == 2), sliced_packed
            for name, t in tensors.items():
                s = shards.get(name)
                ref = full[name] if s is None else full[name].narrow(s.dim, s.lo, s.hi - s.lo)
                assert torch.equal(t, ref), (fmt, tp, ep, rank, name)
            experts = {int(n.split(".")[5]) for n in tensors if ".experts." in n}
            assert experts == (set(range(8)) if ep == 1 else set(range(4 * rank, 4 * rank + 4)))


# ---- two processes -----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str, jobs: list[dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from mtp_core.distributed.launch import make_llm
    results: dict[str, Any] = {}
    try:
        for job in jobs:
            kw = dict(job["config"])
            kw["model_dir"] = job.get("model_dir_by_rank", {}).get(rank, kw["model_dir"])
            t0 = time.perf_counter()
            llm = make_llm(llm_config(**kw), timeout_s=TIMEOUT_S)
            torch.manual_seed(1000 + rank)       # unseeded sampling draws differently on each rank ...
            sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=job.get("temperature", 0.0))
            outs = llm.generate(BATCH, sampling)  # ... so only rank 0's broadcast keeps them together
            with torch.inference_mode():
                logits = llm.model.compute_logits(llm.model.forward_dense(torch.tensor(LOGIT_IDS)))
            st = llm.engine.stats
            results[job["name"]] = {"tokens": [o.token_ids for o in outs], "logits": logits,
                                    "drafts": (st.num_draft_proposed, st.num_draft_accepted),
                                    "output_rank": llm.is_output_rank, "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - the test process reads it
        results["error"] = f"{type(e).__name__}: {e}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(jobs: list[dict[str, Any]], out_dir: Path) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(out_dir), jobs)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 4 * TIMEOUT_S
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a rank hung past the deadline"
    assert [p.exitcode for p in procs] == [0, 0], "a rank crashed (at exit: was the process group destroyed?)"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _single(model_dir: Path, **kw: Any) -> tuple[list[list[int]], torch.Tensor]:
    # the ranks run the torch path (fp32 activations): so does the reference's native forward here (the bf16
    # activations of AVX512-BF16 / AMX kernels would pick other greedy tokens on a near tie)
    old = os.environ.get("MTP_CORE_CPU_ISA")
    os.environ["MTP_CORE_CPU_ISA"] = "avx512f" if "avx512" in kernels.cpu_isa() else kernels.cpu_isa()
    try:
        llm = LLM(llm_config(model_dir, **kw))
    finally:
        if old is None:
            os.environ.pop("MTP_CORE_CPU_ISA")
        else:
            os.environ["MTP_CORE_CPU_ISA"] = old
    tokens = [o.token_ids for o in llm.generate(BATCH, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    with torch.inference_mode():
        # the torch LM head, as on the ranks (a distributed model has no native decoder; the native head sums in
        # its own batch-invariant order, which matches torch's bit for bit on some CPUs and not on others)
        return tokens, llm.model.lm_head(llm.model.forward_dense(torch.tensor(LOGIT_IDS))).float()


def test_two_ranks_greedy_equals_single_process(quantized_dirs, tmp_path: Path) -> None:
    jobs, expected = [], {}
    for nextn, mode in MODES:
        ref = _single(quantized_dirs["bf16"], nextn=nextn, mode=mode)
        for tp, ep in LAYOUTS:
            name = f"tp{tp}-ep{ep}-{mode}"
            jobs.append({"name": name, "config": dict(model_dir=str(quantized_dirs["bf16"]), nextn=nextn, mode=mode,
                                                      tensor_parallel_size=tp, moe_expert_parallel_size=ep)})
            expected[name] = (ref, tp)
    # CUDA graphs asked for on 2 ranks: the static step is not combined with parallelism, so it runs eagerly
    jobs.append({"name": "tp2-ep1-eagle-graphs", "config": dict(
        model_dir=str(quantized_dirs["bf16"]), nextn=2, mode="eagle", tensor_parallel_size=2,
        moe_expert_parallel_size=1, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True))})
    expected["tp2-ep1-eagle-graphs"] = expected["tp2-ep1-eagle"]
    for fmt in ("fp8", "nvfp4"):     # kept packed where the slice allows
        name = f"tp2-ep2-eagle-{fmt}"
        cfg = dict(model_dir=str(quantized_dirs[fmt]), nextn=2, mode="eagle", keep_quantized=True)
        jobs.append({"name": name, "config": {**cfg, "tensor_parallel_size": 2, "moe_expert_parallel_size": 2}})
        expected[name] = (_single(**{**cfg, "model_dir": quantized_dirs[fmt]}), 2)
    jobs.append({"name": "sampled", "temperature": 2.0,
                 "config": dict(model_dir=str(quantized_dirs["bf16"]), nextn=2, mode="eagle", tensor_parallel_size=2,
                                moe_expert_parallel_size=2)})
    ranks = _spawn(jobs, tmp_path)
    for rank, res in enumerate(ranks):
        assert "error" not in res, res.get("error")
        assert [res[j["name"]]["output_rank"] for j in jobs] == [rank == 0] * len(jobs)
    assert ranks[0]["sampled"]["tokens"] == ranks[1]["sampled"]["tokens"], "rank 1 did not follow rank 0"
    assert ranks[0]["sampled"]["tokens"] != expected["tp2-ep2-eagle"][0][0], "temperature 2 should not be greedy"
    for name, ((tokens, logits), tp) in expected.items():
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["tokens"] == tokens and r1["tokens"] == tokens, name
        assert torch.equal(r0["logits"], r1["logits"]), f"{name}: ranks disagree"
        if tp == 1:   # attention replicated, top-2 experts summed by one all-reduce: the same additions
            assert torch.equal(r0["logits"], logits), name
        else:         # row-parallel partial sums: float32 rounding only
            torch.testing.assert_close(r0["logits"], logits, rtol=1e-5, atol=1e-5)
        proposed, accepted = r0["drafts"]
        if "-auto" not in name:
            assert 0 < accepted < proposed, f"{name}: both verification branches must run"


def test_a_rank_failing_to_load_fails_every_rank(tiny1_dir, tmp_path: Path) -> None:
    missing = str(tmp_path / "not-on-this-node")
    job = {"name": "bad", "model_dir_by_rank": {1: missing},
           "config": dict(model_dir=str(tiny1_dir), tensor_parallel_size=2, moe_expert_parallel_size=1)}
    t0 = time.perf_counter()
    ranks = _spawn([job], tmp_path)
    assert time.perf_counter() - t0 < TIMEOUT_S, "failure took a collective timeout to surface"
    for res in ranks:
        assert re.match(r"ValueError: rank 1 of 2 failed: model directory .*not-on-this-node does not exist",
                        res.get("error", "")), res


def test_parallel_sizes_without_torchrun_are_refused(tiny1_dir, monkeypatch) -> None:
    from mtp_core.distributed.launch import make_llm
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        make_llm(llm_config(tiny1_dir, tensor_parallel_size=2))
    assert type(make_llm(llm_config(tiny1_dir))) is LLM


def test_torchrun_quickstart_prints_once_and_matches(tiny1_dir) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MTP_DIST_TIMEOUT_S": str(TIMEOUT_S)}
    args = ["quickstart", "--model_dir", str(tiny1_dir), "--prompt", "Hello there", "12+7=", "--max_tokens", "8",
            "--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "2"]
    run = lambda *cmd: subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env,  # noqa: E731
                                      cwd=REPO, timeout=4 * TIMEOUT_S)
    single = run("-m", "cli", *args)
    assert single.returncode == 0, single.stderr
    par = run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
              "-m", "cli", *args, "--tp_size", "2", "--moe_ep_size", "2")
    if "not implemented yet" in par.stderr:
        pytest.skip("cli/common.py still refuses --tp_size > 1 (the lead wires make_llm into quickstart)")
    assert par.returncode == 0, par.stderr
    assert par.stdout == single.stdout                       # result lines once, from rank 0 only
    assert par.stderr.count("acceptance length (AL)") == 1
