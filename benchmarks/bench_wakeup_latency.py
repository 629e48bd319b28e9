"""How long a message takes to wake the rank waiting for it, as a function of how long that rank waited.

The pipeline bubble benchmark (``bench_pipeline_bubble.py``) measures idle time on a timeline; on this machine part
of that idle time is not the schedule's but the message's: the one-way time of a pipeline message grows with the
time the receiver spent blocked before it. This prints, for each wait ``t``:

- ``gloo``: the median one-way time of a pipeline message between two forked gloo ranks, sent ``t`` after the
  previous one (``bench_pipeline_bubble.message_latency``: the runner's own ``P2PCommunicator``);
- ``socket``: the same over a bare ``socketpair`` between two forked processes (no torch: the operating system's
  and the virtual machine's part alone);

and repeats both with ``--busy`` processes per core spinning at the lowest priority (``SCHED_IDLE``), which keeps
every core from going idle: if the wake-up cost were a halted core's, these would remove it.

    PYTHONPATH=. python benchmarks/bench_wakeup_latency.py [--waits-ms 0 20 100 300 1000] [--busy 1]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import struct
import time

from bench_pipeline_bubble import message_latency


def socket_latency(t: float, n: int = 9) -> float:
    """Median one-way seconds of an 8-byte message over a socketpair, each sent ``t`` after the last reply."""
    import socket

    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        for _ in range(n):
            time.sleep(t)
            a.sendall(struct.pack("d", time.time()))
            a.recv(1)
        os._exit(0)
    late = []
    for _ in range(n):
        sent = struct.unpack("d", b.recv(8))[0]
        late.append(time.time() - sent)
        b.sendall(b"x")
    os.waitpid(pid, 0)
    return sorted(late)[n // 2]


def _spin() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waits-ms", type=float, nargs="+", default=[0, 20, 100, 300, 1000])
    ap.add_argument("--busy", type=int, default=1, help="SCHED_IDLE spinners per core in the second pass")
    ap.add_argument("--messages", type=int, default=15, help="messages per gloo measurement (the median)")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    print(f"one-way message time (ms, median) after the receiver waited t; {cores} cores")
    print(f"{'t (ms)':>8}  {'gloo':>8}  {'socket':>8}  {'gloo, cores busy':>16}  {'socket, cores busy':>18}")
    rows = {t: [message_latency(t / 1e3, args.messages), socket_latency(t / 1e3)] for t in args.waits_ms}
    spinners = [multiprocessing.get_context("fork").Process(target=_spin, daemon=True)
                for _ in range(args.busy * cores)]
    for s in spinners:
        s.start()
    try:
        for t in args.waits_ms:
            rows[t] += [message_latency(t / 1e3, args.messages), socket_latency(t / 1e3)]
    finally:
        for s in spinners:
            s.terminate()
    for t, (g, s, gb, sb) in rows.items():
        print(f"{t:8g}  {g * 1e3:8.3f}  {s * 1e3:8.3f}  {gb * 1e3:16.3f}  {sb * 1e3:18.3f}", flush=True)


if __name__ == "__main__":
    main()
