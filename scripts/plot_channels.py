#!/usr/bin/python3
"""Render a communication pattern recording as PNGs.

Ember writes a recording when [communication] record_pattern = true (file:
record_path; format: common/record/recording.h). This script draws:

  <prefix>channels.png  head and tail position (messages) of every channel
                        over time, and the occupancy (tail - head) below
  <prefix>sizes.png     message-size distribution per channel (log-scale
                        size buckets, four per power of two)
  <prefix>ranks.png     bytes sent per worker rank; ranks above twice the
                        mean ("hot ranks") in red

Usage:
  /usr/bin/python3 scripts/plot_channels.py RECORDING [--out DIR] [--prefix P]

Needs Debian's python3-matplotlib (and python3-numpy); uses the Agg backend,
so no display is needed. Exit codes: 0 written, 1 unreadable or malformed
recording, 2 bad usage.
"""

import argparse
import os
import sys

FORMAT_MAGIC = "ember-record"
FORMAT_VERSION = 1


class RecordingError(Exception):
    pass


def parse_recording(path):
    """Returns a dict with the header fields and lists c, r, h (see the C++ reader)."""
    rec = {"source": "", "channels": 0, "ranks": 0, "c": [], "r": [], "h": [],
           "complete": False, "duration_ns": 0}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise RecordingError(f"cannot read recording '{path}': {e.strerror}") from e
    if not lines or lines[0].strip() != f"{FORMAT_MAGIC} {FORMAT_VERSION}":
        raise RecordingError(f"{path}:1: not an Ember recording (first line must be "
                             f"'{FORMAT_MAGIC} {FORMAT_VERSION}')")
    in_data = False
    for no, line in enumerate(lines[1:], start=2):
        if not line or line.startswith("#"):
            continue
        if not in_data:
            if line == "data":
                in_data = True
                continue
            key, _, value = line.partition(" ")
            if key == "source":
                rec["source"] = value
            elif key in ("channels", "ranks", "start_unix_ns", "sample_interval_ns"):
                try:
                    rec[key] = int(value)
                except ValueError as e:
                    raise RecordingError(f"{path}:{no}: header field '{key}' needs a number") from e
            else:
                raise RecordingError(f"{path}:{no}: unknown header field '{key}'")
            continue
        fields = line.split()
        kind, nums = fields[0], fields[1:]
        want = {"c": 6, "r": 4, "h": 4, "end": 3}.get(kind)
        if want is None:
            raise RecordingError(f"{path}:{no}: unknown record type '{kind}'")
        if len(nums) != want:
            raise RecordingError(f"{path}:{no}: '{kind}' record needs {want} fields, got {len(nums)}")
        try:
            vals = [int(x) for x in nums]
        except ValueError as e:
            raise RecordingError(f"{path}:{no}: a field is not a number") from e
        if kind == "end":
            rec["complete"] = True
            rec["duration_ns"] = vals[0]
            continue
        limit = rec["ranks"] if kind == "r" else rec["channels"]
        ident = vals[1] if kind in ("c", "r") else vals[0]
        if ident >= limit:
            raise RecordingError(f"{path}:{no}: id {ident} outside 0 .. {limit - 1}")
        rec[kind].append(vals)
    if not in_data:
        raise RecordingError(f"{path}: no 'data' line: the header is incomplete")
    return rec


def plot_channels(rec, out_path, plt):
    n = rec["channels"]
    fig, (ax_pos, ax_occ) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    cmap = plt.get_cmap("tab10")
    for c in range(n):
        samples = sorted((s for s in rec["c"] if s[1] == c), key=lambda s: s[0])
        if not samples:
            continue
        t_ms = [s[0] / 1e6 for s in samples]
        head = [s[2] for s in samples]
        tail = [s[3] for s in samples]
        color = cmap(c % 10)
        ax_pos.step(t_ms, tail, where="post", color=color, label=f"ch {c} tail")
        ax_pos.step(t_ms, head, where="post", color=color, linestyle="--", label=f"ch {c} head")
        ax_occ.step(t_ms, [max(0, tl - hd) for hd, tl in zip(head, tail)], where="post",
                    color=color, label=f"ch {c}")
    ax_pos.set_ylabel("position (messages)")
    ax_pos.set_title(f"channel head/tail over time — {rec['source']}")
    ax_pos.legend(fontsize="small", ncol=2)
    ax_occ.set_ylabel("queued (tail - head)")
    ax_occ.set_xlabel("time since start (ms)")
    ax_occ.legend(fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)


