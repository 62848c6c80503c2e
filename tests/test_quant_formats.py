"""FP8-block and NVFP4 dequantization/quantization against hand-computed values."""

import json

import pytest
import torch

from mtp_core.loader.quant import (Fp8BlockFormat, Nvfp4Format, detect_quant_format,
                                   ignorable_tensor)
from mtp_core.loader.quant.fp8 import (fp8_block_linear_reference, quantize_activation_per_token_group,
                                       quantize_fp8_block)
from mtp_core.kernels.dispatch import load_deep_gemm
from mtp_core.loader.quant.linear import Fp8BlockLinear, make_fp8_linear, make_linear
from mtp_core.loader.quant.nvfp4 import (pack_e2m1, quantize_nvfp4, round_to_e2m1, unpack_e2m1)

torch.set_num_threads(1)

E4M3 = torch.float8_e4m3fn
# e4m3 bit patterns: sign | 4 exponent bits (bias 7) | 3 mantissa bits
E4M3_ONE, E4M3_TWO, E4M3_HALF, E4M3_448, E4M3_NEG_448, E4M3_MIN_SUB = 0x38, 0x40, 0x30, 0x7E, 0xFE, 0x01
# Every e2m1 code's value, written out from the format definition (sign|exp2|man1).
E2M1 = {0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0,
        0b0111: 6.0, 0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0,
        0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0}


def e4m3(*bits: int) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8).view(E4M3)


def nvfp4_tensors(name: str, packed: list[list[int]], scales: list[list[int]], scale_2: float,
                  input_scale: float | None = 1.0) -> dict[str, torch.Tensor]:
    t = {name: torch.tensor(packed, dtype=torch.uint8),
         name + "_scale": torch.tensor(scales, dtype=torch.uint8).view(E4M3),
         name + "_scale_2": torch.tensor(scale_2, dtype=torch.float32)}
    if input_scale is not None:
        t[name.removesuffix(".weight") + ".input_scale"] = torch.tensor(input_scale)
    return t


# ---------------------------------------------------------------- NVFP4 decoding

def test_all_16_e2m1_codes_decode_to_their_values():
    # Byte j packs codes 2j (low nibble) and 2j+1 (high nibble): 0x10, 0x32, ..., 0xFE.
    packed = [[(2 * j) | ((2 * j + 1) << 4) for j in range(8)]]
    t = nvfp4_tensors("w.weight", packed, [[E4M3_ONE]], 1.0)
    got = Nvfp4Format().dequantize("w.weight", t, (1, 16))
    assert got.tolist() == [[E2M1[c] for c in range(16)]]
    assert got[0, 0b0111].item() == 6.0 and got[0, 0b1001].item() == -0.5


def test_low_nibble_is_the_even_column():
    assert unpack_e2m1(torch.tensor([[0x71, 0x9F]], dtype=torch.uint8)).tolist() == [[1, 7, 15, 9]]
    assert pack_e2m1(torch.tensor([[1, 7, 15, 9]], dtype=torch.uint8)).tolist() == [[0x71, 0x9F]]


def test_nvfp4_known_scales():
    # Row 0: group 0 holds codes 0..15, group 1 is all 6.0 (0x77); scales 1.0 and 2.0.
    # Row 1: group 0 all 0.5 (0x11), group 1 all -1.0 (0xAA); scales 448 and 2**-9.
    packed = [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] + [0x77] * 8,
              [0x11] * 8 + [0xAA] * 8]
    t = nvfp4_tensors("w.weight", packed, [[E4M3_ONE, E4M3_TWO], [E4M3_448, E4M3_MIN_SUB]], 0.25)
    got = Nvfp4Format().dequantize("w.weight", t, (2, 32))
    row0 = [0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5,
            -0.0, -0.125, -0.25, -0.375, -0.5, -0.75, -1.0, -1.5] + [3.0] * 16  # 6 * 2 * 0.25
    row1 = [56.0] * 16 + [-(2.0 ** -11)] * 16  # 0.5*448*0.25 and -1 * 2**-9 * 0.25
    assert got.tolist() == [row0, row1]


