// Index helpers for the GPT dataset (sample and blending indices).
#pragma once
#include <pybind11/pybind11.h>

namespace megatronish {
void register_helpers(pybind11::module_ &m);
}
