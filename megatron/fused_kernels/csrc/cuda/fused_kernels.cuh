// CUDA kernels of megatron_fused as plain templates over raw pointers (no ATen), so nvcc can
// compile-check them without a CUDA build of torch; fused_kernels_cuda.cu holds the thin ATen
// launchers. T is float, double, __half or __nv_bfloat16; arithmetic is in Acc<T> (float, or
// double for double). Semantics match the CPU kernels in ../cpu/fused_kernels_cpu.cpp,
// including the dropout hash, so CPU and CUDA draw the same attention-dropout mask.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace megatron_fused {

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
    if (keep(j)) { A v = static_cast<A>(xr[j]) * scale; m = v > m ? v : m; }
  m = warp_max(m);
  if (m == neg_inf<A>()) {
    for (int64_t j = lane; j < n; j += kWarp) yr[j] = static_cast<T>(A(0));
    return;
  }
  A s = 0;
  for (int64_t j = lane; j < n; j += kWarp)
    if (keep(j)) s += exp_a(static_cast<A>(xr[j]) * scale - m);
  s = warp_sum(s);
  const A inv = A(1) / s;
  for (int64_t j = lane; j < n; j += kWarp)
    yr[j] = static_cast<T>(keep(j) ? exp_a(static_cast<A>(xr[j]) * scale - m) * inv : A(0));
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
  for (int64_t j = threadIdx.x; j < n; j += kWarp) dot += static_cast<A>(gr[j]) * static_cast<A>(yr[j]);
  dot = warp_sum(dot);
  for (int64_t j = threadIdx.x; j < n; j += kWarp)
    gx[r * n + j] = static_cast<T>(scale * static_cast<A>(yr[j]) * (static_cast<A>(gr[j]) - dot));
}

// --------------------------------------------------------------------------------- bias-GeLU
template <typename A>
__device__ __forceinline__ void gelu_and_grad(A u, A* f, A* df) {
  const A c = A(0.7978845608028654), a = A(0.044715);
  const A t = tanh_a(c * u * (A(1) + a * u * u));
  if (f) *f = A(0.5) * u * (A(1) + t);
  if (df) *df = A(0.5) * (A(1) + t) + A(0.5) * u * (A(1) - t * t) * c * (A(1) + A(3) * a * u * u);
}

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         int64_t numel, int64_t h) {
  using A = typename Acc<T>::type;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x) {
    A f;
    gelu_and_grad<A>(static_cast<A>(x[k]) + static_cast<A>(bias[k % h]), &f, nullptr);
    y[k] = static_cast<T>(f);
  }
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ bias,
                                          T* __restrict__ gx, int64_t numel, int64_t h) {
  using A = typename Acc<T>::type;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x) {
    A df;
    gelu_and_grad<A>(static_cast<A>(x[k]) + static_cast<A>(bias[k % h]), nullptr, &df);
    gx[k] = static_cast<T>(static_cast<A>(g[k]) * df);
  }
}

// ------------------------------------------------------------------------- bias-dropout-add
// y = residual + keep * (x + bias) / (1 - p); bias and keep may be null.
template <typename T>
__global__ void bias_dropout_add_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                        const T* __restrict__ residual, const bool* __restrict__ keep,
                                        T* __restrict__ y, int64_t numel, int64_t h, typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x) {
    A v = static_cast<A>(x[k]);
    if (bias) v += static_cast<A>(bias[k % h]);
    if (keep) v = keep[k] ? v * scale : A(0);
    y[k] = static_cast<T>(static_cast<A>(residual[k]) + v);
  }
}

template <typename T>
__global__ void dropout_backward_kernel(const T* __restrict__ g, const bool* __restrict__ keep, T* __restrict__ gx,
                                        int64_t numel, typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < numel; k += (int64_t)gridDim.x * blockDim.x)
    gx[k] = static_cast<T>(keep[k] ? static_cast<A>(g[k]) * scale : A(0));
}

// ------------------------------------------------------------------ variable-length attention
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
__device__ __forceinline__ bool dropout_keep(uint64_t seed, int64_t h, int64_t qi, int64_t kj, uint32_t threshold) {
  const uint64_t z = mix64(seed + 0x9e3779b97f4a7c15ULL * ((uint64_t)h + 1) + 0xd1b54a32d192ed03ULL * (uint64_t)qi +
                           0x8cb92ba72f3d8dd7ULL * (uint64_t)kj);
  return (uint32_t)(z >> 40) >= threshold;
}

