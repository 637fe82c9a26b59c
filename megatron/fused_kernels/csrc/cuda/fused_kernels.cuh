// CUDA kernels of megatron_fused as plain templates over raw pointers (no ATen), so nvcc can
// compile-check them without a CUDA build of torch; fused_kernels_cuda.cu holds the thin ATen
// launchers. T is float, double, __half or __nv_bfloat16; arithmetic is in Acc<T> (float, or
// double for double). The formulas (GeLU and its derivative, softmax and attention gradients,
// bias-dropout-add with eager's roundings, the dropout hash) come from ../common/fused_math.h,
// which the CPU kernels compile too; here only the parallel layout (one warp per row), the
// reduction order and the exp/tanh primitives (CudaOps) differ. Loads and stores go through
// math::to_acc / math::from_acc: torch builds extensions with -D__CUDA_NO_HALF_CONVERSIONS__ and
// -D__CUDA_NO_BFLOAT16_CONVERSIONS__, which switch off __half's and __nv_bfloat16's implicit casts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/fused_math.h"

namespace megatron_fused {

using math::from_acc;
using math::to_acc;

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

constexpr int kWarp = 32;

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename A>
__device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    A w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}
template <typename A> __device__ __forceinline__ A neg_inf() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ float exp_a(float x) { return __expf(x); }
__device__ __forceinline__ double exp_a(double x) { return exp(x); }
__device__ __forceinline__ float tanh_a(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_a(double x) { return tanh(x); }
__device__ __forceinline__ float log_a(float x) { return logf(x); }
__device__ __forceinline__ double log_a(double x) { return log(x); }

struct CudaOps {  // the primitives fused_math.h's formulas call on the GPU
  static __device__ __forceinline__ float tanh(float x) { return tanhf(x); }
  static __device__ __forceinline__ double tanh(double x) { return ::tanh(x); }
};

// ------------------------------------------------------------------------------------ softmax
// One warp per row of n scores. Row r covers (batch b, head, query i) with r = (b*heads + head)*sq + i.
// kCausal: column j kept iff j <= i. mask (may be null): bool [mask_batch, 1, sq, n], true = masked.
// Rows with nothing kept are written as zeros.
template <typename T, bool kCausal>
__global__ void softmax_forward_kernel(const T* __restrict__ x, const bool* __restrict__ mask, T* __restrict__ y,
                                       int64_t rows, int64_t sq, int64_t n, int64_t heads, int64_t mask_batch,
                                       typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  const int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= rows) return;
  const int lane = threadIdx.x;
  const int64_t i = r % sq, b = r / (heads * sq);
  const T* xr = x + r * n;
  T* yr = y + r * n;
  const bool* mr = mask ? mask + ((mask_batch == 1 ? 0 : b) * sq + i) * n : nullptr;
  auto keep = [&](int64_t j) { return kCausal ? j <= i : (mr ? !mr[j] : true); };
  A m = neg_inf<A>();
  for (int64_t j = lane; j < n; j += kWarp)
    if (keep(j)) { A v = to_acc<A>(xr[j]) * scale; m = v > m ? v : m; }
  m = warp_max(m);
  if (m == neg_inf<A>()) {
    for (int64_t j = lane; j < n; j += kWarp) yr[j] = from_acc<T>(A(0));
    return;
  }
  A s = 0;
  for (int64_t j = lane; j < n; j += kWarp)
    if (keep(j)) s += exp_a(to_acc<A>(xr[j]) * scale - m);
  s = warp_sum(s);
  const A inv = A(1) / s;
  for (int64_t j = lane; j < n; j += kWarp)
    yr[j] = from_acc<T>(keep(j) ? exp_a(to_acc<A>(xr[j]) * scale - m) * inv : A(0));
}

// grad_x = scale * y * (g - sum_j g_j y_j); one warp per row.
template <typename T>
__global__ void softmax_backward_kernel(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ gx,
                                        int64_t rows, int64_t n, typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  const int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= rows) return;
  const T* gr = g + r * n;
  const T* yr = y + r * n;
  A dot = 0;
  for (int64_t j = threadIdx.x; j < n; j += kWarp) dot += to_acc<A>(gr[j]) * to_acc<A>(yr[j]);
  dot = warp_sum(dot);
  for (int64_t j = threadIdx.x; j < n; j += kWarp)
    gx[r * n + j] = from_acc<T>(math::softmax_grad(to_acc<A>(gr[j]), to_acc<A>(yr[j]), dot, scale));
}

