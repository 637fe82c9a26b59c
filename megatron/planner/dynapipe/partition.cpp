// Inner loops of the planners' dynamic programs (pybind11 + numpy, no torch).
//
// min_sums (megatron/planner/partitioner.py): min_sums(T, taus)[k] = the minimum total time over contiguous partitions of N samples whose
// segments all take <= taus[k], where T[i, m] is the time of segment [i, i + m + 1) (inf = not
// allowed). The numpy version loops over i in Python with a vector op per step; here the same
// additions and minimums run in one pass, so results are bit-identical and ~50x faster on
// batches of hundreds of samples (DynaPipe plans one such batch per iteration).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

// The sums run over L (the segments' load) while the cap applies to T; min_sums passes T as L.
void min_sums_core(const double* t, const double* l, std::size_t N, std::size_t M, const double* tau, std::size_t K,
                   double* o) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> F(N + 1);
  for (std::size_t k = 0; k < K; ++k) {
    std::fill(F.begin(), F.end(), inf);
    F[0] = 0.0;
    const double limit = tau[k];
    for (std::size_t i = 0; i < N; ++i) {
      const double base = F[i];
      if (base == inf) continue;
      const double* row = t + i * M;
      const double* lrow = l + i * M;
      const std::size_t w = std::min(M, N - i);
      for (std::size_t m = 0; m < w; ++m) {
        if (row[m] <= limit) {
          const double c = base + lrow[m];
          if (c < F[i + 1 + m]) F[i + 1 + m] = c;
        }
      }
    }
    o[k] = F[N];
  }
}

using Mat = py::array_t<double, py::array::c_style | py::array::forcecast>;

py::array_t<double> min_sums(Mat T, Mat taus) {
  if (T.ndim() != 2 || taus.ndim() != 1) throw std::invalid_argument("min_sums: T must be (N, M), taus (K,)");
  const auto N = static_cast<std::size_t>(T.shape(0)), M = static_cast<std::size_t>(T.shape(1));
  const auto K = static_cast<std::size_t>(taus.shape(0));
  py::array_t<double> out(static_cast<py::ssize_t>(K));
  double* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    min_sums_core(T.data(), T.data(), N, M, taus.data(), K, o);
  }
  return out;
}

// min_sums_load(T, L, taus): the same with the totals taken over L (T still caps the segments).
py::array_t<double> min_sums_load(Mat T, Mat L, Mat taus) {
  if (T.ndim() != 2 || taus.ndim() != 1 || L.ndim() != 2 || L.shape(0) != T.shape(0) || L.shape(1) != T.shape(1))
    throw std::invalid_argument("min_sums_load: T and L must be (N, M), taus (K,)");
  const auto N = static_cast<std::size_t>(T.shape(0)), M = static_cast<std::size_t>(T.shape(1));
  const auto K = static_cast<std::size_t>(taus.shape(0));
  py::array_t<double> out(static_cast<py::ssize_t>(K));
  double* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    min_sums_core(T.data(), L.data(), N, M, taus.data(), K, o);
  }
  return out;
}

// bottleneck(T): the smallest achievable slowest segment (min over partitions of the max).
double bottleneck(py::array_t<double, py::array::c_style | py::array::forcecast> T) {
  if (T.ndim() != 2) throw std::invalid_argument("bottleneck: T must be (N, M)");
  const auto N = static_cast<std::size_t>(T.shape(0)), M = static_cast<std::size_t>(T.shape(1));
  const double* t = T.data();
  std::vector<double> H(N + 1, std::numeric_limits<double>::infinity());
  H[0] = 0.0;
  for (std::size_t i = 0; i < N; ++i) {
    const std::size_t w = std::min(M, N - i);
    for (std::size_t m = 0; m < w; ++m) {
      const double v = std::max(H[i], t[i * M + m]);
      if (v < H[i + 1 + m]) H[i + 1 + m] = v;
    }
  }
  return H[N];
}

// reconstruct(T, tau): the cuts [0, ..., N] of a partition with minimum total time whose
// segments all take <= tau (ties: the earliest start that reached the minimum first).
std::vector<int64_t> reconstruct_core(const double* t, const double* l, std::size_t N, std::size_t M, double tau) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> F(N + 1, inf);
  std::vector<int64_t> parent(N + 1, -1);
  F[0] = 0.0;
  for (std::size_t i = 0; i < N; ++i) {
    const std::size_t w = std::min(M, N - i);
    for (std::size_t m = 0; m < w; ++m) {
      const double cand = F[i] + (t[i * M + m] <= tau ? l[i * M + m] : inf);
      if (cand < F[i + 1 + m]) {
        F[i + 1 + m] = cand;
        parent[i + 1 + m] = static_cast<int64_t>(i);
      }
    }
  }
  std::vector<int64_t> cuts{static_cast<int64_t>(N)};
  while (cuts.back() > 0) {
    const int64_t p = parent[cuts.back()];
    if (p < 0) throw std::runtime_error("reconstruct: no partition within tau");
    cuts.push_back(p);
  }
  std::reverse(cuts.begin(), cuts.end());
  return cuts;
}

