"""The FP8 / NVFP4 checkpoint writer: exact on-disk names, dtypes, shapes and config entries."""

import json
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from cli.quantize import quantize_command
from mtp_core.loader.quant import Fp8BlockFormat, Nvfp4Format, detect_quant_format
from mtp_core.quantize import quantize_checkpoint

torch.set_num_threads(1)
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
CONFIG = {"model_type": "deepseek_v3", "num_hidden_layers": 1, "hidden_size": 32,
          "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
EXTRA_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": "{}",
               "generation_config.json": '{"eos_token_id": 1}'}


def source_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    down = torch.full((130, 200), 1.75)  # block scales 1.75/448 = 2**-8 ...
    down[128:, 128:] = 0.875             # ... except the partial corner block: 2**-9
    down[0, 0] = -1.75
    r = lambda *s: torch.randn(*s, generator=g).to(BF16)  # noqa: E731
    return {
        "model.embed_tokens.weight": r(64, 32),
        "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=BF16),
        "model.layers.0.self_attn.o_proj.weight": r(32, 48),
        "model.layers.0.mlp.gate.weight": r(8, 32),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(8),
        "model.layers.0.mlp.gate_proj.weight": r(64, 32),
        "model.layers.0.mlp.down_proj.weight": down.to(BF16),
        "model.layers.1.eh_proj.weight": r(32, 64),
        "model.layers.1.mlp.up_proj.weight": r(64, 32),
        "model.norm.weight": torch.ones(32, dtype=BF16),
        "lm_head.weight": r(64, 32),
    }


def make_source(root: Path, sharded: bool) -> Path:
    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    for name, text in EXTRA_FILES.items():
        (src / name).write_text(text)
    tensors = source_tensors()
    if not sharded:
        save_file(tensors, str(src / "model.safetensors"))
        return src
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(src / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


def read_all(out: Path) -> dict[str, torch.Tensor]:
    result = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            result.update({k: f.get_tensor(k) for k in f.keys()})
    return result


def layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}


UNCHANGED = {  # written as they were, in both formats
    "model.embed_tokens.weight": ((64, 32), BF16),
    "model.layers.0.input_layernorm.weight": ((32,), BF16),
    "model.layers.0.mlp.gate.weight": ((8, 32), BF16),
    "model.layers.0.mlp.gate.e_score_correction_bias": ((8,), torch.float32),
    "model.layers.1.eh_proj.weight": ((32, 64), BF16),
    "model.norm.weight": ((32,), BF16),
    "lm_head.weight": ((64, 32), BF16),
}