// The segment holding token t: largest s with cu[s] <= t (cu has nseg + 1 entries).
__device__ __forceinline__ int64_t find_segment(const int64_t* cu, int64_t nseg, int64_t t) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct VarlenParams {
  int64_t total_q, heads, dim, nseg;
  const int64_t* cu_q;
  const int64_t* cu_k;
  double scale;
  bool causal;
  uint32_t dropout_threshold;  // 0 = no dropout
  double dropout_scale;        // 1 / (1 - p)
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
  const int64_t last = p.causal ? (qi - q0) + (lk - lq) : lk - 1;
  A qr[kPerLane], acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    qr[e] = d < p.dim ? static_cast<A>(q[(qi * p.heads + h) * p.dim + d]) : A(0);
    acc[e] = 0;
  }
  A m = neg_inf<A>(), l = 0;
  for (int64_t j = 0; j <= last && j < lk; ++j) {
    const int64_t kj = k0 + j;
    const T* kr = k + (kj * p.heads + h) * p.dim;
    const T* vr = v + (kj * p.heads + h) * p.dim;
    A dot = 0;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t d = lane + e * kWarp;
      if (d < p.dim) dot += qr[e] * static_cast<A>(kr[d]);
    }
    const A sc = warp_sum(dot) * static_cast<A>(p.scale);
    const A mn = sc > m ? sc : m;
    const A corr = exp_a(m - mn), pe = exp_a(sc - mn);
    l = l * corr + pe;
    A w = pe;
    if (p.dropout_threshold) w = dropout_keep(p.seed, h, qi, kj, p.dropout_threshold) ? pe * A(p.dropout_scale) : A(0);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t d = lane + e * kWarp;
      acc[e] = acc[e] * corr + (d < p.dim ? w * static_cast<A>(vr[d]) : A(0));
    }
    m = mn;
  }
  const bool any = l > A(0);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < p.dim) out[(qi * p.heads + h) * p.dim + d] = static_cast<T>(any ? acc[e] / l : A(0));
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
  const int64_t last = p.causal ? (qi - q0) + (lk - lq) : lk - 1;
  const int64_t base = (qi * p.heads + h) * p.dim;
  const A li = lse[h * p.total_q + qi];
  A qr[kPerLane], gr[kPerLane], dqr[kPerLane];
  A dd = 0;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    qr[e] = d < p.dim ? static_cast<A>(q[base + d]) : A(0);
    gr[e] = d < p.dim ? static_cast<A>(go[base + d]) : A(0);
    dd += d < p.dim ? gr[e] * static_cast<A>(out[base + d]) : A(0);
    dqr[e] = 0;
  }
  dd = warp_sum(dd);  // D_i = rowsum(dO * O)
  if (li != neg_inf<A>()) {
    for (int64_t j = 0; j <= last && j < lk; ++j) {
      const int64_t kj = k0 + j, kb = (kj * p.heads + h) * p.dim;
      A dot = 0, dpv = 0;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < p.dim) {
          dot += qr[e] * static_cast<A>(k[kb + d]);
          dpv += gr[e] * static_cast<A>(v[kb + d]);
        }
      }
      const A pr = exp_a(warp_sum(dot) * static_cast<A>(p.scale) - li);
      A z = A(1);
      if (p.dropout_threshold) z = dropout_keep(p.seed, h, qi, kj, p.dropout_threshold) ? A(p.dropout_scale) : A(0);
      const A ds = pr * (warp_sum(dpv) * z - dd) * static_cast<A>(p.scale);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < p.dim) {
          dqr[e] += ds * static_cast<A>(k[kb + d]);
          atomicAdd(dk + kb + d, ds * qr[e]);
          atomicAdd(dv + kb + d, pr * z * gr[e]);
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < p.dim) dq[base + d] = static_cast<T>(dqr[e]);
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
                                                               A(1) / A(1.0 - p));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dropout_backward(const T* g, const bool* keep, T* gx, int64_t numel, double p, cudaStream_t st) {
  if (numel == 0) return cudaSuccess;
  using A = typename Acc<T>::type;
  dropout_backward_kernel<T><<<grid_1d(numel), 256, 0, st>>>(g, keep, gx, numel, A(1) / A(1.0 - p));
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
