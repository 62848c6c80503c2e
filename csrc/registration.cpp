// The one registry of mtp_core op schemas. Built into mtp_core._C (always, CPU-only); the CUDA
// kernels in mtp_core._C_cuda only add implementations (TORCH_LIBRARY_IMPL), so _C must be
// imported first. Torch references and fake (meta) functions: mtp_core/kernels/.
#include <Python.h>

#include <torch/library.h>

TORCH_LIBRARY(mtp_core, m) {
  // Absorbed MLA decode over a paged latent cache with K+1 causal query tokens per sequence.
  //   q_lat [B, Q, H, R], q_pe [B, Q, H, P], kv_cache [num_blocks, page_size, R + P],
  //   block_table int32 [B, max_blocks], cache_seqlens int32 [B] (counts the Q new tokens),
  //   kv_scale: per-tensor float32 [1] dequant scale for an fp8 cache (real = fp8 * kv_scale).
  //   -> out [B, Q, H, R] (dtype of q_lat), lse float32 [B, H, Q].
  m.def(
      "mla_decode(Tensor q_lat, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
      "Tensor cache_seqlens, float softmax_scale, Tensor? kv_scale=None) -> (Tensor, Tensor)");
  // Weight-only NVFP4 GEMM: x [M, K] @ dequant(weight [N, K/2], weight_scale [N, K/16],
  // weight_scale_2 [1])^T -> [M, N].
  m.def("nvfp4_gemm(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_scale_2) -> Tensor");
  // NVFP4 activation quantization with a per-tensor decode scale -> (packed [M, K/2] uint8,
  // block scales [M, K/16] float8_e4m3fn).
  m.def("nvfp4_quantize(Tensor x, Tensor global_scale) -> (Tensor, Tensor)");
  // RMSNorm over the last dim, fp32 arithmetic: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // Rotary embedding of x [T, ..., D] with float32 cos/sin [T, D/2]; output [rot. x1 | rot. x2] where
  // (x1, x2) are the even/odd (interleave) or first/second-half elements.
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool interleave) -> Tensor");
  // decode_forward, decode_logits, mat_gemm and the DecodeWeights class: csrc/cpu/decode_cpu.cpp.
}

extern "C" const char* mtp_core_cpu_isa();
extern "C" const char* mtp_core_set_cpu_isa(const char* want);
extern "C" int mtp_core_cpu_amx();
extern "C" int mtp_core_cpu_bf16_dot();

static PyObject* cpu_isa(PyObject*, PyObject*) { return PyUnicode_FromString(mtp_core_cpu_isa()); }
static PyObject* set_cpu_isa(PyObject*, PyObject* want) {
  const char* name = PyUnicode_AsUTF8(want);
  if (name == nullptr) return nullptr;   // not a str: TypeError set
  return PyUnicode_FromString(mtp_core_set_cpu_isa(name));
}
static PyObject* cpu_amx(PyObject*, PyObject*) { return PyBool_FromLong(mtp_core_cpu_amx()); }
static PyObject* cpu_bf16_dot(PyObject*, PyObject*) { return PyBool_FromLong(mtp_core_cpu_bf16_dot()); }

// `import mtp_core._C` loads this library and with it the registrations; the module has cpu_isa() and
// set_cpu_isa(name), which Python calls with runtime.cpu_isa (mtp_core/kernels/native.py): C++ reads no
// environment.
PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"cpu_isa", cpu_isa, METH_NOARGS, "The instruction set the native CPU decode kernels use."},
      {"set_cpu_isa", set_cpu_isa, METH_O,
       "Cap the native CPU decode kernels' instruction set (auto, amx, avx512, avx512f, avx2 or generic); returns the "
       "one they use."},
      {"cpu_amx", cpu_amx, METH_NOARGS, "AMX tiles are usable by this process (CPU and kernel)."},
      {"cpu_bf16_dot", cpu_bf16_dot, METH_NOARGS, "The CPU has AVX512-BF16 dot products (and VBMI)."},
      {nullptr, nullptr, 0, nullptr}};
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}
