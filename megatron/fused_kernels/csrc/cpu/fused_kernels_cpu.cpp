// CPU implementations of the fused kernels (registered as torch.ops.megatron_fused.*).
//
// * scaled upper-triangular (causal) softmax and scaled masked softmax, forward and backward;
// * bias + GeLU (tanh approximation) forward and backward;
// * bias + dropout + residual add forward and backward (the keep-mask comes from Python, drawn
//   from the generator the caller chooses, so activation recomputation replays it);
// * variable-length attention over packed rows (segments given by cu_seqlens), causal,
//   non-causal and cross-attention, forward (returns the log-sum-exp) and backward.
//
// Rows / (segment, head) pairs are spread over threads with at::parallel_for. Inner loops are
// branch-free float loops vectorised with `omp simd` (which also lets reductions reassociate);
// exp() for float is a polynomial that vectorises (double keeps std::exp so float64 gradcheck
// sees exact derivatives).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/fused_math.h"

namespace {

namespace fm = megatron_fused::math;

// ---------------------------------------------------------------------------------------------
// Vectorisable exp / tanh.
inline float fast_exp(float x) {
  // exp(x) = 2^n * exp(r), r in [-ln2/2, ln2/2]; degree-6 polynomial (rel. error ~2e-7).
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  // round to nearest with the 1.5 * 2^23 trick (roundf() would be a library call and stop vectorisation)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof(bits));
  return p;
}
inline double fast_exp(double x) { return std::exp(x); }

template <typename T>
inline T exp_or_zero(T x) {  // exp(-inf) = 0 (the clamp in fast_exp would give a tiny number)
  return x == -std::numeric_limits<T>::infinity() ? T(0) : fast_exp(x);
}

template <typename T>
inline T tanh_v(T u) {  // tanh(u) = 1 - 2 / (exp(2u) + 1); exact at the tails
  return T(1) - T(2) / (fast_exp(T(2) * u) + T(1));
}
inline double tanh_v(double u) { return std::tanh(u); }

struct CpuOps {  // the primitives fused_math.h's formulas call on CPU
  template <typename T> static inline T tanh(T u) { return tanh_v(u); }
};

// ---------------------------------------------------------------------------------------------
// Softmax over one row of n scores; `keep(j)` says whether column j takes part.
// Rows with no kept column become all zeros.
template <typename scalar_t, typename acc_t, typename Keep>
inline void softmax_row(const scalar_t* x, scalar_t* y, int64_t n, acc_t scale, acc_t* buf, Keep keep) {
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  acc_t m = ninf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) {
    acc_t v = keep(j) ? static_cast<acc_t>(x[j]) * scale : ninf;
    buf[j] = v;
    m = v > m ? v : m;
  }
  if (m == ninf) {
    for (int64_t j = 0; j < n; ++j) y[j] = scalar_t(0);
    return;
  }
  acc_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    acc_t e = exp_or_zero(buf[j] - m);
    buf[j] = e;
    s += e;
  }
  const acc_t inv = acc_t(1) / s;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = static_cast<scalar_t>(buf[j] * inv);
}

// grad_x = scale * y * (g - sum(g * y)) along the row (masked entries have y = 0).
template <typename scalar_t, typename acc_t>
inline void softmax_backward_row(const scalar_t* g, const scalar_t* y, scalar_t* gx, int64_t n, acc_t scale) {
  acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < n; ++j) dot += static_cast<acc_t>(g[j]) * static_cast<acc_t>(y[j]);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    gx[j] = static_cast<scalar_t>(fm::softmax_grad(static_cast<acc_t>(g[j]), static_cast<acc_t>(y[j]), dot, scale));
}

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": expected a CPU tensor");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), what, ": expected a floating-point tensor, got ",
              t.scalar_type());
}