@pytest.mark.parametrize("sharded", [False, True])
def test_fp8_writer_layout_and_values(tmp_path, sharded):
    src = make_source(tmp_path, sharded)
    summary = quantize_checkpoint(src, tmp_path / "out", "fp8")
    out = tmp_path / "out"
    tensors = read_all(out)
    assert layout(tensors) == {**UNCHANGED,
        "model.layers.0.self_attn.o_proj.weight": ((32, 48), E4M3),
        "model.layers.0.self_attn.o_proj.weight_scale_inv": ((1, 1), torch.float32),
        "model.layers.0.mlp.gate_proj.weight": ((64, 32), E4M3),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": ((1, 1), torch.float32),
        "model.layers.0.mlp.down_proj.weight": ((130, 200), E4M3),
        "model.layers.0.mlp.down_proj.weight_scale_inv": ((2, 2), torch.float32),
        "model.layers.1.mlp.up_proj.weight": ((64, 32), E4M3),
        "model.layers.1.mlp.up_proj.weight_scale_inv": ((1, 1), torch.float32)}
    d = "model.layers.0.mlp.down_proj.weight"
    assert tensors[d + "_scale_inv"].tolist() == [[2.0 ** -8, 2.0 ** -8], [2.0 ** -8, 2.0 ** -9]]
    expected = torch.full((130, 200), 448.0)
    expected[0, 0] = -448.0
    assert torch.equal(tensors[d].float(), expected)
    config = json.loads((out / "config.json").read_text())
    assert config == {**CONFIG, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]}}
    for name, text in EXTRA_FILES.items():
        assert (out / name).read_text() == text
    assert not (out / "hf_quant_config.json").exists()
    assert (out / "model.safetensors.index.json").exists() == sharded
    assert summary["num_quantized"] == 4 and summary["num_kept"] == 4  # embed, router, eh_proj, lm_head
    assert summary["bytes_before"] == sum(t.numel() * t.element_size() for t in source_tensors().values())
    assert summary["bytes_after"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert summary["bytes_after"] < summary["bytes_before"]
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
        assert index["metadata"]["total_size"] == summary["bytes_after"]
        assert index["weight_map"][d + "_scale_inv"] == "model-00002-of-00002.safetensors"


def test_fp8_output_reads_back_through_the_loader_api(tmp_path):
    src = make_source(tmp_path, sharded=True)
    quantize_checkpoint(src, tmp_path / "out", "fp8")
    out = tmp_path / "out"
    fmt = detect_quant_format(out, json.loads((out / "config.json").read_text()))
    assert fmt == Fp8BlockFormat()
    tensors, source = read_all(out), source_tensors()
    available = set(tensors)
    for name, w in source.items():
        if name.endswith(".weight") and w.dim() == 2:
            names = fmt.tensor_names(name, available)
            got = fmt.dequantize(name, {n: tensors[n] for n in names}, tuple(w.shape))
            # e4m3 half-ulp 2**-4 relative; subnormal half-spacing 2**-10 x block scale (<= amax/448)
            bound = w.float().abs() * 2 ** -4 + w.float().abs().max() / 448 * 2 ** -10
            assert ((got - w.float()).abs() <= bound * (1 + 1e-6)).all(), name


def test_nvfp4_writer_layout_and_config(tmp_path):
    src = make_source(tmp_path, sharded=False)
    summary = quantize_checkpoint(src, tmp_path / "out", "nvfp4")
    out = tmp_path / "out"
    tensors = read_all(out)
    quantized = {}
    for base, (n, k) in {"model.layers.0.mlp.gate_proj": (64, 32), "model.layers.1.mlp.up_proj": (64, 32)}.items():
        quantized.update({base + ".weight": ((n, k // 2), torch.uint8),
                          base + ".weight_scale": ((n, k // 16), E4M3),
                          base + ".weight_scale_2": ((), torch.float32),
                          base + ".input_scale": ((), torch.float32)})
    assert layout(tensors) == {**UNCHANGED, **quantized,
        "model.layers.0.self_attn.o_proj.weight": ((32, 48), BF16),   # attention excluded
        "model.layers.0.mlp.down_proj.weight": ((130, 200), BF16)}    # 200 % 16 != 0
    assert tensors["model.layers.0.mlp.gate_proj.input_scale"].item() == 1.0
    assert json.loads((out / "config.json").read_text()) == CONFIG  # config.json unchanged
    assert json.loads((out / "hf_quant_config.json").read_text()) == {
        "producer": {"name": "modelopt", "version": "0.0.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head", "model.layers.0.mlp.down_proj",
                                             "model.layers.0.self_attn.o_proj",
                                             "model.layers.1.eh_proj"]}}
    assert summary["num_quantized"] == 2 and summary["num_uncalibrated_input_scales"] == 2
    fmt = detect_quant_format(out, CONFIG)
    assert isinstance(fmt, Nvfp4Format)
    w = source_tensors()["model.layers.0.mlp.gate_proj.weight"].float()
    names = fmt.tensor_names("model.layers.0.mlp.gate_proj.weight", set(tensors))
    got = fmt.dequantize("model.layers.0.mlp.gate_proj.weight", {n: tensors[n] for n in names}, (64, 32))
    assert ((got - w).norm() / w.norm()).item() < 0.15


def test_mtp_and_user_exclusions(tmp_path):
    src = make_source(tmp_path, sharded=False)
    quantize_checkpoint(src, tmp_path / "out", "nvfp4", quantize_mtp=False,
                        exclude=["model.layers.0.mlp.gate_proj"], input_amax={})
    tensors = read_all(tmp_path / "out")
    assert tensors["model.layers.1.mlp.up_proj.weight"].dtype == BF16
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == BF16
    excluded = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.layers.1.mlp.up_proj" in excluded and "model.layers.0.mlp.gate_proj" in excluded


def test_quantize_attention_quantizes_the_projections_but_kv_b_and_the_indexer(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(1)
    attn = {f"model.layers.0.self_attn.{m}.weight": torch.randn(32, 48, generator=g).to(BF16)
            for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b")}
    save_file({**source_tensors(), **attn}, str(src / "model.safetensors"))
    quantize_checkpoint(src, tmp_path / "out", "nvfp4", quantize_attention=True)
    tensors = read_all(tmp_path / "out")
    for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert tensors[f"model.layers.0.self_attn.{m}.weight"].dtype == torch.uint8, m
    for m in ("kv_b_proj", "indexer.wq_b"):
        assert tensors[f"model.layers.0.self_attn.{m}.weight"].dtype == BF16, m
    excluded = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.layers.0.self_attn.kv_b_proj" in excluded and "model.layers.0.self_attn.o_proj" not in excluded
    with pytest.raises(ValueError, match="quantize_attention applies to --format nvfp4"):
        quantize_checkpoint(src, tmp_path / "out8", "fp8", quantize_attention=True)
    assert not (tmp_path / "out8").exists()


def test_calibrated_input_scale(tmp_path):
    src = make_source(tmp_path, sharded=False)
    summary = quantize_checkpoint(src, tmp_path / "out", "nvfp4",
                                  input_amax={"model.layers.0.mlp.gate_proj": 2688.0 * 0.5})
    assert read_all(tmp_path / "out")["model.layers.0.mlp.gate_proj.input_scale"].item() == 0.5
    assert summary["num_uncalibrated_input_scales"] == 1


def test_refuses_non_empty_out_dir_and_accepts_empty(tmp_path):
    src = make_source(tmp_path, sharded=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        quantize_checkpoint(src, tmp_path / "busy", "fp8")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    quantize_checkpoint(src, tmp_path / "empty", "fp8")
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_failure_leaves_nothing_behind(tmp_path):
    src = make_source(tmp_path, sharded=True)
    (src / "model-00002-of-00002.safetensors").unlink()  # the index points at a missing shard
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        quantize_checkpoint(src, tmp_path / "out", "fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("mutate, needle", [
    (lambda src: (src / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": {}})),
     "already quantized"),
    (lambda src: (src / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda src: (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"})),
     "num_hidden_layers"),
])
def test_bad_sources(tmp_path, mutate, needle):
    src = make_source(tmp_path, sharded=False)
    mutate(src)
    with pytest.raises(ValueError, match=needle):
        quantize_checkpoint(src, tmp_path / "out", "fp8")
    assert not (tmp_path / "out").exists()


def test_cli_success_and_bad_input(tmp_path):
    src = make_source(tmp_path, sharded=False)
    app = typer.Typer()
    app.command("quantize")(quantize_command)
    app.command("other")(lambda: None)  # two commands so `quantize` is a subcommand, as in `mtp`
    runner = CliRunner()
    ok = runner.invoke(app, ["quantize", "--model_dir", str(src), "--output_dir", str(tmp_path / "o"),
                             "--format", "nvfp4", "--no_quantize_mtp", "--exclude", "lm_head"])
    assert ok.exit_code == 0, ok.output
    assert "1 weights quantized" in ok.stdout and (tmp_path / "o" / "hf_quant_config.json").exists()
    bad = runner.invoke(app, ["quantize", "--model_dir", str(src), "--output_dir", str(tmp_path / "p"),
                              "--format", "int4"])
    assert bad.exit_code == 2
    assert bad.stderr.strip() == "error: format 'int4' is not supported; use one of: fp8, nvfp4"
    assert not (tmp_path / "p").exists()
