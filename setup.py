"""Build of the C++ extension in csrc/ (pybind11); everything else lives in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "megatronish._C",
        sorted(["csrc/module.cpp", "csrc/helpers.cpp", "csrc/indexed_builder.cpp"]),
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