// --------------------------------------------------------------------------------- bias-GeLU
template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         int64_t numel, int64_t h) {
  using A = typename Acc<T>::type;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x) {
    y[k] = from_acc<T>(math::gelu_fwd<CudaOps, A>(to_acc<A>(x[k]) + to_acc<A>(bias[k % h])));
  }
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ bias,
                                          T* __restrict__ gx, int64_t numel, int64_t h) {
  using A = typename Acc<T>::type;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x) {
    gx[k] = from_acc<T>(to_acc<A>(g[k]) * math::gelu_grad<CudaOps, A>(to_acc<A>(x[k]) + to_acc<A>(bias[k % h])));
  }
}

// ------------------------------------------------------------------------- bias-dropout-add
// y = residual + keep * (x + bias) / (1 - p); bias and keep may be null (math::bias_dropout_add).
template <typename T>
__global__ void bias_dropout_add_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                        const T* __restrict__ residual, const bool* __restrict__ keep,
                                        T* __restrict__ y, int64_t numel, int64_t h, typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x)
    y[k] = math::bias_dropout_add<T, A>(x[k], bias ? bias + k % h : nullptr, residual[k], keep ? keep + k : nullptr,
                                        scale);
}

template <typename T>
__global__ void dropout_backward_kernel(const T* __restrict__ g, const bool* __restrict__ keep, T* __restrict__ gx,
                                        int64_t numel, typename Acc<T>::type scale) {
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x)
    gx[k] = math::dropout_grad<T>(g[k], keep[k], scale);
}

// ------------------------------------------------------------------ variable-length attention
using math::dropout_keep;
using math::find_segment;

struct VarlenParams {
  int64_t total_q, heads, dim, nseg;
  const int64_t* cu_q;
  const int64_t* cu_k;
  double scale;
  bool causal;
  uint32_t dropout_threshold;  // 0 = no dropout (math::dropout_threshold(p))
  double dropout_p;
  uint64_t seed;
};

// One warp per (query token, head); kPerLane = ceil(dim / 32) values of q and of the output per
// lane. Online softmax over the visible keys of the query's segment. q: [total_q, h, d],
// k, v: [total_k, h, d], out like q, lse: [h, total_q] in Acc<T>.
template <typename T, int kPerLane>
__global__ void varlen_forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                      T* __restrict__ out, typename Acc<T>::type* __restrict__ lse, VarlenParams p) {
  using A = typename Acc<T>::type;
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= p.total_q * p.heads) return;
  const int64_t qi = row / p.heads, h = row % p.heads;
  const int lane = threadIdx.x;
  const int64_t s = find_segment(p.cu_q, p.nseg, qi);
  const int64_t q0 = p.cu_q[s], lq = p.cu_q[s + 1] - q0, k0 = p.cu_k[s], lk = p.cu_k[s + 1] - k0;
  const int64_t last = math::last_visible_key(qi - q0, lq, lk, p.causal);
  A qr[kPerLane], acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    qr[e] = d < p.dim ? to_acc<A>(q[(qi * p.heads + h) * p.dim + d]) : A(0);
    acc[e] = 0;
  }
  const A zk = math::dropout_scale<A>(p.dropout_p);
  A m = neg_inf<A>(), l = 0;
  for (int64_t j = 0; j <= last && j < lk; ++j) {
    const int64_t kj = k0 + j;
    const T* kr = k + (kj * p.heads + h) * p.dim;
    const T* vr = v + (kj * p.heads + h) * p.dim;
    A dot = 0;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t d = lane + e * kWarp;
      if (d < p.dim) dot += qr[e] * to_acc<A>(kr[d]);
    }
    const A sc = warp_sum(dot) * static_cast<A>(p.scale);
    const A mn = sc > m ? sc : m;
    const A corr = exp_a(m - mn), pe = exp_a(sc - mn);
    l = l * corr + pe;
    A w = pe;
    if (p.dropout_threshold) w = dropout_keep(p.seed, h, qi, kj, p.dropout_threshold) ? pe * zk : A(0);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t d = lane + e * kWarp;
      acc[e] = acc[e] * corr + (d < p.dim ? w * to_acc<A>(vr[d]) : A(0));
    }
    m = mn;
  }
  const bool any = l > A(0);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < p.dim) out[(qi * p.heads + h) * p.dim + d] = from_acc<T>(any ? acc[e] / l : A(0));
  }
  if (lane == 0) lse[h * p.total_q + qi] = any ? m + log_a(l) : neg_inf<A>();
}

