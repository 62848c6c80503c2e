"""The one decision "which kernel serves this quantized weight" (kernels.dispatch.choose_linear_kernel), tested on
the CPU for CUDA-like devices: the device's capabilities are passed in as a LinearTarget. These tests check the
decision and that the modules route their forward to the kernel it names; none of them runs a GPU kernel."""
from __future__ import annotations

import pytest
import torch

import mtp_core.kernels as kernels
from mtp_core.kernels import dispatch
from mtp_core.kernels.dispatch import LinearTarget, choose_linear_kernel, linear_target
from mtp_core.kernels.nvfp4_gemm_ref import E2M1_VALUES, nvfp4_gemm_ref, unpack_e2m1
from mtp_core.loader.quant.fp8 import quantize_fp8_block
from mtp_core.loader.quant.linear import Fp8BlockLinear, Nvfp4Linear, make_fp8_linear
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

torch.set_num_threads(1)
BF16 = torch.bfloat16
CPU = LinearTarget("cpu")
H200 = LinearTarget("cuda", (9, 0), native_cuda=True, deep_gemm=False, scaled_mm=True)
H200_DG = LinearTarget("cuda", (9, 0), native_cuda=True, deep_gemm=True, scaled_mm=True)
H200_NO_EXT = LinearTarget("cuda", (9, 0), native_cuda=False, deep_gemm=False, scaled_mm=True)
B200 = LinearTarget("cuda", (10, 0), native_cuda=True, deep_gemm=False, scaled_mm=True)
A100 = LinearTarget("cuda", (8, 0), native_cuda=False, deep_gemm=False, scaled_mm=True)


def nv(target, n=7168, k=2048, **kw):
    return choose_linear_kernel("nvfp4", n, k, BF16, target, **kw)[0]


def fp8(target, n=7168, k=2048, block=(128, 128), **kw):
    return choose_linear_kernel("fp8_block", n, k, BF16, target, block_size=block, **kw)[0]


def test_cpu_always_dequantizes() -> None:
    assert nv(CPU) == nv(CPU, has_input_scale=True) == fp8(CPU) == "dequant"
    assert linear_target(torch.device("cpu")) == CPU


def test_nvfp4_on_hopper_is_the_weight_only_gemm() -> None:
    assert nv(H200) == nv(H200, has_input_scale=True) == "nvfp4_gemm"     # no FP4 tensor cores on sm_90
    assert nv(H200, k=2000) == "dequant"                                   # K % 64 != 0
    assert nv(H200_NO_EXT) == "dequant"                                    # _C_cuda not built for this GPU
    assert nv(H200, cpu_layout=True) == "dequant"                          # codes in the CPU kernels' order
    assert choose_linear_kernel("nvfp4", 64, 128, torch.float32, H200)[0] == "nvfp4_gemm"


def test_nvfp4_on_blackwell_is_w4a4_with_an_input_scale() -> None:
    assert nv(B200, has_input_scale=True) == "nvfp4_w4a4"
    assert nv(B200) == "nvfp4_gemm"                                        # no activation scale: weight-only
    assert nv(B200, n=100, has_input_scale=True) == "nvfp4_gemm"           # N % 16 != 0
    assert nv(LinearTarget("cuda", (10, 0), native_cuda=True), has_input_scale=True) == "nvfp4_gemm"  # no scaled_mm
    assert nv(A100, has_input_scale=True) == "dequant"


def test_fp8_block_kernels() -> None:
    assert fp8(H200_DG) == "fp8_deep_gemm"
    assert fp8(H200_DG, deep_gemm=False) == "fp8_scaled_mm"                # use_deep_gemm=False
    assert fp8(H200) == "fp8_scaled_mm"                                    # DeepGEMM not installed
    assert fp8(H200_DG, n=192) == "fp8_deep_gemm"                          # DeepGEMM takes N % 64
    assert fp8(H200, n=192) == "dequant"                                   # the scaled matmul needs N % 128
    assert fp8(H200_DG, k=1000) == "dequant"
    assert fp8(H200_DG, block=(64, 64)) == "dequant"
    assert fp8(B200) == "fp8_scaled_mm"                                    # DeepGEMM only on Hopper here
    assert fp8(A100) == "dequant"


def test_decision_explains_and_rejects_bad_input() -> None:
    kernel, why = choose_linear_kernel("nvfp4", 64, 80, BF16, H200)
    assert kernel == "dequant" and "multiple of 64" in why
    with pytest.raises(ValueError, match="fmt must be"):
        choose_linear_kernel("int4", 64, 64, BF16, H200)


def _nvfp4_module(n=64, k=128, input_scale=True):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    packed, scale, scale_2 = quantize_nvfp4(w)
    return Nvfp4Linear(packed, scale, scale_2, torch.tensor(0.01) if input_scale else None)


def test_modules_decide_through_the_one_function(monkeypatch) -> None:
    nvm = _nvfp4_module()
    q, s = quantize_fp8_block(torch.randn(256, 256))
    fpm = Fp8BlockLinear(q, s)
    assert nvm._decide(BF16, B200)[0] == "nvfp4_w4a4"
    assert _nvfp4_module(input_scale=False)._decide(BF16, B200)[0] == "nvfp4_gemm"
    assert fpm._decide(BF16, H200_DG)[0] == "fp8_deep_gemm"
    assert make_fp8_linear(q, s, (128, 128), "cpu", False)._decide(BF16, H200_DG)[0] == "fp8_scaled_mm"
    # on this CPU the forward dequantizes, and says so
    x = torch.randn(3, 128)
    torch.testing.assert_close(nvm(x), x @ nvm.weight.t())
    assert nvm.kernel == "dequant"