// ---------------------------------------------------------------------------------------------
// Causal softmax. x: [..., sq, sk] with sq == sk; column j of row i takes part iff j <= i.
at::Tensor causal_softmax_forward(const at::Tensor& input, double scale) {
  check_float(input, "scaled_upper_triang_masked_softmax");
  TORCH_CHECK(input.dim() >= 2 && input.size(-1) == input.size(-2),
              "scaled_upper_triang_masked_softmax: expected [..., sq, sq] scores, got ", input.sizes());
  auto x = input.contiguous();
  auto y = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_softmax_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      std::vector<acc_t> buf(n);
      for (int64_t r = b; r < e; ++r) {
        const int64_t i = r % n;
        softmax_row<scalar_t, acc_t>(xp + r * n, yp + r * n, n, static_cast<acc_t>(scale), buf.data(),
                                     [i](int64_t j) { return j <= i; });
      }
    });
  });
  return y;
}

at::Tensor softmax_backward(const at::Tensor& grad, const at::Tensor& output, double scale) {
  check_float(output, "fused softmax backward");
  auto g = grad.contiguous().to(output.scalar_type());
  auto y = output.contiguous();
  auto gx = at::empty_like(y);
  const int64_t n = y.size(-1), rows = n == 0 ? 0 : y.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "softmax_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* op = gx.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        softmax_backward_row<scalar_t, acc_t>(gp + r * n, yp + r * n, op + r * n, n, static_cast<acc_t>(scale));
    });
  });
  return gx;
}

// Masked softmax. x: [b, np, sq, sk]; mask: bool [b or 1, 1, sq, sk], True = masked out
// (Megatron's convention). Fully masked rows give zeros.
at::Tensor masked_softmax_forward(const at::Tensor& input, const at::Tensor& mask, double scale) {
  check_float(input, "scaled_masked_softmax");
  TORCH_CHECK(input.dim() == 4, "scaled_masked_softmax: expected scores [b, np, sq, sk], got ", input.sizes());
  TORCH_CHECK(mask.dim() == 4 && mask.size(1) == 1 && mask.size(2) == input.size(2) && mask.size(3) == input.size(3) &&
                  (mask.size(0) == 1 || mask.size(0) == input.size(0)),
              "scaled_masked_softmax: mask must be [b or 1, 1, sq, sk] for scores ", input.sizes(), ", got ",
              mask.sizes());
  auto x = input.contiguous();
  auto mk = mask.to(at::kBool).contiguous();
  auto y = at::empty_like(x);
  const int64_t B = x.size(0), H = x.size(1), sq = x.size(2), sk = x.size(3);
  const int64_t mb = mk.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "masked_softmax_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const bool* mp = mk.data_ptr<bool>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, B * H * sq, 16, [&](int64_t b, int64_t e) {
      std::vector<acc_t> buf(sk);
      for (int64_t r = b; r < e; ++r) {
        const int64_t i = r % sq, bi = r / (H * sq);
        const bool* mrow = mp + ((mb == 1 ? 0 : bi) * sq + i) * sk;
        softmax_row<scalar_t, acc_t>(xp + r * sk, yp + r * sk, sk, static_cast<acc_t>(scale), buf.data(),
                                     [mrow](int64_t j) { return !mrow[j]; });
      }
    });
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// Bias + GeLU(tanh). x: [..., h], bias: [h]. Formulas: fm::gelu_fwd / fm::gelu_grad.