def test_nvfp4_weight_as_float4_x2_dtype_is_read_as_bytes():
    t = nvfp4_tensors("w.weight", [[0x71] * 8], [[E4M3_ONE]], 1.0)
    t["w.weight"] = t["w.weight"].view(torch.float4_e2m1fn_x2)
    assert Nvfp4Format().dequantize("w.weight", t, (1, 16))[0, :2].tolist() == [0.5, 6.0]


# ---------------------------------------------------------------- FP8 decoding

def test_e4m3_edge_values():
    t = {"w.weight": e4m3(E4M3_448, E4M3_NEG_448, E4M3_MIN_SUB, 0x00).view(1, 4),
         "w.weight_scale_inv": torch.tensor([[1.0]])}
    assert Fp8BlockFormat().dequantize("w.weight", t, (1, 4)).tolist() == [[448.0, -448.0, 2.0 ** -9, 0.0]]


def test_fp8_partial_edge_blocks():
    # N=130, K=200: blocks rows [0,128) [128,130), columns [0,128) [128,200) -> scale grid [2, 2].
    w = torch.full((130, 200), E4M3_ONE, dtype=torch.uint8)
    w[0, 0], w[129, 199] = E4M3_MIN_SUB, E4M3_NEG_448
    t = {"w.weight": w.view(E4M3), "w.weight_scale_inv": torch.tensor([[2.0, 3.0], [5.0, 0.375]])}
    got = Fp8BlockFormat().dequantize("w.weight", t, (130, 200))
    expected = torch.empty(130, 200)
    expected[:128, :128], expected[:128, 128:] = 2.0, 3.0
    expected[128:, :128], expected[128:, 128:] = 5.0, 0.375
    expected[0, 0], expected[129, 199] = 2.0 ** -9 * 2.0, -448.0 * 0.375
    assert torch.equal(got, expected)


# ---------------------------------------------------------------- format API and validation

def test_tensor_names_and_is_quantized():
    fp8, nv = Fp8BlockFormat(), Nvfp4Format()
    w = "model.layers.0.mlp.down_proj.weight"
    avail = {w, w + "_scale_inv", "lm_head.weight"}
    assert fp8.is_quantized(w, avail) and not fp8.is_quantized("lm_head.weight", avail)
    assert fp8.tensor_names(w, avail) == [w, w + "_scale_inv"]
    assert fp8.tensor_names("lm_head.weight", avail) == ["lm_head.weight"]
    nv_avail = {w, w + "_scale", w + "_scale_2", "model.layers.0.mlp.down_proj.input_scale"}
    assert nv.tensor_names(w, nv_avail) == [w, w + "_scale", w + "_scale_2",
                                            "model.layers.0.mlp.down_proj.input_scale"]
    assert nv.tensor_names(w, {w, w + "_scale", w + "_scale_2"}) == [w, w + "_scale", w + "_scale_2"]
    assert nv.tensor_names(w, {w}) == [w] and not nv.is_quantized(w, {w})


def test_unquantized_weight_is_returned_as_float32():
    w = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    for fmt in (Fp8BlockFormat(), Nvfp4Format()):
        got = fmt.dequantize("lm_head.weight", {"lm_head.weight": w}, (1, 2))
        assert got.dtype == torch.float32 and got.tolist() == [[1.5, -2.0]]


NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("change, message", [
    ({NAME + "_scale_inv": torch.ones(2, 2)},
     NAME + "_scale_inv: expected shape [2, 3] float32, got [2, 2] float32"),
    ({NAME + "_scale_inv": torch.ones(2, 3, dtype=torch.bfloat16)},
     NAME + "_scale_inv: expected shape [2, 3] float32, got [2, 3] bfloat16"),
    ({NAME: torch.zeros(130, 299).to(E4M3)},
     NAME + ": expected shape [130, 300] float8_e4m3fn, got [130, 299] float8_e4m3fn"),
    ({NAME: torch.zeros(130, 300)},
     NAME + ": expected shape [130, 300] float8_e4m3fn, got [130, 300] float32"),
])
def test_fp8_malformed_tensors_name_the_tensor(change, message):
    t = {NAME: torch.zeros(130, 300).to(E4M3), NAME + "_scale_inv": torch.ones(2, 3)}
    t.update(change)
    with pytest.raises(ValueError) as e:
        Fp8BlockFormat().dequantize(NAME, t, (130, 300))
    assert str(e.value) == message


