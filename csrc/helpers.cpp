// Index helpers for the GPT dataset: the sample index (where each fixed-length sample starts in
// the shuffled document order) and the blending indices (which dataset, and which of its samples,
// each position of a blended dataset reads).
#include "helpers.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

namespace py = pybind11;

namespace megatronish {

// Number of whole samples of `seq_length` tokens (plus the one extra label token) that
// `num_tokens` tokens give: floor((num_tokens - 1) / seq_length).
static int64_t num_samples(int64_t num_tokens, int64_t seq_length) {
  if (seq_length <= 0) throw py::value_error("seq_length must be positive");
  if (num_tokens <= 1) return 0;
  return (num_tokens - 1) / seq_length;
}

// Sample index: row i = (position in document_idx, token offset inside that document) where
// sample i starts; row num_samples is where the last sample ends. Each sample consumes
// seq_length + extra tokens, and the next sample starts `extra` tokens before the previous one
// ended, so consecutive samples share exactly the extra (label) token.
template <typename T>
static py::array_t<T> build_sample_idx_impl(const py::array_t<int32_t, py::array::c_style> &sizes_,
                                            const py::array_t<int32_t, py::array::c_style> &document_idx_,
                                            int32_t seq_length, int32_t num_epochs,
                                            int64_t tokens_per_epoch, bool drop_last_partial_sequence,
                                            int add_extra_token_to_sequence) {
  if (seq_length <= 1) throw py::value_error("build_sample_idx: seq_length must be > 1");
  if (num_epochs <= 0) throw py::value_error("build_sample_idx: num_epochs must be > 0");
  if (tokens_per_epoch <= 1) throw py::value_error("build_sample_idx: tokens_per_epoch must be > 1");
  if (add_extra_token_to_sequence != 0 && add_extra_token_to_sequence != 1)
    throw py::value_error("build_sample_idx: add_extra_token_to_sequence must be 0 or 1");
  if (sizes_.ndim() != 1 || document_idx_.ndim() != 1)
    throw py::value_error("build_sample_idx: sizes and document_idx must be 1-D");
  const int64_t num_docs = document_idx_.shape(0);
  if (num_docs == 0) throw py::value_error("build_sample_idx: document_idx is empty");

  const int32_t *sizes = sizes_.data();
  const int32_t *document_idx = document_idx_.data();
  const int64_t num_sizes = sizes_.shape(0);
  for (int64_t i = 0; i < num_docs; ++i) {
    if (document_idx[i] < 0 || document_idx[i] >= num_sizes)
      throw py::value_error("build_sample_idx: document_idx[" + std::to_string(i) + "] = " +
                            std::to_string(document_idx[i]) + " is outside sizes (length " +
                            std::to_string(num_sizes) + ")");
  }

  const int64_t extra = add_extra_token_to_sequence;
  const int64_t total = static_cast<int64_t>(num_epochs) * tokens_per_epoch - extra;
  int64_t n_samples;
  if (drop_last_partial_sequence) {
    n_samples = total / seq_length;
  } else {
    n_samples = (total + seq_length - 1) / seq_length;  // ceil
  }
  if (n_samples < 0) n_samples = 0;

  py::array_t<T> out({n_samples + 1, static_cast<int64_t>(2)});
  T *idx = out.mutable_data();
  {
    py::gil_scoped_release release;
    int64_t row = 0;
    int64_t doc_pos = 0;     // position in document_idx
    int64_t doc_offset = 0;  // tokens of that document already consumed
    idx[0] = 0;
    idx[1] = 0;
    ++row;
    while (row <= n_samples) {
      int64_t remaining = seq_length + extra;
      while (remaining != 0) {
        const int64_t doc_len = static_cast<int64_t>(sizes[document_idx[doc_pos]]) - doc_offset;
        remaining -= doc_len;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts `extra` tokens earlier.
          doc_offset += remaining + doc_len - extra;
          remaining = 0;
        } else if (doc_pos == num_docs - 1) {
          // Out of documents: only the final partial sample can get here.
          doc_offset = static_cast<int64_t>(sizes[document_idx[doc_pos]]) - extra;
          break;
        } else {
          ++doc_pos;
          doc_offset = 0;
        }
      }
      idx[2 * row] = static_cast<T>(doc_pos);
      idx[2 * row + 1] = static_cast<T>(doc_offset);
      ++row;
    }
  }
  return out;
}

