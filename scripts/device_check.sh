#!/usr/bin/env bash
# The first-GPU check (docs/device_check.md): environment, the gpu-marked tests, Transformer Engine FP8, MFU of a
# ~1B Llama, kernel speed and generation speed; at most 8 minutes on one H100/H200. Writes device_check.json
# ($OUT/device_check.json when OUT is set, else ./device_check.json; --output PATH to choose) and prints a summary.
#
#   scripts/device_check.sh                  # on the GPU machine
#   scripts/device_check.sh --cpu-rehearsal  # the same steps at tiny sizes on CPU; CUDA-only parts skipped
#   scripts/device_check.sh --steps env mfu  # only some steps
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m megatronish.tools.device_check "$@"
