"""The tests' own helper modules (``tests/`` is on pytest's ``pythonpath``, so tests import ``support.<name>``):
Megatron-LM's megatron-core beside ours (``megatron_core_support``), the interpreted Triton kernels
(``kernel_support``), small tokenizer files (``tokenizer_files``), the damaged-file readers run by
``tests/unit/test_fuzz_readers.py`` (``fuzz_targets``) and a local Slurm (``slurm_support``)."""
