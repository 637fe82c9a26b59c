// Index builders for the datasets in megatron/data (pybind11 + numpy only, no torch).
//
// These loops run once per training job over every document of every epoch
// (hundreds of millions of iterations for a large corpus), which is why they are
// in C++: the same loops in Python take minutes.  Semantics follow Megatron-LM's
// published description (see docs/data.md):
//   build_sample_idx          GPT sample index: [N+1, 2] (doc-index position, token offset)
//   build_blending_indices    greedy, RNG-free interleaving of several datasets by weight
//   build_mapping             T5: group whole sentences of a document into samples
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

// Number of samples a GPT epoch schedule yields.  Each sample needs
// seq_length + add_extra_token tokens, but consecutive samples share the extra
// (label) token, so only seq_length new tokens are consumed per sample.
int64_t num_gpt_samples(int64_t total_tokens, int64_t seq_length, int64_t add_extra_token,
                        bool drop_last) {
  const int64_t usable = total_tokens - add_extra_token;
  if (usable <= 0) return 0;
  return drop_last ? usable / seq_length : (usable + seq_length - 1) / seq_length;
}

template <typename T>
py::array build_sample_idx_impl(const py::array_t<int32_t, py::array::c_style>& sizes,
                                const py::array_t<int32_t, py::array::c_style>& doc_idx,
                                int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                bool drop_last, int64_t add_extra_token) {
  auto sz = sizes.unchecked<1>();
  auto di = doc_idx.unchecked<1>();
  const int64_t n_doc_idx = di.shape(0);
  const int64_t num_samples =
      num_gpt_samples(num_epochs * tokens_per_epoch, seq_length, add_extra_token, drop_last);

  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  auto out = result.template mutable_unchecked<2>();
  out(0, 0) = 0;
  out(0, 1) = 0;
  int64_t doc_pos = 0;     // position in doc_idx
  int64_t doc_offset = 0;  // token offset inside the current document
  for (int64_t s = 1; s <= num_samples; ++s) {
    int64_t remaining = seq_length + add_extra_token;
    while (remaining != 0) {
      if (doc_pos >= n_doc_idx) throw std::runtime_error("build_sample_idx: ran past doc_idx");
      const int64_t doc_id = di(doc_pos);
      const int64_t doc_len = static_cast<int64_t>(sz(doc_id)) - doc_offset;
      remaining -= doc_len;
      if (remaining <= 0) {
        // The sample ends inside this document.  Step back by the extra token so the
        // next sample starts on this sample's last (label-only) token.
        doc_offset += remaining + doc_len - add_extra_token;
        remaining = 0;
      } else if (doc_pos == n_doc_idx - 1) {
        // Only the final partial sample (drop_last == false) may run out of documents.
        if (s != num_samples) throw std::runtime_error("build_sample_idx: tokens_per_epoch too large");
        doc_offset = static_cast<int64_t>(sz(doc_id)) - add_extra_token;
        remaining = 0;
      } else {
        ++doc_pos;
        doc_offset = 0;
      }
    }
    out(s, 0) = static_cast<T>(doc_pos);
    out(s, 1) = static_cast<T>(doc_offset);
  }
  return std::move(result);
}

py::array build_sample_idx(const py::array_t<int32_t, py::array::c_style>& sizes,
                           const py::array_t<int32_t, py::array::c_style>& doc_idx,
                           int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                           bool drop_last, int64_t add_extra_token) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive");
  // int32 halves the cache size; switch to int64 once offsets or positions could overflow.
  const bool small = static_cast<int64_t>(doc_idx.shape(0)) < INT32_MAX &&
                     num_epochs * tokens_per_epoch < INT32_MAX;
  if (small)
    return build_sample_idx_impl<int32_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch,
                                          drop_last, add_extra_token);
  return build_sample_idx_impl<int64_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch,
                                        drop_last, add_extra_token);
}

// Greedy interleaving: sample i goes to the dataset furthest behind its target share
// w_d * i.  Deterministic (no RNG), and every prefix is within one sample of the weights.
void build_blending_indices(py::array_t<int16_t, py::array::c_style>& dataset_index,
                            py::array_t<int64_t, py::array::c_style>& dataset_sample_index,
                            const py::array_t<double, py::array::c_style>& weights, int32_t num_datasets,
                            int64_t size) {
  auto di = dataset_index.mutable_unchecked<1>();
  auto dsi = dataset_sample_index.mutable_unchecked<1>();
  auto w = weights.unchecked<1>();
  if (di.shape(0) < size || dsi.shape(0) < size) throw std::invalid_argument("output arrays too small");
  if (w.shape(0) != num_datasets) throw std::invalid_argument("weights length != num_datasets");
  std::vector<int64_t> counts(num_datasets, 0);
  for (int64_t i = 0; i < size; ++i) {
    const double target = std::max(static_cast<double>(i), 1.0);
    int32_t best = 0;
    double best_err = w(0) * target - static_cast<double>(counts[0]);
    for (int32_t d = 1; d < num_datasets; ++d) {
      const double err = w(d) * target - static_cast<double>(counts[d]);
      if (err > best_err) {
        best_err = err;
        best = d;
      }
    }
    di(i) = static_cast<int16_t>(best);
    dsi(i) = counts[best];
    ++counts[best];
  }
}