def test_fp8_weight_without_its_scale_is_rejected():
    t = {NAME: torch.zeros(4, 4).to(E4M3)}  # the scale tensor is missing from the checkpoint
    with pytest.raises(ValueError, match=NAME + "_scale_inv: missing"):
        Fp8BlockFormat().dequantize(NAME, t, (4, 4))


@pytest.mark.parametrize("change, message", [
    ({NAME + "_scale": torch.ones(2, 2)},
     NAME + "_scale: expected shape [2, 2] float8_e4m3fn, got [2, 2] float32"),
    ({NAME + "_scale": torch.ones(2, 1).to(E4M3)},
     NAME + "_scale: expected shape [2, 2] float8_e4m3fn, got [2, 1] float8_e4m3fn"),
    ({NAME + "_scale_2": torch.ones(2)}, NAME + "_scale_2: expected shape [] float32, got [2] float32"),
    ({NAME + "_scale_2": None}, NAME + "_scale_2: missing from the checkpoint (expected [] float32)"),
    ({NAME + "_scale": None},
     NAME + "_scale: missing from the checkpoint (expected [2, 2] float8_e4m3fn)"),
    ({NAME: torch.zeros(2, 32, dtype=torch.uint8)},
     NAME + ": expected shape [2, 16] uint8, got [2, 32] uint8"),
    ({"model.layers.0.mlp.down_proj.input_scale": torch.ones(1, 1)},
     "model.layers.0.mlp.down_proj.input_scale: expected shape [] float32, got [1, 1] float32"),
])
def test_nvfp4_malformed_tensors_name_the_tensor(change, message):
    t = nvfp4_tensors(NAME, [[0] * 16] * 2, [[E4M3_ONE] * 2] * 2, 1.0)
    for k, v in change.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    with pytest.raises(ValueError) as e:
        Nvfp4Format().dequantize(NAME, t, (2, 32))
    assert str(e.value) == message


def test_nvfp4_rejects_in_features_not_multiple_of_16():
    t = nvfp4_tensors(NAME, [[0] * 12], [[E4M3_ONE]], 1.0)
    with pytest.raises(ValueError, match="in_features 24 is not a multiple"):
        Nvfp4Format().dequantize(NAME, t, (1, 24))


# ---------------------------------------------------------------- quantization

def test_round_to_e2m1_nearest_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.75, 0.26, -0.1, -2.9])
    assert round_to_e2m1(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 10, 1, 0, 13]


def test_quantize_nvfp4_hand_example():
    g0 = [6, -6, 3, 0.5, 1.25, 1.75, 0, 5, 2.5, 3.5, 0.25, 0.75, -0.3, 4, -1.5, 1]
    g1 = [12.6, -3, 1, 0.5] + [0.0] * 12
    w = torch.tensor([[v * 448 for v in g0] + g1])  # amax 2688 -> weight_scale_2 = 1
    packed, scale, scale_2 = quantize_nvfp4(w)
    assert scale_2.shape == () and scale_2.item() == 1.0
    # group 0: 2688/6 = 448 exactly; group 1: 12.6/6 = 2.1 -> e4m3 2.0 (spacing 0.25 in [2, 4)).
    assert scale.view(torch.uint8).tolist() == [[E4M3_448, E4M3_TWO]]
    codes = unpack_e2m1(packed)[0].tolist()
    assert codes[:16] == [7, 15, 5, 1, 2, 4, 0, 6, 4, 6, 0, 2, 9, 6, 11, 2]
    # 12.6/2 = 6.3 saturates to 6; -3/2 = -1.5; 1/2 = 0.5; 0.5/2 = 0.25 ties to 0.
    assert codes[16:20] == [7, 11, 1, 0] and codes[20:] == [0] * 12
    assert packed[0, 0].item() == 0xF7  # codes 7 (low) and 15 (high)