// Row loops as functions: `#pragma omp simd` may not appear inside the AT_DISPATCH macros.
template <typename scalar_t, typename acc_t>
inline void gelu_row(const scalar_t* x, const scalar_t* b, scalar_t* y, int64_t h) {
#pragma omp simd
  for (int64_t j = 0; j < h; ++j)
    y[j] = static_cast<scalar_t>(fm::gelu_fwd<CpuOps, acc_t>(static_cast<acc_t>(x[j]) + static_cast<acc_t>(b[j])));
}
template <typename scalar_t, typename acc_t>
inline void gelu_grad_row(const scalar_t* g, const scalar_t* x, const scalar_t* b, scalar_t* gx, int64_t h) {
#pragma omp simd
  for (int64_t j = 0; j < h; ++j)
    gx[j] = static_cast<scalar_t>(static_cast<acc_t>(g[j]) *
                                  fm::gelu_grad<CpuOps, acc_t>(static_cast<acc_t>(x[j]) + static_cast<acc_t>(b[j])));
}
template <typename acc_t>
inline acc_t row_max(const acc_t* row, int64_t n) {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = row[j] > m ? row[j] : m;
  return m;
}
template <typename acc_t>
inline acc_t exp_sub_sum(acc_t* row, int64_t n, acc_t m) {  // row <- exp(row - m); returns the sum
  acc_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    const acc_t e = exp_or_zero(row[j] - m);
    row[j] = e;
    s += e;
  }
  return s;
}
template <typename acc_t>
inline void scale_row(acc_t* row, int64_t n, acc_t c) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] *= c;
}
// Backward of one attention row without dropout: p <- exp(s - lse), ds <- p * (dp - D) * scale.
template <typename acc_t>
inline void attn_grad_row(acc_t* row, acc_t* drow, int64_t n, acc_t lse, acc_t d, acc_t scale) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const acc_t pv = exp_or_zero(row[j] - lse);
    row[j] = pv;
    drow[j] = fm::attention_ds(pv, drow[j], d, scale);
  }
}

void check_bias(const at::Tensor& x, const at::Tensor& bias, const char* what) {
  check_float(x, what);
  TORCH_CHECK(bias.dim() == 1 && x.dim() >= 1 && bias.size(0) == x.size(-1), what, ": bias must be [",
              x.size(-1), "] for input ", x.sizes(), ", got ", bias.sizes());
}

at::Tensor bias_gelu_forward(const at::Tensor& input, const at::Tensor& bias) {
  check_bias(input, bias, "bias_gelu");
  auto x = input.contiguous();
  auto bv = bias.to(x.scalar_type()).contiguous();
  auto y = at::empty_like(x);
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* bp = bv.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(h, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* xr = xp + r * h;
        scalar_t* yr = yp + r * h;
        gelu_row<scalar_t, acc_t>(xr, bp, yr, h);
      }
    });
  });
  return y;
}

// Returns d(out)/d(input); the bias gradient is its sum over the leading dimensions.
at::Tensor bias_gelu_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& bias) {
  check_bias(input, bias, "bias_gelu backward");
  auto x = input.contiguous();
  auto g = grad.to(x.scalar_type()).contiguous();
  auto bv = bias.to(x.scalar_type()).contiguous();
  auto gx = at::empty_like(x);
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* bp = bv.data_ptr<scalar_t>();
    scalar_t* op = gx.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(h, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        gelu_grad_row<scalar_t, acc_t>(gp + r * h, xp + r * h, bp, op + r * h, h);
      }
    });
  });
  return gx;
}