// Greedy blend: sample s goes to the dataset whose achieved count lags its target
// weight * max(s, 1) the most (ties go to the lowest index).
static void build_blending_indices(py::array_t<int16_t, py::array::c_style> &dataset_index,
                                   py::array_t<int64_t, py::array::c_style> &dataset_sample_index,
                                   const py::array_t<double, py::array::c_style | py::array::forcecast> &weights,
                                   int32_t num_datasets, int64_t size, bool verbose) {
  if (num_datasets <= 0) throw py::value_error("build_blending_indices: num_datasets must be > 0");
  if (weights.ndim() != 1 || weights.shape(0) < num_datasets)
    throw py::value_error("build_blending_indices: weights has fewer than num_datasets entries");
  if (dataset_index.ndim() != 1 || dataset_sample_index.ndim() != 1 ||
      dataset_index.shape(0) < size || dataset_sample_index.shape(0) < size)
    throw py::value_error("build_blending_indices: output arrays are shorter than size");
  if (num_datasets > std::numeric_limits<int16_t>::max())
    throw py::value_error("build_blending_indices: at most 32767 datasets");
  if (verbose) std::cout << "> building indices for blended datasets ..." << std::endl;

  int16_t *ds_idx = dataset_index.mutable_data();
  int64_t *ds_sample = dataset_sample_index.mutable_data();
  const double *w = weights.data();
  std::vector<int64_t> current(num_datasets, 0);
  {
    py::gil_scoped_release release;
    for (int64_t s = 0; s < size; ++s) {
      const double s_double = std::max(static_cast<double>(s), 1.0);
      int32_t best = 0;
      double best_err = w[0] * s_double - static_cast<double>(current[0]);
      for (int32_t d = 1; d < num_datasets; ++d) {
        const double err = w[d] * s_double - static_cast<double>(current[d]);
        if (err > best_err) {
          best_err = err;
          best = d;
        }
      }
      ds_idx[s] = static_cast<int16_t>(best);
      ds_sample[s] = current[best];
      current[best] += 1;
    }
  }
  if (verbose) {
    std::cout << " > sample ratios:" << std::endl;
    for (int32_t d = 0; d < num_datasets; ++d) {
      std::cout << "   dataset " << d << ", input: " << w[d]
                << ", achieved: " << static_cast<double>(current[d]) / static_cast<double>(size)
                << std::endl;
    }
  }
}

