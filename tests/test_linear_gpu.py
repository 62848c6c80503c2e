"""The quantized linear modules on a GPU (marker `gpu`; skipped without CUDA, never counted as passed there):
each runs the kernel choose_linear_kernel names for this device and matches that kernel's reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_core.kernels import native_ops, nvfp4_gemm_ref, nvfp4_w4a4_gemm_ref
from mtp_core.kernels.dispatch import choose_linear_kernel, linear_target
from mtp_core.loader.quant.fp8 import fp8_block_linear_reference, quantize_fp8_block
from mtp_core.loader.quant.linear import Fp8BlockLinear, Nvfp4Linear
from mtp_core.loader.quant.nvfp4 import quantize_nvfp4

torch.set_num_threads(1)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def nvfp4_module(n: int, k: int, device, input_scale: float | None = 0.02) -> Nvfp4Linear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    packed, scale, scale_2 = quantize_nvfp4(w)
    gs = None if input_scale is None else torch.tensor(input_scale)
    return Nvfp4Linear(packed, scale, scale_2, gs).to(device)


def test_nvfp4_linear_runs_the_chosen_kernel(device) -> None:
    module = nvfp4_module(512, 1024, device)
    x = torch.randn(5, 1024, device=device, dtype=torch.bfloat16)
    y = module(x)
    want_kernel, why = choose_linear_kernel("nvfp4", 512, 1024, torch.bfloat16, linear_target(device),
                                            has_input_scale=True)
    assert module.kernel == want_kernel, why
    if native_ops().cuda_ok(device) or torch.cuda.get_device_capability(device)[0] == 10:
        assert module.kernel != "dequant", module.kernel_reason
    args = (module.weight_packed, module.weight_scale, module.weight_scale_2)
    ref = (nvfp4_w4a4_gemm_ref(x.float(), *args, module.input_scale) if module.kernel == "nvfp4_w4a4"
           else nvfp4_gemm_ref(x.float(), *args))
    assert rel_err(y, ref) < 2e-2
    y2 = module(torch.randn(3, 1024, device=device, dtype=torch.bfloat16))  # second call: cached decision
    assert y2.shape == (3, 512)


def test_nvfp4_linear_dequant_path_on_cuda(device) -> None:
    """K = 80 has no GPU GEMM: the dequantizing forward runs on the GPU (its lookup table on the GPU too)."""
    module = nvfp4_module(32, 80, device)
    x = torch.randn(4, 80, device=device)
    y = module(x)
    assert module.kernel == "dequant"
    torch.testing.assert_close(y, F.linear(x, module.weight))


def test_fp8_block_linear_runs_the_chosen_kernel(device) -> None:
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8_block(w)
    module = Fp8BlockLinear(q, s).to(device)
    x = torch.randn(7, 1024, generator=torch.Generator().manual_seed(2))
    y = module(x.to(device, torch.bfloat16))
    kernel, why = choose_linear_kernel("fp8_block", 512, 1024, torch.bfloat16, linear_target(device),
                                       block_size=(128, 128))
    assert module.kernel == kernel, why
    ref = fp8_block_linear_reference(x.to(torch.bfloat16).float(), q, s) if kernel != "dequant" \
        else x.to(torch.bfloat16).float() @ module.weight.cpu().t()
    assert rel_err(y.cpu(), ref) < 2e-2


def test_nvfp4_linear_in_a_cuda_graph(device) -> None:
    module = nvfp4_module(256, 512, device)
    x = torch.randn(2, 512, device=device, dtype=torch.bfloat16)
    want = module(x).clone()                       # outside capture: decides, caches the swizzled scales
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        module(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want)