// ---------------------------------------------------------------------------------------------
// Bias + dropout + residual add: out = residual + keep * (x + bias) * 1/(1-p).
// keep: bool like x (undefined = no dropout); bias: [h] or undefined.
at::Tensor bias_dropout_add_forward(const at::Tensor& input, const c10::optional<at::Tensor>& bias,
                                    const at::Tensor& residual, const c10::optional<at::Tensor>& keep, double p) {
  check_float(input, "bias_dropout_add");
  TORCH_CHECK(residual.sizes() == input.sizes(), "bias_dropout_add: residual ", residual.sizes(),
              " does not match input ", input.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  const bool has_keep = keep.has_value() && keep->defined();
  if (has_bias) check_bias(input, *bias, "bias_dropout_add");
  if (has_keep)
    TORCH_CHECK(keep->sizes() == input.sizes(), "bias_dropout_add: keep-mask ", keep->sizes(),
                " does not match input ", input.sizes());
  auto x = input.contiguous();
  auto res = residual.to(x.scalar_type()).contiguous();
  at::Tensor bv = has_bias ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  at::Tensor kv = has_keep ? keep->to(at::kBool).contiguous() : at::Tensor();
  auto y = at::empty_like(x);
  const int64_t h = x.dim() == 0 ? 1 : x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_dropout_add_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // The same rounding as eager dropout: (x + b) * (1 / (1 - p)) computed in the op's math type.
    const acc_t scale = fm::dropout_scale<acc_t>(p);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = res.data_ptr<scalar_t>();
    const scalar_t* bp = has_bias ? bv.data_ptr<scalar_t>() : nullptr;
    const bool* kp = has_keep ? kv.data_ptr<bool>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(h, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t j = 0; j < h; ++j) {
          const int64_t k = r * h + j;
          yp[k] = fm::bias_dropout_add<scalar_t, acc_t>(xp[k], bp ? bp + j : nullptr, rp[k], kp ? kp + k : nullptr,
                                                        scale);
        }
      }
    });
  });
  return y;
}

// d(out)/d(input) = grad * keep / (1 - p).
at::Tensor dropout_backward(const at::Tensor& grad, const at::Tensor& keep, double p) {
  check_float(grad, "bias_dropout_add backward");
  auto g = grad.contiguous();
  auto kv = keep.to(at::kBool).contiguous();
  auto gx = at::empty_like(g);
  const int64_t n = g.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "dropout_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = fm::dropout_scale<acc_t>(p);
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const bool* kp = kv.data_ptr<bool>();
    scalar_t* op = gx.data_ptr<scalar_t>();
    at::parallel_for(0, n, 65536, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k)
        op[k] = fm::dropout_grad<scalar_t, acc_t>(gp[k], kp[k], scale);
    });
  });
  return gx;
}

// ---------------------------------------------------------------------------------------------
// Variable-length attention. q: [total_q, h, d]; k, v: [total_k, h, d]; cu_seqlens_q/k: int
// [nseg + 1] prefix sums. Segment s's queries attend only to segment s's keys; with `causal`,
// query i (0-based in its segment of length lq) sees key j iff j <= i + (lk - lq) (bottom-right
// aligned, as flash-attention; lq == lk is the usual causal mask). Queries that see no key give
// zeros and lse = -inf. Work per (segment, head) is O(lq * lk * d) through BLAS matmuls.

// Attention dropout: fm::dropout_keep, a hash of (seed, head, query, key) shared with CUDA.
using fm::dropout_keep;
using fm::dropout_threshold;

struct Segments {
  std::vector<int64_t> q, k;
};

Segments read_segments(const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t total_q, int64_t total_k) {
  TORCH_CHECK(cu_q.dim() == 1 && cu_k.dim() == 1 && cu_q.numel() == cu_k.numel() && cu_q.numel() >= 1,
              "varlen_attention: cu_seqlens_q and cu_seqlens_k must be 1-D with the same number (nseg + 1) "
              "of entries, got ", cu_q.sizes(), " and ", cu_k.sizes());
  auto cq = cu_q.to(at::kLong).contiguous(), ck = cu_k.to(at::kLong).contiguous();
  Segments s;
  s.q.assign(cq.data_ptr<int64_t>(), cq.data_ptr<int64_t>() + cq.numel());
  s.k.assign(ck.data_ptr<int64_t>(), ck.data_ptr<int64_t>() + ck.numel());
  TORCH_CHECK(s.q.front() == 0 && s.k.front() == 0 && s.q.back() == total_q && s.k.back() == total_k,
              "varlen_attention: cu_seqlens must start at 0 and end at the token counts (", total_q, ", ", total_k,
              "), got ", s.q.back(), " and ", s.k.back());
  for (size_t i = 1; i < s.q.size(); ++i)
    TORCH_CHECK(s.q[i] >= s.q[i - 1] && s.k[i] >= s.k[i - 1], "varlen_attention: cu_seqlens must be non-decreasing");
  return s;
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_float(q, "varlen_attention");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && q.size(1) == k.size(1) &&
                  q.size(2) == k.size(2),
              "varlen_attention: expected q [total_q, h, d] and k, v [total_k, h, d], got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "varlen_attention: q, k, v must share a dtype");
}