// Exhaustive blend: exactly sizes[d] samples from dataset d, interleaved by the same greedy rule
// with weights sizes / sum(sizes); a dataset leaves the competition once it is spent.
static void build_exhaustive_blending_indices(py::array_t<int16_t, py::array::c_style> &dataset_index,
                                              py::array_t<int64_t, py::array::c_style> &dataset_sample_index,
                                              const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &sizes_,
                                              int32_t num_datasets) {
  if (num_datasets <= 0)
    throw py::value_error("build_exhaustive_blending_indices: num_datasets must be > 0");
  if (sizes_.ndim() != 1 || sizes_.shape(0) < num_datasets)
    throw py::value_error("build_exhaustive_blending_indices: sizes has fewer than num_datasets entries");
  if (num_datasets > std::numeric_limits<int16_t>::max())
    throw py::value_error("build_exhaustive_blending_indices: at most 32767 datasets");
  const int64_t *sizes = sizes_.data();
  int64_t total = 0;
  for (int32_t d = 0; d < num_datasets; ++d) {
    if (sizes[d] < 0) throw py::value_error("build_exhaustive_blending_indices: negative size");
    total += sizes[d];
  }
  if (dataset_index.ndim() != 1 || dataset_sample_index.ndim() != 1 ||
      dataset_index.shape(0) < total || dataset_sample_index.shape(0) < total)
    throw py::value_error("build_exhaustive_blending_indices: output arrays are shorter than sum(sizes)");

  int16_t *ds_idx = dataset_index.mutable_data();
  int64_t *ds_sample = dataset_sample_index.mutable_data();
  std::vector<double> w(num_datasets);
  std::vector<int64_t> current(num_datasets, 0);
  std::vector<int32_t> unspent;  // ascending dataset ids still holding samples
  for (int32_t d = 0; d < num_datasets; ++d) {
    w[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
    if (sizes[d] > 0) unspent.push_back(d);
  }
  {
    py::gil_scoped_release release;
    int64_t s = 0;
    while (!unspent.empty()) {
      const double s_double = std::max(static_cast<double>(s), 1.0);
      size_t best_pos = 0;
      double best_err = std::numeric_limits<double>::lowest();
      for (size_t k = 0; k < unspent.size(); ++k) {
        const int32_t d = unspent[k];
        const double err = w[d] * s_double - static_cast<double>(current[d]);
        if (err > best_err) {
          best_err = err;
          best_pos = k;
        }
      }
      const int32_t best = unspent[best_pos];
      ds_idx[s] = static_cast<int16_t>(best);
      ds_sample[s] = current[best];
      current[best] += 1;
      if (current[best] == sizes[best]) unspent.erase(unspent.begin() + best_pos);
      ++s;
    }
  }
}

// Sample gather: the tokens of a batch of GPT samples copied from the memory-mapped .bin into one
// [batch, want] int64 array, one contiguous copy per document span. `bounds` row k is
// (doc_beg, off_beg, doc_end, off_end) of sample k (two consecutive rows of the sample index):
// the sample runs from token off_beg of document_index[doc_beg] to token off_end + extra of
// document_index[doc_end] (whole documents in between). Rows shorter than `want` are filled with
// `pad`; `filled` receives the number of real tokens of each row.
template <typename D>
static void gather_rows(const uint8_t *bin, int64_t bin_size, const int64_t *pointers, const int32_t *lengths,
                        int64_t num_sequences, const int32_t *documents, int64_t num_documents,
                        const int64_t *bounds, int64_t batch, int64_t want, int64_t extra, int64_t pad,
                        int64_t *out, int64_t *filled, std::string &error) {
  for (int64_t k = 0; k < batch; ++k) {
    const int64_t doc_beg = bounds[4 * k], off_beg = bounds[4 * k + 1];
    const int64_t doc_end = bounds[4 * k + 2], off_end = bounds[4 * k + 3];
    int64_t *row = out + k * want;
    int64_t n = 0;
    if (doc_beg < 0 || doc_end < doc_beg || doc_end >= num_documents) {
      error = "sample " + std::to_string(k) + " has document positions out of range";
      return;
    }
    for (int64_t i = doc_beg; i <= doc_end; ++i) {
      const int64_t seq = documents[i];
      if (seq < 0 || seq >= num_sequences) {
        error = "document index entry " + std::to_string(i) + " names sequence " + std::to_string(seq) +
                " of " + std::to_string(num_sequences);
        return;
      }
      const int64_t seq_len = lengths[seq];
      const int64_t offset = i == doc_beg ? off_beg : 0;
      const int64_t stop = i == doc_end ? off_end + extra : seq_len;
      if (offset < 0 || stop > seq_len || stop < offset) {
        error = "span [" + std::to_string(offset) + ", " + std::to_string(stop) + ") is outside sequence " +
                std::to_string(seq) + " of length " + std::to_string(seq_len);
        return;
      }
      const int64_t count = std::min(stop - offset, want - n);
      const int64_t byte = pointers[seq] + offset * static_cast<int64_t>(sizeof(D));
      if (byte < 0 || byte + count * static_cast<int64_t>(sizeof(D)) > bin_size) {
        error = "sequence " + std::to_string(seq) + " lies outside the .bin file";
        return;
      }
      const D *src = reinterpret_cast<const D *>(bin + byte);
      if constexpr (std::is_same<D, int64_t>::value) {
        std::memcpy(row + n, src, count * sizeof(int64_t));
      } else {
        for (int64_t t = 0; t < count; ++t) row[n + t] = static_cast<int64_t>(src[t]);
      }
      n += count;
    }
    filled[k] = n;
    for (int64_t t = n; t < want; ++t) row[t] = pad;
  }
}

// The token file of one indexed dataset, held for gather calls: the .bin bytes and the .idx pointers and
// lengths (numpy arrays kept alive by this object; the .bin is a read-only memory map).
class SampleReader {
 public:
  SampleReader(py::array_t<uint8_t, py::array::c_style> bin, int dtype_code,
               py::array_t<int64_t, py::array::c_style> pointers, py::array_t<int32_t, py::array::c_style> lengths)
      : bin_(std::move(bin)), pointers_(std::move(pointers)), lengths_(std::move(lengths)), code_(dtype_code) {
    if (pointers_.ndim() != 1 || lengths_.ndim() != 1 || pointers_.shape(0) != lengths_.shape(0))
      throw py::value_error("SampleReader: pointers and lengths must be 1-D of one length");
    if (code_ < 1 || code_ > 8) throw py::value_error("SampleReader: unknown dtype code " + std::to_string(code_));
  }

  py::array_t<int64_t> gather(const py::array_t<int32_t, py::array::c_style> &documents,
                              const py::array_t<int64_t, py::array::c_style> &bounds, int64_t extra, int64_t pad,
                              py::array_t<int64_t, py::array::c_style> &out) const {
    if (bounds.ndim() != 2 || bounds.shape(1) != 4) throw py::value_error("gather: bounds must be [batch, 4]");
    const int64_t batch = bounds.shape(0);
    if (out.ndim() != 2 || out.shape(0) != batch) throw py::value_error("gather: out must be [batch, want]");
    const int64_t want = out.shape(1);
    py::array_t<int64_t> filled(batch);
    const uint8_t *b = bin_.data();
    const int64_t bin_size = bin_.size();
    const int64_t *p = pointers_.data();
    const int32_t *l = lengths_.data();
    const int32_t *d = documents.data();
    const int64_t *bd = bounds.data();
    int64_t *o = out.mutable_data();
    int64_t *f = filled.mutable_data();
    const int64_t ns = pointers_.shape(0), nd = documents.shape(0);
    std::string error;
    {
      py::gil_scoped_release release;
      switch (code_) {
        case 1: gather_rows<uint8_t>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error); break;
        case 2: gather_rows<int8_t>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error); break;
        case 3: gather_rows<int16_t>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error); break;
        case 4: gather_rows<int32_t>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error); break;
        case 5: gather_rows<int64_t>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error); break;
        case 6: gather_rows<double>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error); break;
        case 7: gather_rows<float>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error); break;
        default: gather_rows<uint16_t>(b, bin_size, p, l, ns, d, nd, bd, batch, want, extra, pad, o, f, error);
      }
    }
    if (!error.empty()) throw py::index_error("gather: " + error);
    return filled;
  }

 private:
  py::array_t<uint8_t, py::array::c_style> bin_;
  py::array_t<int64_t, py::array::c_style> pointers_;
  py::array_t<int32_t, py::array::c_style> lengths_;
  int code_;
};