def test_quantize_fp8_hand_example_and_partial_blocks():
    w = torch.zeros(130, 200)
    w[0, 0], w[0, 1] = 896.0, 3.0  # block (0,0): amax 896 -> scale_inv 2; 3/2 = 1.5 exact
    w[129, 199] = -0.875  # block (1,1): scale_inv 0.875/448 = 2**-9; value -448
    q, s = quantize_fp8_block(w)
    assert q.dtype == E4M3 and q.shape == (130, 200) and s.shape == (2, 2)
    assert s.tolist() == [[2.0, 1.0], [1.0, 2.0 ** -9]]  # all-zero blocks get 1.0
    assert q[0, :2].float().tolist() == [448.0, 1.5] and q[129, 199].float().item() == -448.0
    assert q.float().abs().sum().item() == 448 + 1.5 + 448


def test_quantize_dequantize_error_bounds():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(160, 272, generator=g) * torch.rand(160, 1, generator=g) * 3
    q, s = quantize_fp8_block(w)
    fp8 = Fp8BlockFormat().dequantize("w.weight", {"w.weight": q, "w.weight_scale_inv": s}, (160, 272))
    s_full = s.repeat_interleave(128, 0)[:160].repeat_interleave(128, 1)[:, :272]
    # e4m3: 3 mantissa bits -> relative half-ulp 2**-4; subnormal spacing 2**-9 (x scale).
    assert ((fp8 - w).abs() <= w.abs() * 2 ** -4 + s_full * 2 ** -10 + 1e-7).all()
    assert ((fp8 - w).norm() / w.norm()).item() < 0.03

    packed, scale, scale_2 = quantize_nvfp4(w)
    nv = Nvfp4Format().dequantize("w.weight", {"w.weight": packed, "w.weight_scale": scale,
                                               "w.weight_scale_2": scale_2}, (160, 272))
    step = scale.float().repeat_interleave(16, 1) * scale_2
    # e2m1: worst relative rounding 1/3 (0.75 -> 0.5 or 1); below 0.25 rounds to 0.
    assert ((nv - w).abs() <= torch.maximum(w.abs() / 3, step * 0.25) * (1 + 1e-6)).all()
    assert ((nv - w).norm() / w.norm()).item() < 0.15


def test_activation_quantization_per_token_per_128():
    x = torch.zeros(2, 200)
    x[0, 0], x[0, 1], x[0, 150] = 896.0, 1.0, -0.875
    xq, xs = quantize_activation_per_token_group(x)
    assert xs.shape == (2, 2) and xq.shape == (2, 200)
    assert xs[0].tolist() == [2.0, 2.0 ** -9]
    assert xs[1].tolist() == pytest.approx([1e-4 / 448] * 2)  # all-zero groups get the floor
    assert xq[0, [0, 1, 150]].float().tolist() == [448.0, 0.5, -448.0]


def test_fp8_linear_reference_is_exact_for_representable_inputs():
    x = torch.tensor([[448.0, 1.0, -2.0, 0.5]])  # amax 448 -> activation scale 1, all exact
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-0.5, 0.0, 448.0, 1.5]])
    q, s = quantize_fp8_block(w)
    assert fp8_block_linear_reference(x, q, s).tolist() == (x @ w.t()).tolist()


# ---------------------------------------------------------------- keep-quantized linear

def _formats_with_tensors():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 160, generator=g)
    q, s = quantize_fp8_block(w)
    packed, scale, scale_2 = quantize_nvfp4(w)
    return [(Fp8BlockFormat(), {"a.weight": q, "a.weight_scale_inv": s}),
            (Nvfp4Format(), {"a.weight": packed, "a.weight_scale": scale, "a.weight_scale_2": scale_2,
                             "a.input_scale": torch.tensor(1.0)}),
            (Fp8BlockFormat(), {"a.weight": w.to(torch.bfloat16)})]