def test_nvfp4_forward_routes_to_the_chosen_kernel(monkeypatch) -> None:
    """With the decision faked to a Hopper device, the forward hands the packed tensors and bf16 activations to
    kernels.nvfp4_gemm (recorded here and answered by the reference: no GPU kernel runs in this test)."""
    module = _nvfp4_module()
    calls = []

    def fake_gemm(x, weight, weight_scale, weight_scale_2):
        calls.append((x.dtype, weight.data_ptr(), weight_scale.dtype))
        return nvfp4_gemm_ref(x, weight, weight_scale, weight_scale_2)

    monkeypatch.setattr(dispatch, "linear_target", lambda device: H200)
    monkeypatch.setattr(kernels, "nvfp4_gemm", fake_gemm)
    x = torch.randn(2, 5, 128)
    y = module(x)
    assert module.kernel == "nvfp4_gemm" and calls == [(BF16, module.weight_packed.data_ptr(), torch.float8_e4m3fn)]
    assert y.dtype == torch.float32 and y.shape == (2, 5, 64)
    torch.testing.assert_close(y, nvfp4_gemm_ref(x.reshape(-1, 128).to(BF16), module.weight_packed,
                                                 module.weight_scale, module.weight_scale_2)
                               .float().reshape(2, 5, 64))


def test_w4a4_weight_scales_are_swizzled_once(monkeypatch) -> None:
    module = _nvfp4_module()
    seen = []

    def fake_w4a4(x, weight, weight_scale, weight_scale_2, input_scale, weight_scale_swizzled=None):
        seen.append(weight_scale_swizzled)
        return torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype)

    monkeypatch.setattr(dispatch, "linear_target", lambda device: B200)
    monkeypatch.setattr(kernels, "nvfp4_w4a4_gemm", fake_w4a4)
    module(torch.randn(1, 128))
    module(torch.randn(4, 128))
    assert module.kernel == "nvfp4_w4a4" and len(seen) == 2 and seen[0] is seen[1]
    torch.testing.assert_close(seen[0].view(torch.uint8),
                               kernels.swizzle_block_scales(module.weight_scale).view(torch.uint8))


def test_nvfp4_dequant_tables_live_on_the_weights_device() -> None:
    """The lookup table is built on the weight's device (it was a CPU table indexed with a CUDA tensor); the
    meta device stands in for CUDA here (with a CPU table the result does not land on the weight's device)."""
    module = _nvfp4_module().to("meta")
    w = dequantize_nvfp4(module.weight_packed, module.weight_scale, module.weight_scale_2)
    assert w.device.type == "meta" and w.shape == (64, 128)
    assert unpack_e2m1(torch.zeros(2, 4, dtype=torch.uint8, device="meta")).shape == (2, 8)


def test_e2m1_values_by_arithmetic() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    got = unpack_e2m1(codes[None])[0]                                      # [512]: low, high nibble per byte
    want = torch.tensor([E2M1_VALUES[c & 15] if i == 0 else E2M1_VALUES[c >> 4] for c in range(256) for i in (0, 1)])
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))   # -0.0 for code 8


def test_gpu_load_keeps_packed_only_what_a_gpu_gemm_serves(monkeypatch) -> None:
    """Auto mode on a GPU: the loader asks the same decision per weight (packed where a GPU GEMM serves it,
    dequantized once at load where it would only be dequantized per forward)."""
    from mtp_core.loader.quant import Fp8BlockFormat, Nvfp4Format
    from mtp_core.loader.weights import _served_packed, resolve_keep_quantized
    monkeypatch.setattr(dispatch, "linear_target", lambda device: H200)
    assert resolve_keep_quantized(None, "cuda") and not resolve_keep_quantized(False, "cuda")
    nv_names = {"a.weight", "a.weight_scale", "a.weight_scale_2"}
    assert _served_packed(Nvfp4Format(), "a.weight", (64, 128), nv_names, "cuda", BF16)
    assert not _served_packed(Nvfp4Format(), "a.weight", (64, 80), nv_names, "cuda", BF16)
    fp8_names = {"a.weight", "a.weight_scale_inv"}
    assert _served_packed(Fp8BlockFormat(), "a.weight", (256, 256), fp8_names, "cuda", BF16)
    assert not _served_packed(Fp8BlockFormat(), "a.weight", (192, 256), fp8_names, "cuda", BF16)


def test_fp8_scaled_mm_refusal_is_logged_and_dequantizes(monkeypatch) -> None:
    """If this torch refuses the block-scaled recipe at run time, the module says so (.kernel / its reason)
    and dequantizes from then on; the decision itself stays with choose_linear_kernel."""
    import torch.nn.functional as F
    q, s = quantize_fp8_block(torch.randn(256, 256, generator=torch.Generator().manual_seed(3)))
    module = Fp8BlockLinear(q, s)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Invalid scaling configuration\nmore")

    monkeypatch.setattr(dispatch, "linear_target", lambda device: H200)
    monkeypatch.setattr(F, "scaled_mm", refuse)
    x = torch.randn(3, 256)
    for _ in range(2):
        torch.testing.assert_close(module(x), x @ module.weight.t())
    assert calls == [1] and module.kernel == "dequant" and "Invalid scaling configuration" in module.kernel_reason
