import os
import sys

os.environ.setdefault("MEGATRONISH_DEVICE", "cpu")


def _slurm_skip_reason():
    """Why the ``slurm`` tests cannot run here (None: they can). They start a local Slurm as root and install it
    with apt-get when missing."""
    import shutil

    if os.environ.get("MEGATRONISH_SKIP_SLURM") == "1":
        return "MEGATRONISH_SKIP_SLURM=1"
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux to start slurmctld/slurmd and edit /etc/hosts"
    have = all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged"))
    if not have and not shutil.which("apt-get"):
        return "Slurm is not installed and apt-get is not available to install it"
    return None


def pytest_collection_modifyitems(config, items):
    import pytest

    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        from megatronish import device

        if not device.cuda_available():
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason="gpu test skipped: no CUDA device here "
                                                        "(scripts/device_check.sh runs these on a GPU)"))
    slurm = [item for item in items if "slurm" in item.keywords]
    reason = _slurm_skip_reason() if slurm else None
    if reason:
        for item in slurm:
            item.add_marker(pytest.mark.skip(reason=f"slurm test skipped: {reason}"))