// Backward, one warp per (query token, head): dq in registers; dk, dv accumulated atomically
// into Acc<T> buffers [total_k, h, d] (the launcher converts them).
template <typename T, int kPerLane>
__global__ void varlen_backward_kernel(const T* __restrict__ go, const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const T* __restrict__ out,
                                       const typename Acc<T>::type* __restrict__ lse, T* __restrict__ dq,
                                       typename Acc<T>::type* __restrict__ dk, typename Acc<T>::type* __restrict__ dv,
                                       VarlenParams p) {
  using A = typename Acc<T>::type;
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= p.total_q * p.heads) return;
  const int64_t qi = row / p.heads, h = row % p.heads;
  const int lane = threadIdx.x;
  const int64_t s = find_segment(p.cu_q, p.nseg, qi);
  const int64_t q0 = p.cu_q[s], lq = p.cu_q[s + 1] - q0, k0 = p.cu_k[s], lk = p.cu_k[s + 1] - k0;
  const int64_t last = math::last_visible_key(qi - q0, lq, lk, p.causal);
  const int64_t base = (qi * p.heads + h) * p.dim;
  const A li = lse[h * p.total_q + qi];
  A qr[kPerLane], gr[kPerLane], dqr[kPerLane];
  A dd = 0;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    qr[e] = d < p.dim ? to_acc<A>(q[base + d]) : A(0);
    gr[e] = d < p.dim ? to_acc<A>(go[base + d]) : A(0);
    dd += d < p.dim ? gr[e] * to_acc<A>(out[base + d]) : A(0);
    dqr[e] = 0;
  }
  dd = warp_sum(dd);  // D_i = rowsum(dO * O)
  const A zk = math::dropout_scale<A>(p.dropout_p);
  if (li != neg_inf<A>()) {
    for (int64_t j = 0; j <= last && j < lk; ++j) {
      const int64_t kj = k0 + j, kb = (kj * p.heads + h) * p.dim;
      A dot = 0, dpv = 0;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < p.dim) {
          dot += qr[e] * to_acc<A>(k[kb + d]);
          dpv += gr[e] * to_acc<A>(v[kb + d]);
        }
      }
      const A pr = exp_a(warp_sum(dot) * static_cast<A>(p.scale) - li);
      A z = A(1);
      if (p.dropout_threshold) z = dropout_keep(p.seed, h, qi, kj, p.dropout_threshold) ? zk : A(0);
      const A ds = math::attention_ds(pr, warp_sum(dpv), z, dd, static_cast<A>(p.scale));
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < p.dim) {
          dqr[e] += ds * to_acc<A>(k[kb + d]);
          atomicAdd(dk + kb + d, ds * qr[e]);
          atomicAdd(dv + kb + d, pr * z * gr[e]);
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < p.dim) dq[base + d] = from_acc<T>(dqr[e]);
  }
}