// Scores of rows [r0, r0 + rows) of one (segment, head), `cols` keys, in place: s <- scale * s,
// keys after a causal row's last visible key -> -inf (query i of lq sees keys <= i + lk - lq).
template <typename acc_t>
inline void mask_scale_rows(acc_t* s, int64_t rows, int64_t cols, int64_t r0, int64_t lq, int64_t lk,
                            acc_t scale, bool causal) {
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  for (int64_t i = 0; i < rows; ++i) {
    acc_t* row = s + i * cols;
    const int64_t last = causal ? fm::last_visible_key(r0 + i, lq, lk, true) : cols - 1;
    for (int64_t j = 0; j < cols; ++j) row[j] = j <= last ? row[j] * scale : ninf;
  }
}

// Rows of a segment are processed in blocks of kRowBlock with all heads in one bmm: a causal block
// only multiplies the keys its last row can see (about half the work of the full square on long
// segments), and short segments cost a handful of ATen calls instead of a handful per head.
constexpr int64_t kRowBlock = 128;

// Keys visible to rows [r0, r1) of a segment: [0, return value).
inline int64_t visible_keys(int64_t r1, int64_t lq, int64_t lk, bool causal) {
  return causal ? std::max<int64_t>(0, std::min<int64_t>(lk, r1 + (lk - lq))) : lk;
}

// [len, H, D] slice of a packed [total, H, D] tensor as [H, len, D] in the accumulation type.
inline at::Tensor heads_first(const at::Tensor& t, int64_t start, int64_t len, at::ScalarType acc) {
  return t.narrow(0, start, len).transpose(0, 1).to(acc);
}

std::vector<at::Tensor> varlen_forward(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                       const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal,
                                       double dropout_p, int64_t seed) {
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "varlen_attention: dropout_p must be in [0, 1), got ", dropout_p);
  const uint32_t thr = dropout_threshold(dropout_p);
  check_qkv(q_, k_, v_);
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const int64_t H = q.size(1), total_q = q.size(0);
  const auto seg = read_segments(cu_q, cu_k, q.size(0), k.size(0));
  const int64_t nseg = static_cast<int64_t>(seg.q.size()) - 1;
  const auto acc_type = at::toOpMathType(q.scalar_type());
  auto out = at::zeros_like(q);
  auto lse = at::full({H, total_q}, -std::numeric_limits<double>::infinity(), q.options().dtype(acc_type));
  at::parallel_for(0, nseg, 1, [&](int64_t b, int64_t e) {
    for (int64_t si = b; si < e; ++si) {
      const int64_t q0 = seg.q[si], lq = seg.q[si + 1] - q0, k0 = seg.k[si], lk = seg.k[si + 1] - k0;
      if (lq == 0 || lk == 0) continue;
      auto qs = heads_first(q, q0, lq, acc_type), ks = heads_first(k, k0, lk, acc_type);
      auto vs = heads_first(v, k0, lk, acc_type);
      for (int64_t r0 = 0; r0 < lq; r0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, lq - r0), cols = visible_keys(r0 + rows, lq, lk, causal);
        if (cols == 0) continue;  // no row of the block sees a key: zeros, lse -inf
        auto sc = at::bmm(qs.narrow(1, r0, rows), ks.narrow(1, 0, cols).transpose(1, 2)).contiguous();
        AT_DISPATCH_FLOATING_TYPES(sc.scalar_type(), "varlen_fwd", [&] {
          using acc_t = scalar_t;
          const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
          for (int64_t h = 0; h < H; ++h) {
            acc_t* sp = sc.data_ptr<acc_t>() + h * rows * cols;
            mask_scale_rows<acc_t>(sp, rows, cols, r0, lq, lk, static_cast<acc_t>(scale), causal);
            acc_t* lp = lse.data_ptr<acc_t>() + h * total_q + q0 + r0;  // lse is contiguous [H, total_q]
            for (int64_t i = 0; i < rows; ++i) {
              acc_t* row = sp + i * cols;
              const acc_t m = row_max(row, cols);
              if (m == ninf) {  // no visible key
                for (int64_t j = 0; j < cols; ++j) row[j] = 0;
                continue;
              }
              const acc_t sum = exp_sub_sum(row, cols, m);
              scale_row(row, cols, acc_t(1) / sum);
              lp[i] = m + std::log(sum);
              if (thr > 0) {
                const acc_t z = fm::dropout_scale<acc_t>(dropout_p);
                for (int64_t j = 0; j < cols; ++j)
                  row[j] = dropout_keep(static_cast<uint64_t>(seed), h, q0 + r0 + i, k0 + j, thr) ? row[j] * z
                                                                                                : acc_t(0);
              }
            }
          }
        });
        out.narrow(0, q0 + r0, rows).transpose(0, 1).copy_(at::bmm(sc, vs.narrow(1, 0, cols)));
      }
    }
  });
  return {out, lse};
}