def plot_sizes(rec, out_path, plt):
    n = rec["channels"]
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1, 2.8 * rows + 0.8), squeeze=False)
    for c in range(n):
        ax = axes[c // cols][c % cols]
        buckets = sorted((b for b in rec["h"] if b[0] == c), key=lambda b: b[1])
        if buckets:
            lo = [max(b[1], 1) for b in buckets]
            width = [max(b[2] - b[1], 1) for b in buckets]
            ax.bar(lo, [b[3] for b in buckets], width=width, align="edge", color="tab:blue")
            ax.set_xscale("log", base=2)
        else:
            ax.text(0.5, 0.5, "no messages", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"channel {c}", fontsize="small")
        ax.set_xlabel("message bytes", fontsize="small")
        ax.set_ylabel("messages", fontsize="small")
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(f"message sizes per channel — {rec['source']}")
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)


def rank_totals(rec):
    """Bytes and messages per rank: the last sample of each rank."""
    last = {}
    for t, rank, nbytes, msgs in rec["r"]:
        if rank not in last or t >= last[rank][0]:
            last[rank] = (t, nbytes, msgs)
    return [last.get(r, (0, 0, 0))[1] for r in range(rec["ranks"])]


def plot_ranks(rec, out_path, plt):
    totals = rank_totals(rec)
    mean = sum(totals) / len(totals) if totals else 0
    hot = [len(totals) > 1 and b > 2 * mean for b in totals]
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(totals) + 2), 4))
    ax.bar(range(len(totals)), [b / 2**20 for b in totals],
           color=["tab:red" if h else "tab:blue" for h in hot])
    if mean > 0:
        ax.axhline(2 * mean / 2**20, color="gray", linestyle=":", label="2 x mean (hot above)")
        ax.legend(fontsize="small")
    ax.set_xlabel("worker rank")
    ax.set_ylabel("MiB sent")
    ax.set_title(f"bytes per rank — {rec['source']}")
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return [r for r, h in enumerate(hot) if h]


def main(argv):
    ap = argparse.ArgumentParser(
        description="Render an Ember communication pattern recording as PNGs "
                    "(channels.png, sizes.png, ranks.png).")
    ap.add_argument("recording", help="file written with [communication] record_pattern = true")
    ap.add_argument("--out", default=".", help="output directory (created if missing)")
    ap.add_argument("--prefix", default="", help="prefix for the PNG file names")
    args = ap.parse_args(argv)
    try:
        rec = parse_recording(args.recording)
    except RecordingError as e:
        print(f"plot_channels: {e}", file=sys.stderr)
        return 1
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_channels: matplotlib is missing; install Debian's python3-matplotlib and run "
              "with /usr/bin/python3", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    paths = {k: os.path.join(args.out, f"{args.prefix}{k}.png") for k in ("channels", "sizes", "ranks")}
    plot_channels(rec, paths["channels"], plt)
    plot_sizes(rec, paths["sizes"], plt)
    hot = plot_ranks(rec, paths["ranks"], plt)
    if not rec["complete"]:
        print("plot_channels: warning: the recording has no 'end' line (cut short)", file=sys.stderr)
    for p in paths.values():
        print(f"plot_channels: wrote {p}")
    if hot:
        print(f"plot_channels: hot ranks (over twice the mean bytes): {', '.join(map(str, hot))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
