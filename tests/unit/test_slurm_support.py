"""The Slurm tests' decision when the local cluster does not come up: packages that cannot be installed (no
reachable package registry) skip them with one line saying why; anything else fails them."""
import os
import re

from support.slurm_support import INSTALL_FAILURES, up_outcome

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                      "slurm", "local_cluster.sh")

# local_cluster.sh's stderr offline: apt's log tail, then its `die` line
OFFLINE_UPDATE = """local_cluster: installing slurmctld slurmd slurm-client munge (apt-get)
Err:1 http://deb.debian.org/debian bookworm InRelease
  Temporary failure resolving 'deb.debian.org'
W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  Temporary failure resolving 'deb.debian.org'
E: Some index files failed to download. They have been ignored, or old ones used instead.
local_cluster: error: apt-get update failed
"""
OFFLINE_INSTALL = """local_cluster: installing slurmctld slurmd slurm-client munge (apt-get)
Reading package lists...
E: Unable to locate package slurmctld
local_cluster: error: apt-get install failed
"""
DAEMON = """local_cluster: start failed; logs follow, tearing down
slurmctld: fatal: Unable to bind listen port (26817): Address already in use
local_cluster: error: slurmctld did not start
"""


def test_offline_install_is_a_one_line_skip():
    for stderr, marker, apt in ((OFFLINE_UPDATE, "apt-get update failed", "E: Some index files failed"),
                                (OFFLINE_INSTALL, "apt-get install failed", "E: Unable to locate package")):
        kind, why = up_outcome(1, stderr)
        assert kind == "skip" and "\n" not in why, why
        assert why.startswith("Slurm is not installed and its packages could not be installed") and marker in why
        assert apt in why, why


def test_other_failures_fail_and_success_runs():
    kind, text = up_outcome(1, DAEMON)
    assert kind == "fail" and "slurmctld did not start" in text
    assert up_outcome(1, "")[0] == "fail"
    assert up_outcome(0, OFFLINE_UPDATE) is None


def test_the_script_still_says_what_the_decision_reads():
    text = open(SCRIPT).read()
    assert re.search(r'die\(\) \{ log "error: \$\*"', text), "local_cluster.sh's die no longer prints 'error: '"
    for marker in INSTALL_FAILURES:
        assert f'die "{marker}"' in text, marker
