// Writing core of the indexed dataset builder (.bin/.idx pair).
//
// .idx layout (little endian):
//   9 bytes  "MMIDIDX\0\0"
//   <Q       version (1)
//   <B       dtype code
//   <Q       sequence count N
//   <Q       document count D (document indices, leading 0 included)
//   int32[N] sequence lengths, int64[N] byte pointers into .bin, int64[D] document indices
// .bin is the raw concatenation of the token arrays.
//
// The .idx is written to "<path>.tmp" and renamed into place, so an interrupted run never leaves a
// partial .idx at the final path.
#include "helpers.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

namespace megatronish {
namespace {

const char kHeader[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};

int itemsize_of_code(int code) {
  switch (code) {
    case 1: return 1;  // uint8
    case 2: return 1;  // int8
    case 3: return 2;  // int16
    case 4: return 4;  // int32
    case 5: return 8;  // int64
    case 6: return 8;  // float64
    case 7: return 4;  // float32
    case 8: return 2;  // uint16
    default: return 0;
  }
}

std::string os_error(const std::string &what, const std::string &path) {
  return what + " '" + path + "': " + std::strerror(errno);
}

class IndexedWriter {
 public:
  IndexedWriter(const std::string &bin_path, int dtype_code)
      : bin_path_(bin_path), dtype_code_(dtype_code), itemsize_(itemsize_of_code(dtype_code)) {
    if (itemsize_ == 0)
      throw py::value_error("IndexedDatasetBuilder: unknown dtype code " + std::to_string(dtype_code));
    bin_ = std::fopen(bin_path.c_str(), "wb");
    if (!bin_) throw py::value_error(os_error("IndexedDatasetBuilder: cannot open", bin_path));
    buffer_.resize(1 << 22);
    std::setvbuf(bin_, buffer_.data(), _IOFBF, buffer_.size());
    document_indices_.push_back(0);
  }

  ~IndexedWriter() {
    if (bin_) std::fclose(bin_);
  }

  // Appends one sequence; `tokens` holds its raw bytes (a whole number of items).
  void add_item(py::buffer tokens) {
    py::buffer_info info = tokens.request();
    check_open();
    const int64_t nbytes = info.size * info.itemsize;
    if (info.itemsize != itemsize_)
      throw py::value_error("IndexedDatasetBuilder.add_item: item size " +
                            std::to_string(info.itemsize) + " != dataset item size " +
                            std::to_string(itemsize_));
    write_bytes(info.ptr, nbytes);
    push_length(info.size);
  }

  // Appends several sequences at once: `tokens` is their concatenation, `lengths` their lengths.
  void add_items(py::buffer tokens, const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &lengths) {
    py::buffer_info info = tokens.request();
    check_open();
    if (info.itemsize != itemsize_)
      throw py::value_error("IndexedDatasetBuilder.add_items: item size mismatch");
    const int64_t *len = lengths.data();
    int64_t total = 0;
    for (py::ssize_t i = 0; i < lengths.size(); ++i) {
      if (len[i] < 0) throw py::value_error("IndexedDatasetBuilder: negative sequence length");
      total += len[i];
    }
    if (total != info.size)
      throw py::value_error("IndexedDatasetBuilder: sum(lengths) = " + std::to_string(total) +
                            " but the token array holds " + std::to_string(info.size) + " items");
    write_bytes(info.ptr, total * itemsize_);
    for (py::ssize_t i = 0; i < lengths.size(); ++i) push_length(len[i]);
  }

  // Appends many documents at once: `lengths` are their sequences, `doc_seq_counts` the number of
  // sequences in each document.
  void add_documents(py::buffer tokens, const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &lengths,
                     const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &doc_seq_counts) {
    const int64_t *counts = doc_seq_counts.data();
    int64_t total = 0;
    for (py::ssize_t i = 0; i < doc_seq_counts.size(); ++i) {
      if (counts[i] < 0) throw py::value_error("IndexedDatasetBuilder.add_documents: negative count");
      total += counts[i];
    }
    if (total != lengths.size())
      throw py::value_error("IndexedDatasetBuilder.add_documents: sum(document_lengths) = " +
                            std::to_string(total) + " != number of lengths " + std::to_string(lengths.size()));
    int64_t boundary = static_cast<int64_t>(lengths_.size());
    add_items(tokens, lengths);
    for (py::ssize_t i = 0; i < doc_seq_counts.size(); ++i) {
      boundary += counts[i];
      document_indices_.push_back(boundary);
    }
  }

  void end_document() { document_indices_.push_back(static_cast<int64_t>(lengths_.size())); }