std::vector<int64_t> reconstruct(Mat T, double tau) {
  if (T.ndim() != 2) throw std::invalid_argument("reconstruct: T must be (N, M)");
  return reconstruct_core(T.data(), T.data(), static_cast<std::size_t>(T.shape(0)), static_cast<std::size_t>(T.shape(1)), tau);
}

// reconstruct_load(T, L, tau): the same with the total taken over L.
std::vector<int64_t> reconstruct_load(Mat T, Mat L, double tau) {
  if (T.ndim() != 2 || L.ndim() != 2 || L.shape(0) != T.shape(0) || L.shape(1) != T.shape(1))
    throw std::invalid_argument("reconstruct_load: T and L must be (N, M)");
  return reconstruct_core(T.data(), L.data(), static_cast<std::size_t>(T.shape(0)), static_cast<std::size_t>(T.shape(1)), tau);
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

// adaptive_schedule (megatron/planner/schedules.py `_adaptive`): DynaPipe's memory-aware
// wait-free list schedule, one stage per rank, step for step as the Python version (same
// tie-breaks: earliest start, backward before forward, lower stage first; same additions, so
// the same makespan to the bit). Costs are (S, K) float64. Returns (0, makespan, ops) with ops
// (S, 2 * len(order)) = micro-batch * 2 + is_forward in execution order; (1, t, None) once an
// op would end at or after `cut`; (2, mb, stage) when a micro-batch cannot fit on a stage even
// alone.
py::tuple adaptive_schedule(py::array_t<double, py::array::c_style | py::array::forcecast> fwd_a,
                            py::array_t<double, py::array::c_style | py::array::forcecast> bwd_a,
                            py::array_t<double, py::array::c_style | py::array::forcecast> stored_a,
                            py::array_t<double, py::array::c_style | py::array::forcecast> trans_a,
                            py::array_t<double, py::array::c_style | py::array::forcecast> comm_a,
                            py::array_t<double, py::array::c_style | py::array::forcecast> gcomm_a,
                            py::array_t<int64_t, py::array::c_style | py::array::forcecast> order_a,
                            py::array_t<double, py::array::c_style | py::array::forcecast> limit_a,
                            double cut) {
  const auto S = static_cast<std::size_t>(fwd_a.shape(0)), N = static_cast<std::size_t>(fwd_a.shape(1));
  const auto K = static_cast<std::size_t>(order_a.shape(0));
  const double *fwd = fwd_a.data(), *bwd = bwd_a.data(), *stored = stored_a.data(), *trans = trans_a.data();
  const double *comm = comm_a.data(), *gcomm = gcomm_a.data(), *limit = limit_a.data();
  const int64_t* order = order_a.data();
  for (std::size_t i = 0; i < K; ++i)
    if (order[i] < 0 || static_cast<std::size_t>(order[i]) >= N) throw std::invalid_argument("adaptive_schedule: bad order");
  const double INF = std::numeric_limits<double>::infinity();
  std::vector<std::size_t> fptr(S, 0), b_head(S, 0);
  std::vector<double> f_arrival(S * N, -1.0), free_at(S, 0.0), mem(S, 0.0), inflight_max(S, 0.0);
  std::vector<double> link_free(S, 0.0), glink_free(S, 0.0);
  std::vector<std::vector<std::pair<double, int64_t>>> b_queue(S);
  std::vector<std::vector<std::pair<int64_t, double>>> inflight(S);  // (mb, transient), insertion order
  std::vector<std::vector<int64_t>> ops(S);
  for (std::size_t i = 0; i < K; ++i) f_arrival[order[i]] = 0.0;
  int64_t bad_mb = -1, bad_stage = -1;

  // Next op of stage s: (start, is_forward), or start = INF when none.
  auto candidate = [&](std::size_t s, double& start, int& is_f) -> bool {
    double bt = INF;
    if (b_head[s] < b_queue[s].size()) {
      const double a = b_queue[s][b_head[s]].first, fr = free_at[s];
      bt = a > fr ? a : fr;
    }
    if (fptr[s] < K) {
      const int64_t mb = order[fptr[s]];
      const double a = f_arrival[s * N + mb];
      if (a >= 0.0) {
        const double tr = trans[s * N + mb], im = inflight_max[s];
        if (mem[s] + stored[s * N + mb] + (tr > im ? tr : im) <= limit[s]) {
          const double fr = free_at[s];
          const double ft = a > fr ? a : fr;
          if (ft < bt) {
            start = ft;
            is_f = 1;
            return true;
          }
        } else if (inflight[s].empty()) {
          bad_mb = mb;
          bad_stage = static_cast<int64_t>(s);
          return false;
        }
      }
    }
    start = bt;
    is_f = 0;
    return true;
  };

  std::vector<double> cs(S);
  std::vector<int> cf(S);
  for (std::size_t s = 0; s < S; ++s)
    if (!candidate(s, cs[s], cf[s])) return py::make_tuple(2, bad_mb, bad_stage);
  const std::size_t total = 2 * S * K;
  double makespan = 0.0;
  for (std::size_t done = 0; done < total; ++done) {
    std::size_t ps = S;
    for (std::size_t x = 0; x < S; ++x) {
      if (cs[x] == INF) continue;
      if (ps == S || cs[x] < cs[ps] || (cs[x] == cs[ps] && cf[x] < cf[ps])) ps = x;
    }
    if (ps == S) throw std::runtime_error("adaptive schedule stalled (no stage can run)");
    const std::size_t s = ps;
    const double t = cs[s];
    const bool is_f = cf[s] == 1;
    double t1;
    if (is_f) {
      const int64_t mb = order[fptr[s]++];
      t1 = t + fwd[s * N + mb];
      mem[s] += stored[s * N + mb];
      const double tr = trans[s * N + mb];
      inflight[s].emplace_back(mb, tr);
      if (tr > inflight_max[s]) inflight_max[s] = tr;
      ops[s].push_back(mb * 2 + 1);
      if (s + 1 < S) {
        const double t0 = t1 > link_free[s] ? t1 : link_free[s];
        link_free[s] = f_arrival[(s + 1) * N + mb] = t0 + comm[s * N + mb];
      } else {
        b_queue[s].emplace_back(t1, mb);
      }
    } else {
      const int64_t mb = b_queue[s][b_head[s]++].second;
      t1 = t + bwd[s * N + mb];
      mem[s] -= stored[s * N + mb];
      double gone = 0.0;
      auto& inf_s = inflight[s];
      for (std::size_t i = 0; i < inf_s.size(); ++i)
        if (inf_s[i].first == mb) {
          gone = inf_s[i].second;
          inf_s.erase(inf_s.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        }
      if (gone >= inflight_max[s]) {
        double mx = 0.0;
        bool any = false;
        for (const auto& kv : inf_s) {
          if (!any || kv.second > mx) mx = kv.second;
          any = true;
        }
        inflight_max[s] = any ? mx : 0.0;
      }
      ops[s].push_back(mb * 2);
      if (s > 0) {
        const double t0 = t1 > glink_free[s] ? t1 : glink_free[s];
        glink_free[s] = t0 + gcomm[(s - 1) * N + mb];
        b_queue[s - 1].emplace_back(t0 + gcomm[(s - 1) * N + mb], mb);
      }
    }
    free_at[s] = t1;
    if (t1 >= cut) return py::make_tuple(1, t1, py::none());
    if (t1 > makespan) makespan = t1;
    if (!candidate(s, cs[s], cf[s])) return py::make_tuple(2, bad_mb, bad_stage);
    if (s + 1 < S && is_f) {
      if (!candidate(s + 1, cs[s + 1], cf[s + 1])) return py::make_tuple(2, bad_mb, bad_stage);
    } else if (s > 0 && !is_f) {
      if (!candidate(s - 1, cs[s - 1], cf[s - 1])) return py::make_tuple(2, bad_mb, bad_stage);
    }
  }
  py::array_t<int64_t> out({static_cast<py::ssize_t>(S), static_cast<py::ssize_t>(2 * K)});
  int64_t* o = out.mutable_data();
  for (std::size_t s = 0; s < S; ++s) std::copy(ops[s].begin(), ops[s].end(), o + s * 2 * K);
  return py::make_tuple(0, makespan, out);
}

}  // namespace

PYBIND11_MODULE(partition_cpp, m) {
  m.doc() = "C++ inner loops of the DynaPipe partitioner and schedule search, and the TeraPipe slicing DP";
  m.def("min_sums", &min_sums, py::arg("T"), py::arg("taus"),
        "Per tau: minimum total segment time over partitions whose segments all take <= tau.");
  m.def("min_sums_load", &min_sums_load, py::arg("T"), py::arg("L"), py::arg("taus"),
        "Per tau: minimum total load L over partitions whose segments all take <= tau by T.");
  m.def("reconstruct_load", &reconstruct_load, py::arg("T"), py::arg("L"), py::arg("tau"),
        "Cuts of a minimum-load partition whose segments all take <= tau.");
  m.def("bottleneck", &bottleneck, py::arg("T"), "Smallest achievable slowest segment time.");
  m.def("reconstruct", &reconstruct, py::arg("T"), py::arg("tau"),
        "Cuts of a minimum-total partition whose segments all take <= tau.");
  m.def("dp_for_caps", &dp_for_caps, py::arg("cost"), py::arg("caps"),
        "TeraPipe's slicing DP for several caps at once: (f, arg), each (K, P).");
  m.def("adaptive_schedule", &adaptive_schedule, py::arg("fwd"), py::arg("bwd"), py::arg("stored"),
        py::arg("trans"), py::arg("comm"), py::arg("gcomm"), py::arg("order"), py::arg("limit"), py::arg("cut"),
        "DynaPipe's memory-aware adaptive schedule: (status, makespan or mb, ops or stage).");
}
