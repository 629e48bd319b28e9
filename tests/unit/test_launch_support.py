"""``support.launch.run_job``: a job that does not end in time fails the test with where each of its processes stood
(every thread's Python stack, the forked children's too), and leaves no process behind."""
import os
import sys

import pytest

from support.launch import alive, run_job

JOB = """
import os, sys, threading, time

def child_waits_forever():
    time.sleep(600)

def thread_waits_forever():
    time.sleep(600)

if os.fork() == 0:
    child_waits_forever()
threading.Thread(target=thread_waits_forever, daemon=True).start()
print("started", flush=True)
time.sleep(600)
"""


def test_a_job_that_does_not_end_shows_every_stack_and_is_killed(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    with pytest.raises(AssertionError) as err:
        run_job([sys.executable, str(script)], timeout=3, cwd=tmp_path)
    text = str(err.value)
    assert "did not end in 3 s" in text and "started" in text
    for frame in ("child_waits_forever", "thread_waits_forever", "<module>"):
        assert f"in {frame}" in text, text
    # nothing of the job is left: no process whose command line names the script
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(script).encode() in f.read() and alive(int(pid)):
                    left.append(pid)
        except OSError:
            pass
    assert not left


def test_a_job_that_ends_is_returned_as_subprocess_run_would():
    proc = run_job([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                   timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
