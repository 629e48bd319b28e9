"""Precision: FP8 (Transformer Engine selection on GPU, emulated delayed/current scaling on CPU)."""
from .fp8 import (
                  Fp8Manager,
                  Fp8Recipe,
                  check_transformer_impl,
                  disable_fp8,
                  enable_fp8,
                  fp8_autocast,
                  import_transformer_engine,
)

__all__ = ["Fp8Manager", "Fp8Recipe", "check_transformer_impl", "disable_fp8", "enable_fp8", "fp8_autocast",
           "import_transformer_engine"]
