"""What a failed start of the local Slurm (``scripts/slurm/local_cluster.sh up``) means for the Slurm tests.

The script installs Slurm's packages with apt-get when they are missing. Where no package registry is reachable
that install fails, and the tests cannot run on this machine: a skip, with one line saying why. Any other
failure (a daemon that does not start, a bad configuration) is a failure of the tests."""
from __future__ import annotations

# the script's `die` messages when apt-get fails
INSTALL_FAILURES = ("apt-get update failed", "apt-get install failed")


def up_outcome(returncode: int, stderr: str) -> tuple[str, str] | None:
    """None when the cluster came up; ``("skip", line)`` when Slurm's packages could not be installed;
    ``("fail", text)`` otherwise."""
    if returncode == 0:
        return None
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for marker in INSTALL_FAILURES:
        if any(line.endswith(f"error: {marker}") for line in lines):
            apt = [line for line in lines if line.startswith(("E:", "Err:", "W:"))]
            why = f"{marker}: {apt[-1]}" if apt else marker
            return "skip", f"Slurm is not installed and its packages could not be installed ({why})"
    return "fail", f"local Slurm did not come up (exit {returncode}):\n{stderr}"
