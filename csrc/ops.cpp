// fastbert._C: the op schemas (namespace fastbert_C) and a tiny Python module that says how it was built.
// Kernels register their implementations in their own files (TORCH_LIBRARY_IMPL); the Python side
// (fastbert/ops/*.py) wraps them in custom ops with fake implementations and autograd.
#include <Python.h>
#include <torch/library.h>

#include "cpu/vec.h"

TORCH_LIBRARY(fastbert_C, m) {
  // out-variants: Python allocates `out` (poisoned under test) and the kernel fills it.
  m.def("bias_gelu_fwd(Tensor x, Tensor bias, bool tanh, Tensor(a!) out) -> ()");
  m.def("bias_gelu_bwd(Tensor grad, Tensor x, Tensor bias, bool tanh, Tensor(a!) grad_x) -> ()");
  // mean and rstd: float32 [rows]; grad_weight and grad_bias: float32 [N].
  // LayerNorm(dropout(x) + residual); grad_x is written only when dropout_p > 0 (else it is grad_h).
  m.def("add_layer_norm_fwd(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps, float dropout_p, "
        "int seed, Tensor(a!) out, Tensor(b!) mean, Tensor(c!) rstd) -> ()");
  m.def("add_layer_norm_bwd(Tensor grad, Tensor x, Tensor residual, Tensor weight, Tensor mean, Tensor rstd, "
        "float dropout_p, int seed, Tensor(a!) grad_h, Tensor(b!) grad_x, Tensor(c!) grad_weight, "
        "Tensor(d!) grad_bias) -> ()");
  // Inference, CPU: the forward's output and its per-row uint8 quantization (as quantize_rows below).
  m.def("add_layer_norm_quantize(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps, Tensor(a!) out, "
        "Tensor(b!) q, Tensor(c!) q_scale, Tensor(d!) q_zero_point) -> ()");
  // q, k, v: [B, heads, S, d] with key_mask bool [B, S], or [T, heads, d] with cu_seqlens [B + 1];
  // any strides with a contiguous head dimension. lse: float32 [B, heads, S] or [heads, T].
  // dropout_p on the probabilities, with keep decisions hashed from `seed` (backward regenerates them).
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? cu_seqlens, float scale, "
        "float dropout_p, int seed, Tensor(a!) out, Tensor(b!) lse) -> ()");
  // attention_fwd / _bwd in bfloat16 with their products on ATen's brgemm (AMX where the CPU has it).
  m.def("attention_fwd_brgemm(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? cu_seqlens, float scale, "
        "float dropout_p, int seed, Tensor(a!) out, Tensor(b!) lse) -> ()");
  // attention_fwd in bfloat16 with its products on AMX tiles programmed in fastbert (no library call per tile).
  m.def("attention_fwd_amx(Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? cu_seqlens, float scale, "
        "float dropout_p, int seed, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("attention_bwd_brgemm(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_mask, "
        "Tensor? cu_seqlens, float scale, float dropout_p, int seed, Tensor(a!) dq, Tensor(b!) dk, "
        "Tensor(c!) dv) -> ()");
  m.def("attention_bwd(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_mask, "
        "Tensor? cu_seqlens, float scale, float dropout_p, int seed, Tensor(a!) dq, Tensor(b!) dk, "
        "Tensor(c!) dv) -> ()");
  // int8 GEMM companions (CPU): x [rows, k] -> u8 q, float32 scale [rows], int32 zero_point [rows]; and
  // out = act(scale * (acc - zero_point * wsum) + bias), activation 0 none, 1 gelu, 2 gelu_tanh.
  m.def("quantize_rows(Tensor x, Tensor(a!) q, Tensor(b!) scale, Tensor(c!) zero_point) -> ()");
  m.def("quantize_tensor(Tensor x, float scale, int zero_point, Tensor(a!) q) -> ()");  // one scale for all rows
  m.def("dequantize_rows(Tensor acc, Tensor scale, Tensor zero_point, Tensor wsum, Tensor? bias, int activation, "
        "Tensor(a!) out) -> ()");
  // dequantize_rows, then quantize_rows of the result, without writing the float result.
  m.def("requantize_rows(Tensor acc, Tensor scale, Tensor zero_point, Tensor wsum, Tensor? bias, int activation, "
        "Tensor(a!) q, Tensor(b!) q_scale, Tensor(c!) q_zero_point) -> ()");
  // fastbert's own int8 GEMM: weight int8 [n, k] -> packed int8 [ceil(n/16), ceil(k/4), 16, 4] (padding zero);
  // out[m, n] = weight_scale[n] * float(sum_k q[m, k] * weight[n, k]) for q uint8 [m, k], the int32 sum exact;
  // n, k: the packed weight's shape. isa: 0 the best this CPU has, 1 portable C++, 2 AVX-VNNI (256-bit),
  // 3 AVX512-VNNI, 4 AVX2 without VNNI (int16 pairs).
  m.def("int8_pack(Tensor weight) -> Tensor");
  m.def("int8_matmul(Tensor q, Tensor packed, int n, int k, Tensor weight_scale, int isa, Tensor(a!) out) -> ()");
  // int8_matmul with dequantize_rows applied to each tile while it is in cache (out float32 or bfloat16).
  m.def("int8_matmul_dequantize(Tensor q, Tensor packed, int n, int k, Tensor weight_scale, Tensor scale, "
        "Tensor zero_point, Tensor wsum, Tensor? bias, int activation, int isa, Tensor(a!) out) -> ()");
  m.def("int8_isa_supported(int isa) -> bool");  // whether int8_matmul runs with this isa here
  // fastbert's own float32 / bfloat16 GEMM: weight [n, k] -> packed [ceil(n/16), ceil(k/p), 16, p] in its dtype
  // (p = 1 float32, 2 bfloat16; padding zero); out[m, n] = act(x @ weight^T + bias) in x's dtype, the sums in
  // float32, activation 0 none, 1 gelu, 2 gelu_tanh; n, k: the weight's shape. isa: 0 the best this CPU has,
  // 1 portable C++, 2 AVX-512 (avx512f; avx512_bf16 for bfloat16).
  m.def("dense_pack(Tensor weight) -> Tensor");
  m.def("dense_gemm(Tensor x, Tensor packed, int n, int k, Tensor? bias, int activation, int isa, "
        "Tensor(a!) out) -> ()");
  m.def("dense_isa_supported(int isa, ScalarType dtype) -> bool");  // whether dense_gemm runs so here
  // torch's oneDNN linear (mkldnn::_linear_pointwise, its arguments) on each thread's share of the rows.
  m.def("dense_onednn_rows(Tensor x, Tensor weight, Tensor? bias, str attr, str? algorithm, Tensor(a!) out) -> ()");
  // Inference, CPU: one encoder layer in one call (csrc/cpu/encoder_layer.cpp; fastbert/ops/encoder_layer.py).
  m.def("encoder_layer(Tensor x, Tensor? rows_q, Tensor? rows_scale, Tensor? rows_zero_point, Tensor? key_mask, "
        "Tensor? cu_seqlens, int batch, int seq, Tensor?[] weights, int[] codes, float eps, bool quantize_output) "
        "-> Tensor[]");
  m.def("dropout_keep(int seed, float dropout_p, int sequences, int heads, int rows, int cols) -> Tensor");
}

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "fastbert's compiled kernels", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
#ifdef FASTBERT_WITH_CUDA
  PyModule_AddObjectRef(m, "WITH_CUDA", Py_True);
#else
  PyModule_AddObjectRef(m, "WITH_CUDA", Py_False);
#endif
  // bfloat16 attention multiplies bfloat16 pairs (_mm512_dpbf16_ps) instead of fp32 copies.
#ifdef FASTBERT_AVX512_BF16
  PyModule_AddObjectRef(m, "AVX512_BF16", Py_True);
#else
  PyModule_AddObjectRef(m, "AVX512_BF16", Py_False);
#endif
#ifdef CPU_CAPABILITY
#define FASTBERT_STR2(x) #x
#define FASTBERT_STR(x) FASTBERT_STR2(x)
  PyModule_AddStringConstant(m, "CPU_CAPABILITY", FASTBERT_STR(CPU_CAPABILITY));
#else
  PyModule_AddStringConstant(m, "CPU_CAPABILITY", "DEFAULT");
#endif
  return m;
}
