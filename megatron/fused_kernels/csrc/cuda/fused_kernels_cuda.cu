// Thin ATen launchers for the CUDA kernels in fused_kernels.cuh, registered for the CUDA
// dispatch key of the ops declared in ../cpu/fused_kernels_cpu.cpp. Built only when torch
// has CUDA (megatron.fused_kernels.load adds this file then).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "fused_kernels.cuh"

namespace {

template <typename S> struct CudaType { using type = S; };
template <> struct CudaType<at::Half> { using type = __half; };
template <> struct CudaType<at::BFloat16> { using type = __nv_bfloat16; };

template <typename S>
typename CudaType<S>::type* ptr(const at::Tensor& t) {
  return reinterpret_cast<typename CudaType<S>::type*>(t.data_ptr<S>());
}

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, what, ": CUDA error ", cudaGetErrorString(e));
}

#define DISPATCH(T, NAME, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, T, NAME, __VA_ARGS__)

at::Tensor causal_softmax_forward(const at::Tensor& input, double scale) {
  TORCH_CHECK(input.dim() >= 2 && input.size(-1) == input.size(-2), "scaled_upper_triang_masked_softmax: expected "
              "[..., sq, sq] scores, got ", input.sizes());
  c10::cuda::CUDAGuard guard(input.device());
  auto x = input.contiguous();
  auto y = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  DISPATCH(x.scalar_type(), "causal_softmax_fwd_cuda", [&] {
    check(megatron_fused::launch_softmax_forward(ptr<scalar_t>(x), nullptr, ptr<scalar_t>(y), rows, n, n, 1, 1,
                                                 scale, true, c10::cuda::getCurrentCUDAStream()), "causal softmax");
  });
  return y;
}

at::Tensor masked_softmax_forward(const at::Tensor& input, const at::Tensor& mask, double scale) {
  TORCH_CHECK(input.dim() == 4 && mask.dim() == 4 && mask.size(1) == 1 && mask.size(2) == input.size(2) &&
                  mask.size(3) == input.size(3) && (mask.size(0) == 1 || mask.size(0) == input.size(0)),
              "scaled_masked_softmax: expected scores [b, np, sq, sk] and mask [b or 1, 1, sq, sk], got ",
              input.sizes(), " and ", mask.sizes());
  c10::cuda::CUDAGuard guard(input.device());
  auto x = input.contiguous();
  auto mk = mask.to(at::kBool).contiguous();
  auto y = at::empty_like(x);
  DISPATCH(x.scalar_type(), "masked_softmax_fwd_cuda", [&] {
    check(megatron_fused::launch_softmax_forward(ptr<scalar_t>(x), mk.data_ptr<bool>(), ptr<scalar_t>(y),
                                                 x.numel() / std::max<int64_t>(x.size(3), 1), x.size(2), x.size(3),
                                                 x.size(1), mk.size(0), scale, false, c10::cuda::getCurrentCUDAStream()),
          "masked softmax");
  });
  return y;
}

at::Tensor softmax_backward(const at::Tensor& grad, const at::Tensor& output, double scale) {
  c10::cuda::CUDAGuard guard(output.device());
  auto y = output.contiguous();
  auto g = grad.to(y.scalar_type()).contiguous();
  auto gx = at::empty_like(y);
  const int64_t n = y.size(-1), rows = n ? y.numel() / n : 0;
  DISPATCH(y.scalar_type(), "softmax_bwd_cuda", [&] {
    check(megatron_fused::launch_softmax_backward(ptr<scalar_t>(g), ptr<scalar_t>(y), ptr<scalar_t>(gx), rows, n, scale,
                                                  c10::cuda::getCurrentCUDAStream()), "softmax backward");
  });
  return gx;
}

at::Tensor bias_gelu(const at::Tensor* grad, const at::Tensor& input, const at::Tensor& bias) {
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == input.size(-1), "bias_gelu: bias must be [", input.size(-1), "]");
  c10::cuda::CUDAGuard guard(input.device());
  auto x = input.contiguous();
  auto b = bias.to(x.scalar_type()).contiguous();
  at::Tensor g = grad ? grad->to(x.scalar_type()).contiguous() : at::Tensor();
  auto y = at::empty_like(x);
  DISPATCH(x.scalar_type(), "bias_gelu_cuda", [&] {
    check(megatron_fused::launch_bias_gelu(grad ? ptr<scalar_t>(g) : nullptr, ptr<scalar_t>(x), ptr<scalar_t>(b),
                                           ptr<scalar_t>(y), x.numel(), x.size(-1), grad != nullptr,
                                           c10::cuda::getCurrentCUDAStream()), "bias_gelu");
  });
  return y;
}
at::Tensor bias_gelu_forward(const at::Tensor& x, const at::Tensor& b) { return bias_gelu(nullptr, x, b); }
at::Tensor bias_gelu_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& b) {
  return bias_gelu(&g, x, b);
}

at::Tensor bias_dropout_add_forward(const at::Tensor& input, const c10::optional<at::Tensor>& bias,
                                    const at::Tensor& residual, const c10::optional<at::Tensor>& keep, double p) {
  TORCH_CHECK(residual.sizes() == input.sizes(), "bias_dropout_add: residual ", residual.sizes(), " vs input ",
              input.sizes());
  c10::cuda::CUDAGuard guard(input.device());
  auto x = input.contiguous();
  auto r = residual.to(x.scalar_type()).contiguous();
  const bool hb = bias.has_value() && bias->defined(), hk = keep.has_value() && keep->defined();
  at::Tensor b = hb ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  at::Tensor k = hk ? keep->to(at::kBool).contiguous() : at::Tensor();
  auto y = at::empty_like(x);
  DISPATCH(x.scalar_type(), "bias_dropout_add_cuda", [&] {
    check(megatron_fused::launch_bias_dropout_add(ptr<scalar_t>(x), hb ? ptr<scalar_t>(b) : nullptr, ptr<scalar_t>(r),
                                                  hk ? k.data_ptr<bool>() : nullptr, ptr<scalar_t>(y), x.numel(),
                                                  x.dim() ? x.size(-1) : 1, p, c10::cuda::getCurrentCUDAStream()),
          "bias_dropout_add");
  });
  return y;
}