void register_helpers(py::module_ &m) {
  py::class_<SampleReader>(m, "SampleReader")
      .def(py::init<py::array_t<uint8_t, py::array::c_style>, int, py::array_t<int64_t, py::array::c_style>,
                    py::array_t<int32_t, py::array::c_style>>(),
           py::arg("bin"), py::arg("dtype_code"), py::arg("pointers"), py::arg("lengths"))
      .def("gather", &SampleReader::gather, py::arg("documents"), py::arg("bounds"), py::arg("extra"),
           py::arg("pad"), py::arg("out"),
           "Copy a batch of samples (document spans per bounds row) into out [batch, want] int64; pad the "
           "rest; return the real token count of each row.");
  m.def("num_samples", &num_samples, py::arg("num_tokens"), py::arg("seq_length"),
        "Whole samples of seq_length tokens (+1 label token) in num_tokens tokens.");
  m.def("build_sample_idx_int32", &build_sample_idx_impl<int32_t>, py::arg("sizes"),
        py::arg("document_idx"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"), py::arg("drop_last_partial_sequence") = true,
        py::arg("add_extra_token_to_sequence") = 1, "Sample index [num_samples + 1, 2], int32.");
  m.def("build_sample_idx_int64", &build_sample_idx_impl<int64_t>, py::arg("sizes"),
        py::arg("document_idx"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"), py::arg("drop_last_partial_sequence") = true,
        py::arg("add_extra_token_to_sequence") = 1, "Sample index [num_samples + 1, 2], int64.");
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"),
        py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"),
        py::arg("size"), py::arg("verbose"),
        "Fill dataset_index (int16) / dataset_sample_index (int64) by the greedy weighted rule.");
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
        py::arg("dataset_index"), py::arg("dataset_sample_index"), py::arg("sizes"),
        py::arg("num_datasets"),
        "Fill the blending indices drawing exactly sizes[d] samples from dataset d.");
  register_indexed_builder(m);
}

}  // namespace megatronish
