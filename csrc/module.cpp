// The megatronish._C extension module: each source file registers its functions here.
#include <pybind11/pybind11.h>

#include "helpers.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "megatronish C++ helpers";
  megatronish::register_helpers(m);
}
