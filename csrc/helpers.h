// Data helpers of the megatronish._C module: GPT sample / blending indices (helpers.cpp) and the
// writing core of the indexed dataset builder (indexed_builder.cpp).
#pragma once
#include <pybind11/pybind11.h>

namespace megatronish {
// Registers every data helper; calls register_indexed_builder.
void register_helpers(pybind11::module_ &m);
void register_indexed_builder(pybind11::module_ &m);
}
