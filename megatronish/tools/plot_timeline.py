"""Draw a pipeline timeline (Chrome trace from ``--pipeline-timeline``) as a PNG and print the bubble.

    megatronish-plot-timeline TRACE.json -o timeline.png [--p 4 --v 2 --m 8]
    python tools/plot_timeline.py TRACE.json ...             # the same

One row per rank; forward boxes blue, backward boxes orange (lighter for odd chunks), p2p waits as thin
grey bars under the row; microbatch numbers on the boxes. Prints the measured bubble (idle / busy time,
averaged over ranks) beside Megatron's ``(p-1)/(v*m)``; p, v and m come from the trace's metadata or are
inferred from the events (p = ranks, v = chunks, m = microbatches), and flags override them.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import CommandLineParser
from ..parallel.pipeline.timeline import bubble_fraction, read_chrome_trace

COLORS = {("F", 0): "#4c72b0", ("F", 1): "#8fa9d6", ("B", 0): "#dd8452", ("B", 1): "#efb48f"}


def infer_shape(events, meta, p=None, v=None, m=None):
    compute = [e for e in events if e["cat"] == "compute"]
    p = p or meta.get("p") or len({e["rank"] for e in compute})
    v = v or meta.get("v") or len({e["chunk"] for e in compute if e["chunk"] is not None}) or 1
    m = m or meta.get("m") or len({e["microbatch"] for e in compute if e["microbatch"] is not None})
    return int(p), int(v), int(m)


def plot(events, out, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e["rank"] for e in events})
    t0 = min(e["start"] for e in events)
    width = max(e["end"] for e in events) - t0
    fig, ax = plt.subplots(figsize=(14, 0.7 * len(ranks) + 1.6))
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row  # rank 0 on top
        for e in (e for e in events if e["rank"] == rank):
            x, w = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3  # milliseconds
            if e["cat"] == "comm":
                ax.broken_barh([(x, w)], (y - 0.45, 0.1), color="#999999")
                continue
            color = COLORS.get((e["name"], (e["chunk"] or 0) % 2), "#55a868")
            ax.broken_barh([(x, w)], (y - 0.3, 0.7), facecolor=color, edgecolor="black", linewidth=0.4)
            if e["microbatch"] is not None and w > width * 1e3 * 0.008:
                ax.text(x + w / 2, y + 0.05, str(e["microbatch"]), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=COLORS[("F", 0)], label="forward (chunk 0)"),
                       Patch(color=COLORS[("F", 1)], label="forward (chunk 1)"),
                       Patch(color=COLORS[("B", 0)], label="backward (chunk 0)"),
                       Patch(color=COLORS[("B", 1)], label="backward (chunk 1)"),
                       Patch(color="#999999", label="p2p")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.5 / len(ranks)), fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = CommandLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("-o", "--output", default=None, help="PNG path (default: TRACE with .png)")
    ap.add_argument("--p", type=int, default=None, help="pipeline size (default: from the trace)")
    ap.add_argument("--v", type=int, default=None, help="virtual stages per rank (default: from the trace)")
    ap.add_argument("--m", type=int, default=None, help="microbatches per iteration (default: from the trace)")
    args = ap.parse_args(argv)
    events, meta = read_chrome_trace(args.trace)
    if not events:
        sys.exit(f"{args.trace}: no events")
    p, v, m = infer_shape(events, meta, args.p, args.v, args.m)
    b = bubble_fraction(events)
    formula = (p - 1) / (v * m)
    line = (f"p={p} v={v} m={m}: measured bubble {b['bubble']:.3f} (idle/busy; {b['idle_of_total']:.1%} of the "
            f"{b['window'] * 1e3:.1f} ms window)  formula (p-1)/(v*m) = {formula:.3f}")
    out = args.output or os.path.splitext(args.trace)[0] + ".png"
    plot(events, out, line)
    print(line)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