// T5 / sentence-level samples.  docs[k]..docs[k+1] are the sentence ids of document k
// (the .idx document_indices), sizes[s] the token count of sentence s.  A sample is
// a run of whole sentences of one document whose total length reaches a target
// length (max_seq_length, or with probability short_seq_prob a shorter random one,
// so the model also sees short inputs).  Returns int64 [N, 3]:
// (first sentence, one past the last sentence, target length), shuffled with `seed`.
py::array build_mapping(const py::array_t<int64_t, py::array::c_style>& docs,
                        const py::array_t<int32_t, py::array::c_style>& sizes, int32_t num_epochs,
                        int64_t max_num_samples, int32_t max_seq_length, double short_seq_prob,
                        int32_t seed, int32_t min_num_sent) {
  if (max_seq_length < 2) throw std::invalid_argument("max_seq_length must be >= 2");
  if (short_seq_prob < 0.0 || short_seq_prob > 1.0)
    throw std::invalid_argument("short_seq_prob must be in [0, 1]");
  auto d = docs.unchecked<1>();
  auto sz = sizes.unchecked<1>();
  const int64_t n_docs = d.shape(0) - 1;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  auto target_len = [&]() -> int32_t {
    if (short_seq_prob > 0.0 && coin(rng) < short_seq_prob)
      return std::uniform_int_distribution<int32_t>(2, max_seq_length)(rng);
    return max_seq_length;
  };

  std::vector<int64_t> flat;  // 3 entries per sample
  for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
    const size_t before = flat.size();
    if (static_cast<int64_t>(before / 3) >= max_num_samples) break;
    for (int64_t k = 0; k < n_docs; ++k) {
      const int64_t first = d(k), last = d(k + 1);
      if (last - first < min_num_sent) continue;
      // Skip documents without any token: they would make empty samples.
      bool any = false;
      for (int64_t s = first; s < last; ++s) any = any || sz(s) > 0;
      if (!any) continue;
      int64_t start = first;
      int64_t acc = 0;
      int32_t target = target_len();
      for (int64_t s = first; s < last; ++s) {
        acc += sz(s);
        const int64_t n_sent = s + 1 - start;
        const bool last_sentence = s + 1 == last;
        // Close the sample when it is long enough, but keep at least min_num_sent
        // sentences available for the next one (unless this is the document's end).
        if ((acc >= target && n_sent >= min_num_sent && last - (s + 1) >= min_num_sent) ||
            last_sentence) {
          if (acc > 0 && n_sent >= min_num_sent) {
            flat.push_back(start);
            flat.push_back(s + 1);
            flat.push_back(target);
          }
          start = s + 1;
          acc = 0;
          target = target_len();
        }
      }
    }
    // No document yields a sample: more epochs would loop for ever without progress.
    if (flat.size() == before) break;
  }
  int64_t n = static_cast<int64_t>(flat.size() / 3);
  // Fisher-Yates over whole rows so epochs and documents are mixed.
  std::mt19937_64 shuf(static_cast<uint64_t>(seed) + 1);
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(shuf() % static_cast<uint64_t>(i + 1));
    for (int c = 0; c < 3; ++c) std::swap(flat[3 * i + c], flat[3 * j + c]);
  }
  n = std::min(n, max_num_samples);
  py::array_t<int64_t> result({n, static_cast<int64_t>(3)});
  auto out = result.mutable_unchecked<2>();
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < 3; ++c) out(i, c) = flat[3 * i + c];
  return std::move(result);
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "C++ index builders for megatron.data (GPT sample index, blending, T5 mapping)";
  m.def("build_sample_idx", &build_sample_idx, "sizes"_a, "doc_idx"_a, "seq_length"_a,
        "num_epochs"_a, "tokens_per_epoch"_a, "drop_last"_a = true, "add_extra_token"_a = 1,
        "GPT sample index [N+1, 2] of (position in doc_idx, token offset); int32 or int64.");
  m.def("build_blending_indices", &build_blending_indices, "dataset_index"_a,
        "dataset_sample_index"_a, "weights"_a, "num_datasets"_a, "size"_a,
        "Fill dataset_index (int16) and dataset_sample_index (int64) greedily by weight.");
  m.def("build_mapping", &build_mapping, "docs"_a, "sizes"_a, "num_epochs"_a, "max_num_samples"_a,
        "max_seq_length"_a, "short_seq_prob"_a, "seed"_a, "min_num_sent"_a = 1,
        "Sentence-to-sample mapping int64 [N, 3] of (first sentence, end sentence, target length).");
}