std::vector<at::Tensor> varlen_backward(const at::Tensor& grad_out, const at::Tensor& q_, const at::Tensor& k_,
                                        const at::Tensor& v_, const at::Tensor& out_, const at::Tensor& lse,
                                        const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal,
                                        double dropout_p, int64_t seed) {
  const uint32_t thr = dropout_threshold(dropout_p);
  check_qkv(q_, k_, v_);
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto o = out_.contiguous(), go = grad_out.to(q.scalar_type()).contiguous();
  const int64_t H = q.size(1), total_q = q.size(0);
  const auto seg = read_segments(cu_q, cu_k, q.size(0), k.size(0));
  const int64_t nseg = static_cast<int64_t>(seg.q.size()) - 1;
  const auto acc_type = at::toOpMathType(q.scalar_type());
  auto l = lse.to(acc_type).contiguous();
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  at::parallel_for(0, nseg, 1, [&](int64_t b, int64_t e) {
    for (int64_t si = b; si < e; ++si) {
      const int64_t q0 = seg.q[si], lq = seg.q[si + 1] - q0, k0 = seg.k[si], lk = seg.k[si + 1] - k0;
      if (lq == 0 || lk == 0) continue;
      auto qs = heads_first(q, q0, lq, acc_type), ks = heads_first(k, k0, lk, acc_type);
      auto vs = heads_first(v, k0, lk, acc_type), gos = heads_first(go, q0, lq, acc_type);
      auto os = heads_first(o, q0, lq, acc_type);
      auto dks = at::zeros({H, lk, q.size(2)}, q.options().dtype(acc_type)), dvs = at::zeros_like(dks);
      for (int64_t r0 = 0; r0 < lq; r0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, lq - r0), cols = visible_keys(r0 + rows, lq, lk, causal);
        if (cols == 0) continue;
        auto qb = qs.narrow(1, r0, rows), gob = gos.narrow(1, r0, rows);
        auto kb = ks.narrow(1, 0, cols), vb = vs.narrow(1, 0, cols);
        auto p = at::bmm(qb, kb.transpose(1, 2)).contiguous();   // recomputed probabilities [H, rows, cols]
        auto dp = at::bmm(gob, vb.transpose(1, 2)).contiguous(); // dO V^T
        auto drow = (gob * os.narrow(1, r0, rows)).sum(2).contiguous();  // D_i = rowsum(dO * O), [H, rows]
        AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "varlen_bwd", [&] {
          using acc_t = scalar_t;
          const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
          for (int64_t h = 0; h < H; ++h) {
            acc_t* pp = p.data_ptr<acc_t>() + h * rows * cols;
            acc_t* dpp = dp.data_ptr<acc_t>() + h * rows * cols;
            const acc_t* dd = drow.data_ptr<acc_t>() + h * rows;
            const acc_t* lp = l.data_ptr<acc_t>() + h * total_q + q0 + r0;
            mask_scale_rows<acc_t>(pp, rows, cols, r0, lq, lk, static_cast<acc_t>(scale), causal);
            for (int64_t i = 0; i < rows; ++i) {
              acc_t* row = pp + i * cols;
              acc_t* drw = dpp + i * cols;
              const acc_t li = lp[i];
              if (li == ninf) {
                for (int64_t j = 0; j < cols; ++j) row[j] = drw[j] = 0;
                continue;
              }
              if (thr == 0) {
                attn_grad_row(row, drw, cols, li, dd[i], static_cast<acc_t>(scale));  // dS (already scaled)
              } else {  // O = (P * Z) V: dV uses P * Z, dP = (dO V^T) * Z, D = rowsum(dO * O) still holds
                const acc_t zk = fm::dropout_scale<acc_t>(dropout_p);
                for (int64_t j = 0; j < cols; ++j) {
                  const acc_t pv = exp_or_zero(row[j] - li);
                  const acc_t z = dropout_keep(static_cast<uint64_t>(seed), h, q0 + r0 + i, k0 + j, thr) ? zk
                                                                                                       : acc_t(0);
                  row[j] = pv * z;
                  drw[j] = fm::attention_ds(pv, drw[j], z, dd[i], static_cast<acc_t>(scale));
                }
              }
            }
          }
        });
        dvs.narrow(1, 0, cols).add_(at::bmm(p.transpose(1, 2), gob));
        dq.narrow(0, q0 + r0, rows).transpose(0, 1).copy_(at::bmm(dp, kb));
        dks.narrow(1, 0, cols).add_(at::bmm(dp.transpose(1, 2), qb));
      }
      dk.narrow(0, k0, lk).transpose(0, 1).copy_(dks);
      dv.narrow(0, k0, lk).transpose(0, 1).copy_(dvs);
    }
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(megatron_fused, m) {
  m.def("scaled_upper_triang_masked_softmax_forward(Tensor input, float scale) -> Tensor");
  m.def("scaled_softmax_backward(Tensor grad, Tensor output, float scale) -> Tensor");
  m.def("scaled_masked_softmax_forward(Tensor input, Tensor mask, float scale) -> Tensor");
  m.def("bias_gelu_forward(Tensor input, Tensor bias) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor input, Tensor bias) -> Tensor");
  m.def("bias_dropout_add_forward(Tensor input, Tensor? bias, Tensor residual, Tensor? keep, float p) -> Tensor");
  m.def("dropout_backward(Tensor grad, Tensor keep, float p) -> Tensor");
  m.def("varlen_attention_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "float scale, bool causal, float dropout_p, int seed) -> Tensor[]");
  m.def("varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, bool causal, float dropout_p, int seed) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(megatron_fused, CPU, m) {
  m.impl("scaled_upper_triang_masked_softmax_forward", &causal_softmax_forward);
  m.impl("scaled_softmax_backward", &softmax_backward);
  m.impl("scaled_masked_softmax_forward", &masked_softmax_forward);
  m.impl("bias_gelu_forward", &bias_gelu_forward);
  m.impl("bias_gelu_backward", &bias_gelu_backward);
  m.impl("bias_dropout_add_forward", &bias_dropout_add_forward);
  m.impl("dropout_backward", &dropout_backward);
  m.impl("varlen_attention_forward", &varlen_forward);
  m.impl("varlen_attention_backward", &varlen_backward);
}
