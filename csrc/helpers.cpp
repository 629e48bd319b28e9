#include "helpers.h"

#include <cstdint>

namespace megatronish {

// Whole samples of `seq_length` tokens (plus the one extra label token) in `num_tokens` tokens.
static int64_t num_samples(int64_t num_tokens, int64_t seq_length) {
  if (seq_length <= 0) throw pybind11::value_error("seq_length must be positive");
  if (num_tokens <= 1) return 0;
  return (num_tokens - 1) / seq_length;
}

void register_helpers(pybind11::module_ &m) {
  m.def("num_samples", &num_samples, pybind11::arg("num_tokens"), pybind11::arg("seq_length"),
        "Whole samples of seq_length tokens (+1 label token) in num_tokens tokens.");
}

}  // namespace megatronish
