// The arithmetic of the fused kernels, written once and compiled twice: by g++ into the CPU
// kernels (../cpu/fused_kernels_cpu.cpp) and by nvcc into the CUDA kernels
// (../cuda/fused_kernels.cuh). The CPU parity tests therefore check the formulas the GPU runs;
// what stays per device is the loop structure (warps vs. rows/omp simd), the summation order of
// reductions and the exp/tanh primitives each passes in as `Ops` (CPU: a vectorisable polynomial
// exp; CUDA: __expf, tanhf).
//
// Element types: float, double and, on CPU, c10::Half / c10::BFloat16 (implicit conversions);
// on CUDA __half / __nv_bfloat16, whose conversions torch's extension flags switch off
// (-D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ ...), so every load and
// store goes through to_acc / from_acc, which call the explicit intrinsics there.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MF_HD __host__ __device__ __forceinline__
#else
#define MF_HD inline
#endif

namespace megatron_fused {
namespace math {

// ------------------------------------------------------------------------- conversions
template <typename T>
struct Cvt {  // float, double, c10::Half, c10::BFloat16: plain casts (rounding to nearest even)
  template <typename A> static MF_HD A to(T v) { return static_cast<A>(v); }
  template <typename A> static MF_HD T from(A v) { return static_cast<T>(v); }
};
#if defined(__CUDACC__)
template <>
struct Cvt<__half> {  // A is float for half; a double goes through float
  template <typename A> static __device__ __forceinline__ A to(__half v) { return static_cast<A>(__half2float(v)); }
  template <typename A> static __device__ __forceinline__ __half from(A v) {
    return __float2half_rn(static_cast<float>(v));
  }
};
template <>
struct Cvt<__nv_bfloat16> {
  template <typename A> static __device__ __forceinline__ A to(__nv_bfloat16 v) {
    return static_cast<A>(__bfloat162float(v));
  }
  template <typename A> static __device__ __forceinline__ __nv_bfloat16 from(A v) {
    return __float2bfloat16_rn(static_cast<float>(v));
  }
};
#endif
template <typename A, typename T> MF_HD A to_acc(T v) { return Cvt<T>::template to<A>(v); }
template <typename T, typename A> MF_HD T from_acc(A v) { return Cvt<T>::template from<A>(v); }
// v rounded to the storage type and back: where an eager op would store an intermediate
template <typename T, typename A> MF_HD A round_to(A v) { return to_acc<A>(from_acc<T>(v)); }

// ------------------------------------------------------------------------------ GeLU (tanh)
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluA = 0.044715;

template <typename Ops, typename A>
MF_HD A gelu_fwd(A u) {
  const A c = A(kGeluC), a = A(kGeluA);
  return A(0.5) * u * (A(1) + Ops::tanh(c * u * (A(1) + a * u * u)));
}
template <typename Ops, typename A>
MF_HD A gelu_grad(A u) {
  const A c = A(kGeluC), a = A(kGeluA);
  const A t = Ops::tanh(c * u * (A(1) + a * u * u));
  return A(0.5) * (A(1) + t) + A(0.5) * u * (A(1) - t * t) * c * (A(1) + A(3) * a * u * u);
}

// --------------------------------------------------------------------------------- softmax
// grad_x = scale * y * (g - sum_j g_j y_j); `dot` is that sum over the row.
template <typename A>
MF_HD A softmax_grad(A g, A y, A dot, A scale) { return scale * y * (g - dot); }

// -------------------------------------------------------------------- bias-dropout-add
template <typename A>
MF_HD A dropout_scale(double p) { return A(1) / static_cast<A>(1.0 - p); }  // 1 / (1 - p) in A

// residual + keep * (x + bias) / (1 - p), rounding to T where the eager ops it replaces store
// (after the bias add and after the dropout), so fp16/bf16 results match eager bit for bit.
template <typename T, typename A>
MF_HD T bias_dropout_add(T x, const T* bias, T residual, const bool* keep, A scale) {
  A v = to_acc<A>(x);
  if (bias) v = round_to<T>(v + to_acc<A>(*bias));
  if (keep) v = round_to<T>(*keep ? v * scale : A(0));
  return from_acc<T>(to_acc<A>(residual) + v);
}
template <typename T, typename A>
MF_HD T dropout_grad(T g, bool keep, A scale) { return from_acc<T>(keep ? to_acc<A>(g) * scale : A(0)); }

// ------------------------------------------------------------------- attention dropout hash
// keep(h, i, j) from a counter-based hash of (seed, head, global query, global key): the backward
// pass and a recomputation redraw the same mask on either device, whatever the thread layout.
MF_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
MF_HD bool dropout_keep(uint64_t seed, int64_t h, int64_t qi, int64_t kj, uint32_t threshold) {
  const uint64_t z = mix64(seed + 0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(h) + 1) +
                           0xd1b54a32d192ed03ULL * static_cast<uint64_t>(qi) +
                           0x8cb92ba72f3d8dd7ULL * static_cast<uint64_t>(kj));
  return static_cast<uint32_t>(z >> 40) >= threshold;  // 24 uniform bits
}
MF_HD uint32_t dropout_threshold(double p) { return static_cast<uint32_t>(p * double(1 << 24)); }

// -------------------------------------------------------------------- attention backward
// dS_ij = P_ij * (dP_ij * Z_ij - D_i) * scale, with D_i = rowsum(dO * O) and Z the dropout
// factor (1 without dropout): O = (P * Z) V, so dP = (dO V^T) * Z.
template <typename A>
MF_HD A attention_ds(A p, A dp, A z, A d, A scale) { return p * (dp * z - d) * scale; }
template <typename A>
MF_HD A attention_ds(A p, A dp, A d, A scale) { return p * (dp - d) * scale; }  // no dropout

// Segment holding token t: largest s with cu[s] <= t (cu has nseg + 1 non-decreasing entries).
MF_HD int64_t find_segment(const int64_t* cu, int64_t nseg, int64_t t) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}
// Last key (0-based in the segment) that query i of a segment with lq queries and lk keys sees:
// causal masks are bottom-right aligned as flash-attention's (lq == lk is the usual triangle).
MF_HD int64_t last_visible_key(int64_t i, int64_t lq, int64_t lk, bool causal) {
  return causal ? i + (lk - lq) : lk - 1;
}

}  // namespace math
}  // namespace megatron_fused
