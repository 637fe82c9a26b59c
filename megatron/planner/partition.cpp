// Inner loops of the planners' dynamic programs (pybind11 + numpy, no torch).
//
// min_sums (megatron/planner/partitioner.py): min_sums(T, taus)[k] = the minimum total time over contiguous partitions of N samples whose
// segments all take <= taus[k], where T[i, m] is the time of segment [i, i + m + 1) (inf = not
// allowed). The numpy version loops over i in Python with a vector op per step; here the same
// additions and minimums run in one pass, so results are bit-identical and ~50x faster on
// batches of hundreds of samples (DynaPipe plans one such batch per iteration).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

py::array_t<double> min_sums(py::array_t<double, py::array::c_style | py::array::forcecast> T,
                             py::array_t<double, py::array::c_style | py::array::forcecast> taus) {
  if (T.ndim() != 2 || taus.ndim() != 1) throw std::invalid_argument("min_sums: T must be (N, M), taus (K,)");
  const auto N = static_cast<std::size_t>(T.shape(0)), M = static_cast<std::size_t>(T.shape(1));
  const auto K = static_cast<std::size_t>(taus.shape(0));
  const double* t = T.data();
  const double* tau = taus.data();
  const double inf = std::numeric_limits<double>::infinity();
  py::array_t<double> out(static_cast<py::ssize_t>(K));
  double* o = out.mutable_data();
  std::vector<double> F(N + 1);
  {
    py::gil_scoped_release release;
    for (std::size_t k = 0; k < K; ++k) {
      std::fill(F.begin(), F.end(), inf);
      F[0] = 0.0;
      const double limit = tau[k];
      for (std::size_t i = 0; i < N; ++i) {
        const double base = F[i];
        if (base == inf) continue;
        const double* row = t + i * M;
        const std::size_t w = std::min(M, N - i);
        for (std::size_t m = 0; m < w; ++m) {
          const double v = row[m];
          if (v <= limit) {
            const double c = base + v;
            if (c < F[i + 1 + m]) F[i + 1 + m] = c;
          }
        }
      }
      o[k] = F[N];
    }
  }
  return out;
}

// dp_for_caps (megatron/planner/terapipe.py, TeraPipe's slicing DP): for every cap k and end
// point n, f[k, n] = min over m < n with cost[m, n] <= caps[k] of f[k, m] + cost[m, n], and
// arg[k, n] the first m reaching it; the scan starts at the first m whose slice fits the largest
// cap (as the numpy version does, so f and arg are identical, ties included).
py::tuple dp_for_caps(py::array_t<double, py::array::c_style | py::array::forcecast> cost,
                      py::array_t<double, py::array::c_style | py::array::forcecast> caps) {
  if (cost.ndim() != 2 || cost.shape(0) != cost.shape(1) || caps.ndim() != 1)
    throw std::invalid_argument("dp_for_caps: cost must be (P, P), caps (K,)");
  const auto P = static_cast<std::size_t>(cost.shape(0)), K = static_cast<std::size_t>(caps.shape(0));
  const double* c = cost.data();
  const double* cap = caps.data();
  const double inf = std::numeric_limits<double>::infinity();
  py::array_t<double> f_arr({static_cast<py::ssize_t>(K), static_cast<py::ssize_t>(P)});
  py::array_t<int64_t> a_arr({static_cast<py::ssize_t>(K), static_cast<py::ssize_t>(P)});
  double* f = f_arr.mutable_data();
  int64_t* arg = a_arr.mutable_data();
  {
    py::gil_scoped_release release;
    std::fill(f, f + K * P, inf);
    std::fill(arg, arg + K * P, int64_t(-1));
    double cap_max = -inf;
    for (std::size_t k = 0; k < K; ++k) {
      cap_max = std::max(cap_max, cap[k]);
      if (P) f[k * P] = 0.0;
    }
    std::vector<double> col(P);
    for (std::size_t n = 1; n < P; ++n) {
      std::size_t lo = n;
      for (std::size_t m = 0; m < n; ++m) {
        col[m] = c[m * P + n];
        if (lo == n && col[m] <= cap_max) lo = m;
      }
      if (lo == n) continue;  // no slice ending at n fits any cap
      for (std::size_t k = 0; k < K; ++k) {
        const double limit = cap[k];
        const double* fk = f + k * P;
        double best = inf;
        std::size_t best_m = lo;
        for (std::size_t m = lo; m < n; ++m) {
          if (col[m] <= limit && fk[m] + col[m] < best) {
            best = fk[m] + col[m];
            best_m = m;
          }
        }
        f[k * P + n] = best;
        arg[k * P + n] = static_cast<int64_t>(best_m);
      }
    }
  }
  return py::make_tuple(f_arr, a_arr);
}

}  // namespace

PYBIND11_MODULE(partition_cpp, m) {
  m.doc() = "C++ inner loops of the DynaPipe partitioner and the TeraPipe slicing DP";
  m.def("min_sums", &min_sums, py::arg("T"), py::arg("taus"),
        "Per tau: minimum total segment time over partitions whose segments all take <= tau.");
  m.def("dp_for_caps", &dp_for_caps, py::arg("cost"), py::arg("caps"),
        "TeraPipe's slicing DP for several caps at once: (f, arg), each (K, P).");
}