at::Tensor dropout_backward(const at::Tensor& grad, const at::Tensor& keep, double p) {
  c10::cuda::CUDAGuard guard(grad.device());
  auto g = grad.contiguous();
  auto k = keep.to(at::kBool).contiguous();
  auto gx = at::empty_like(g);
  DISPATCH(g.scalar_type(), "dropout_bwd_cuda", [&] {
    check(megatron_fused::launch_dropout_backward(ptr<scalar_t>(g), k.data_ptr<bool>(), ptr<scalar_t>(gx), g.numel(), p,
                                                  c10::cuda::getCurrentCUDAStream()), "dropout backward");
  });
  return gx;
}

megatron_fused::VarlenParams varlen_params(const at::Tensor& q, const at::Tensor& cu_q, const at::Tensor& cu_k,
                                           double scale, bool causal, double dropout_p, int64_t seed) {
  TORCH_CHECK(q.size(2) <= 256, "varlen_attention (CUDA): head size ", q.size(2), " > 256 is not supported");
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "varlen_attention: dropout_p must be in [0, 1)");
  megatron_fused::VarlenParams p;
  p.total_q = q.size(0);
  p.heads = q.size(1);
  p.dim = q.size(2);
  p.nseg = cu_q.numel() - 1;
  p.cu_q = cu_q.data_ptr<int64_t>();
  p.cu_k = cu_k.data_ptr<int64_t>();
  p.scale = scale;
  p.causal = causal;
  p.dropout_threshold = megatron_fused::math::dropout_threshold(dropout_p);
  p.dropout_p = dropout_p;
  p.seed = static_cast<uint64_t>(seed);
  return p;
}

std::vector<at::Tensor> varlen_forward(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                       const at::Tensor& cu_q_, const at::Tensor& cu_k_, double scale, bool causal,
                                       double dropout_p, int64_t seed) {
  TORCH_CHECK(q_.dim() == 3 && k_.sizes() == v_.sizes() && k_.dim() == 3 && q_.size(1) == k_.size(1) &&
                  q_.size(2) == k_.size(2), "varlen_attention: expected q [total_q, h, d], k, v [total_k, h, d]");
  TORCH_CHECK(cu_q_.numel() == cu_k_.numel() && cu_q_.numel() >= 1, "varlen_attention: cu_seqlens_q and "
              "cu_seqlens_k must have the same number of entries");
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto cu_q = cu_q_.to(q.device(), at::kLong).contiguous(), cu_k = cu_k_.to(q.device(), at::kLong).contiguous();
  auto out = at::empty_like(q);
  const auto acc = at::toOpMathType(q.scalar_type());
  auto lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(acc));
  auto p = varlen_params(q, cu_q, cu_k, scale, causal, dropout_p, seed);
  DISPATCH(q.scalar_type(), "varlen_fwd_cuda", [&] {
    using A = typename megatron_fused::Acc<typename CudaType<scalar_t>::type>::type;
    check(megatron_fused::launch_varlen_forward(ptr<scalar_t>(q), ptr<scalar_t>(k), ptr<scalar_t>(v),
                                                ptr<scalar_t>(out), reinterpret_cast<A*>(lse.data_ptr()), p,
                                                c10::cuda::getCurrentCUDAStream()), "varlen forward");
  });
  return {out, lse};
}

std::vector<at::Tensor> varlen_backward(const at::Tensor& grad_out, const at::Tensor& q_, const at::Tensor& k_,
                                        const at::Tensor& v_, const at::Tensor& out_, const at::Tensor& lse_,
                                        const at::Tensor& cu_q_, const at::Tensor& cu_k_, double scale, bool causal,
                                        double dropout_p, int64_t seed) {
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), o = out_.contiguous();
  auto go = grad_out.to(q.scalar_type()).contiguous();
  auto cu_q = cu_q_.to(q.device(), at::kLong).contiguous(), cu_k = cu_k_.to(q.device(), at::kLong).contiguous();
  const auto acc = at::toOpMathType(q.scalar_type());
  auto lse = lse_.to(acc).contiguous();
  auto dq = at::empty_like(q);
  auto dk = at::zeros(k.sizes(), k.options().dtype(acc)), dv = at::zeros(v.sizes(), v.options().dtype(acc));
  auto p = varlen_params(q, cu_q, cu_k, scale, causal, dropout_p, seed);
  DISPATCH(q.scalar_type(), "varlen_bwd_cuda", [&] {
    using A = typename megatron_fused::Acc<typename CudaType<scalar_t>::type>::type;
    check(megatron_fused::launch_varlen_backward(ptr<scalar_t>(go), ptr<scalar_t>(q), ptr<scalar_t>(k),
                                                 ptr<scalar_t>(v), ptr<scalar_t>(o),
                                                 reinterpret_cast<const A*>(lse.data_ptr()), ptr<scalar_t>(dq),
                                                 reinterpret_cast<A*>(dk.data_ptr()), reinterpret_cast<A*>(dv.data_ptr()),
                                                 p, c10::cuda::getCurrentCUDAStream()), "varlen backward");
  });
  return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CUDA, m) {
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