  // Appends a whole dataset: its sequence lengths, its document indices (leading 0 included)
  // and the bytes of its .bin file.
  void append_dataset(const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &lengths,
                      const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &document_indices,
                      const std::string &other_bin_path) {
    check_open();
    const int64_t offset = static_cast<int64_t>(lengths_.size());
    const int32_t *len = lengths.data();
    int64_t total_items = 0;
    for (py::ssize_t i = 0; i < lengths.size(); ++i) total_items += len[i];
    FILE *src = std::fopen(other_bin_path.c_str(), "rb");
    if (!src) throw py::value_error(os_error("IndexedDatasetBuilder.add_index: cannot open", other_bin_path));
    std::vector<char> chunk(1 << 22);
    int64_t copied = 0;
    {
      py::gil_scoped_release release;
      size_t got;
      while ((got = std::fread(chunk.data(), 1, chunk.size(), src)) > 0) {
        if (std::fwrite(chunk.data(), 1, got, bin_) != got) break;
        copied += static_cast<int64_t>(got);
      }
    }
    std::fclose(src);
    if (copied != total_items * itemsize_)
      throw py::value_error("IndexedDatasetBuilder.add_index: '" + other_bin_path + "' holds " +
                            std::to_string(copied) + " bytes but its index describes " +
                            std::to_string(total_items * itemsize_));
    for (py::ssize_t i = 0; i < lengths.size(); ++i) push_length(len[i]);
    const int64_t *docs = document_indices.data();
    for (py::ssize_t i = 1; i < document_indices.size(); ++i) document_indices_.push_back(offset + docs[i]);
  }

  void finalize(const std::string &idx_path) {
    check_open();
    if (std::fclose(bin_) != 0) {
      bin_ = nullptr;
      throw py::value_error(os_error("IndexedDatasetBuilder: cannot close", bin_path_));
    }
    bin_ = nullptr;
    const std::string tmp = idx_path + ".tmp";
    FILE *f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw py::value_error(os_error("IndexedDatasetBuilder.finalize: cannot open", tmp));
    bool ok = true;
    {
      py::gil_scoped_release release;
      const uint64_t version = 1;
      const uint8_t code = static_cast<uint8_t>(dtype_code_);
      const uint64_t n = lengths_.size();
      const uint64_t d = document_indices_.size();
      ok = ok && std::fwrite(kHeader, 1, 9, f) == 9;
      ok = ok && std::fwrite(&version, 8, 1, f) == 1;  // little-endian hosts only (x86, arm64)
      ok = ok && std::fwrite(&code, 1, 1, f) == 1;
      ok = ok && std::fwrite(&n, 8, 1, f) == 1;
      ok = ok && std::fwrite(&d, 8, 1, f) == 1;
      if (n) ok = ok && std::fwrite(lengths_.data(), 4, n, f) == n;
      std::vector<int64_t> pointers(n);
      int64_t ptr = 0;
      for (uint64_t i = 0; i < n; ++i) {
        pointers[i] = ptr;
        ptr += static_cast<int64_t>(lengths_[i]) * itemsize_;
      }
      if (n) ok = ok && std::fwrite(pointers.data(), 8, n, f) == n;
      ok = ok && std::fwrite(document_indices_.data(), 8, d, f) == d;
    }
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
      std::remove(tmp.c_str());
      throw py::value_error("IndexedDatasetBuilder.finalize: write to '" + tmp + "' failed");
    }
    if (std::rename(tmp.c_str(), idx_path.c_str()) != 0)
      throw py::value_error(os_error("IndexedDatasetBuilder.finalize: cannot rename to", idx_path));
  }

  int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int itemsize() const { return itemsize_; }

 private:
  void check_open() const {
    if (!bin_) throw py::value_error("IndexedDatasetBuilder: already finalized ('" + bin_path_ + "')");
  }
  void write_bytes(const void *ptr, int64_t nbytes) {
    if (nbytes == 0) return;
    size_t wrote;
    {
      py::gil_scoped_release release;
      wrote = std::fwrite(ptr, 1, static_cast<size_t>(nbytes), bin_);
    }
    if (wrote != static_cast<size_t>(nbytes))
      throw py::value_error(os_error("IndexedDatasetBuilder: write failed on", bin_path_));
  }
  void push_length(int64_t n) {
    if (n > INT32_MAX)
      throw py::value_error("IndexedDatasetBuilder: a sequence of " + std::to_string(n) +
                            " tokens exceeds the int32 length field");
    lengths_.push_back(static_cast<int32_t>(n));
  }

  std::string bin_path_;
  int dtype_code_;
  int itemsize_;
  FILE *bin_ = nullptr;
  std::vector<char> buffer_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> document_indices_;
};

}  // namespace

void register_indexed_builder(py::module_ &m) {
  py::class_<IndexedWriter>(m, "IndexedWriter", "Streaming writer of a .bin file and its .idx index.")
      .def(py::init<const std::string &, int>(), py::arg("bin_path"), py::arg("dtype_code"))
      .def("add_item", &IndexedWriter::add_item, py::arg("tokens"))
      .def("add_items", &IndexedWriter::add_items, py::arg("tokens"), py::arg("lengths"))
      .def("add_documents", &IndexedWriter::add_documents, py::arg("tokens"), py::arg("lengths"),
           py::arg("doc_seq_counts"))
      .def("end_document", &IndexedWriter::end_document)
      .def("append_dataset", &IndexedWriter::append_dataset, py::arg("lengths"),
           py::arg("document_indices"), py::arg("bin_path"))
      .def("finalize", &IndexedWriter::finalize, py::arg("idx_path"))
      .def_property_readonly("num_sequences", &IndexedWriter::num_sequences)
      .def_property_readonly("num_documents", &IndexedWriter::num_documents)
      .def_property_readonly("itemsize", &IndexedWriter::itemsize);
}

}  // namespace megatronish
