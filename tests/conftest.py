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


_NOT_RUN: list[str] = []  # lines for the end of the run


def pytest_terminal_summary(terminalreporter):
    for line in _NOT_RUN:
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    import pytest

    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        from megatronish import device

        if not device.cuda_available():
            if "gpu" in (config.getoption("markexpr") or ""):  # asked for (-m gpu): each skips with its reason
                for item in gpu:
                    item.add_marker(pytest.mark.skip(reason="gpu test skipped: no CUDA device here "
                                                            "(scripts/device_check.sh runs these on a GPU)"))
            else:  # the CPU suite: not collected, said once at the end (no skips in a CPU run)
                config.hook.pytest_deselected(items=gpu)
                items[:] = [item for item in items if "gpu" not in item.keywords]
                _NOT_RUN.append(f"{len(gpu)} gpu tests not run: no CUDA device here (scripts/device_check.sh "
                                "runs them on a GPU)")
    slurm = [item for item in items if "slurm" in item.keywords]
    reason = _slurm_skip_reason() if slurm else None
    if reason:
        for item in slurm:
            item.add_marker(pytest.mark.skip(reason=f"slurm test skipped: {reason}"))