// ------------------------------------------------------------------------ host-side launchers
// Raw-pointer launchers (the ATen file only unpacks tensors and picks T). All return the launch error.
inline int64_t blocks_for(int64_t n, int64_t per_block) { return (n + per_block - 1) / per_block; }
inline unsigned grid_1d(int64_t n) {
  const int64_t b = blocks_for(n, 256);
  return (unsigned)(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

template <typename T>
cudaError_t launch_softmax_forward(const T* x, const bool* mask, T* y, int64_t rows, int64_t sq, int64_t sk,
                                   int64_t heads, int64_t mask_batch, double scale, bool causal, cudaStream_t st) {
  if (rows == 0) return cudaSuccess;
  const dim3 block(kWarp, 4), grid((unsigned)blocks_for(rows, 4));
  using A = typename Acc<T>::type;
  if (causal)
    softmax_forward_kernel<T, true><<<grid, block, 0, st>>>(x, nullptr, y, rows, sq, sk, heads, 1, A(scale));
  else
    softmax_forward_kernel<T, false><<<grid, block, 0, st>>>(x, mask, y, rows, sq, sk, heads, mask_batch, A(scale));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_softmax_backward(const T* g, const T* y, T* gx, int64_t rows, int64_t n, double scale,
                                    cudaStream_t st) {
  if (rows == 0) return cudaSuccess;
  softmax_backward_kernel<T><<<dim3((unsigned)blocks_for(rows, 4)), dim3(kWarp, 4), 0, st>>>(
      g, y, gx, rows, n, typename Acc<T>::type(scale));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bias_gelu(const T* g, const T* x, const T* bias, T* out, int64_t numel, int64_t h, bool backward,
                             cudaStream_t st) {
  if (numel == 0) return cudaSuccess;
  if (backward)
    bias_gelu_backward_kernel<T><<<grid_1d(numel), 256, 0, st>>>(g, x, bias, out, numel, h);
  else
    bias_gelu_forward_kernel<T><<<grid_1d(numel), 256, 0, st>>>(x, bias, out, numel, h);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bias_dropout_add(const T* x, const T* bias, const T* residual, const bool* keep, T* y,
                                    int64_t numel, int64_t h, double p, cudaStream_t st) {
  if (numel == 0) return cudaSuccess;
  using A = typename Acc<T>::type;
  bias_dropout_add_kernel<T><<<grid_1d(numel), 256, 0, st>>>(x, bias, residual, keep, y, numel, h,
                                                               math::dropout_scale<A>(p));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dropout_backward(const T* g, const bool* keep, T* gx, int64_t numel, double p, cudaStream_t st) {
  if (numel == 0) return cudaSuccess;
  using A = typename Acc<T>::type;
  dropout_backward_kernel<T><<<grid_1d(numel), 256, 0, st>>>(g, keep, gx, numel, math::dropout_scale<A>(p));
  return cudaGetLastError();
}

// kPerLane chosen from the head size (<= 256).
template <typename T>
cudaError_t launch_varlen_forward(const T* q, const T* k, const T* v, T* out, typename Acc<T>::type* lse,
                                  const VarlenParams& p, cudaStream_t st) {
  const int64_t rows = p.total_q * p.heads;
  if (rows == 0) return cudaSuccess;
  const dim3 block(kWarp, 4), grid((unsigned)blocks_for(rows, 4));
  if (p.dim <= 32) varlen_forward_kernel<T, 1><<<grid, block, 0, st>>>(q, k, v, out, lse, p);
  else if (p.dim <= 64) varlen_forward_kernel<T, 2><<<grid, block, 0, st>>>(q, k, v, out, lse, p);
  else if (p.dim <= 128) varlen_forward_kernel<T, 4><<<grid, block, 0, st>>>(q, k, v, out, lse, p);
  else if (p.dim <= 256) varlen_forward_kernel<T, 8><<<grid, block, 0, st>>>(q, k, v, out, lse, p);
  else return cudaErrorInvalidValue;
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_varlen_backward(const T* go, const T* q, const T* k, const T* v, const T* out,
                                   const typename Acc<T>::type* lse, T* dq, typename Acc<T>::type* dk,
                                   typename Acc<T>::type* dv, const VarlenParams& p, cudaStream_t st) {
  const int64_t rows = p.total_q * p.heads;
  if (rows == 0) return cudaSuccess;
  const dim3 block(kWarp, 4), grid((unsigned)blocks_for(rows, 4));
  if (p.dim <= 32) varlen_backward_kernel<T, 1><<<grid, block, 0, st>>>(go, q, k, v, out, lse, dq, dk, dv, p);
  else if (p.dim <= 64) varlen_backward_kernel<T, 2><<<grid, block, 0, st>>>(go, q, k, v, out, lse, dq, dk, dv, p);
  else if (p.dim <= 128) varlen_backward_kernel<T, 4><<<grid, block, 0, st>>>(go, q, k, v, out, lse, dq, dk, dv, p);
  else if (p.dim <= 256) varlen_backward_kernel<T, 8><<<grid, block, 0, st>>>(go, q, k, v, out, lse, dq, dk, dv, p);
  else return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace megatron_fused