@pytest.mark.parametrize("fmt, tensors", _formats_with_tensors())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_quantized_linear_equals_dequantize_at_load(fmt, tensors, dtype):
    x = torch.randn(3, 5, 160, generator=torch.Generator().manual_seed(2)).to(dtype)
    loaded = torch.nn.Linear(160, 48, bias=False)
    with torch.no_grad():
        loaded.weight.copy_(fmt.dequantize("a.weight", tensors, (48, 160)))
    loaded = loaded.to(dtype)
    module = make_linear(fmt, "a.weight", tensors, (48, 160)).to(dtype)  # .to(dtype) must not round scales
    with torch.no_grad():
        assert torch.equal(module(x), loaded(x))


def test_keep_quantized_fp8_holds_packed_tensors():
    fmt, tensors = _formats_with_tensors()[0]
    module = make_linear(fmt, "a.weight", tensors, (48, 160)).to(torch.float16)
    assert isinstance(module, Fp8BlockLinear)
    assert module.weight_fp8.dtype == E4M3 and torch.equal(module.weight_scale_inv, tensors["a.weight_scale_inv"])
    # `.weight` is the real (dequantized) weight, for model code that reads it directly
    assert torch.equal(module.weight, fmt.dequantize("a.weight", tensors, (48, 160)))


def test_deep_gemm_request_on_cpu_is_refused_and_auto_falls_back():
    fmt, tensors = _formats_with_tensors()[0]
    with pytest.raises(ValueError, match="needs CUDA"):
        make_fp8_linear(tensors["a.weight"], tensors["a.weight_scale_inv"], (128, 128), "cpu", True)
    assert type(make_fp8_linear(tensors["a.weight"], tensors["a.weight_scale_inv"], (128, 128))) \
        is Fp8BlockLinear


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or load_deep_gemm() is None
                    or torch.cuda.get_device_capability()[0] != 9, reason="needs Hopper + deep_gemm")
def test_deep_gemm_matches_fp8_reference():  # never run in CPU development
    w = torch.randn(256, 512)
    q, s = quantize_fp8_block(w)
    x = torch.randn(7, 512)
    module = make_fp8_linear(q, s, (128, 128), "cuda", True)
    got = module(x.cuda().to(torch.bfloat16)).float().cpu()
    ref = fp8_block_linear_reference(x.to(torch.bfloat16).float(), q, s)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


# ---------------------------------------------------------------- detection

def test_detect_formats(tmp_path):
    assert detect_quant_format(tmp_path, {"num_hidden_layers": 2}) is None
    fp8_cfg = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                       "quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert detect_quant_format(tmp_path, fp8_cfg) == Fp8BlockFormat(block_size=(128, 128))
    inline = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                      "group_size": 16, "ignore": ["lm_head"]}}
    assert detect_quant_format(tmp_path, inline) == Nvfp4Format(exclude_modules=("lm_head",))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.23.0"},
         "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                          "exclude_modules": ["model.layers.0.self_attn*", "lm_head"]}}))
    fmt = detect_quant_format(tmp_path, {})
    assert isinstance(fmt, Nvfp4Format) and fmt.name == "nvfp4"
    assert fmt.is_excluded("model.layers.0.self_attn.o_proj.weight")
    assert not fmt.is_excluded("model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="remove one"):
        detect_quant_format(tmp_path, fp8_cfg)


@pytest.mark.parametrize("qc, needle", [
    ({"quant_method": "awq"}, "'awq' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8' is not supported"),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}, "per-tensor FP8"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'static'"),
])
def test_detect_rejects_unsupported(tmp_path, qc, needle):
    with pytest.raises(ValueError, match=needle):
        detect_quant_format(tmp_path, {"quantization_config": qc})


def test_ignorable_tensors():
    assert ignorable_tensor("model.layers.0.self_attn.k_scale")
    assert ignorable_tensor("model.layers.3.self_attn.kv_a_proj_with_mqa.v_scale")
    assert not ignorable_tensor("model.layers.0.mlp.down_proj.input_scale")
    assert not ignorable_tensor("model.layers.0.mlp.down_proj.weight_scale")
