"""Plots and tables for docs/results.md from the JSON of bench/reload.py and bench/fanout.py.

    python bench/reload.py --json > reload.json
    python bench/fanout.py --json > fanout.json
    python bench/plot_transport.py reload.json fanout.json --out docs/

writes ``reload_vs_change.png`` (dense and delta reload time and the floor against the change
rate, per link rate, largest model), ``fanout_vs_receivers.png`` (time to the last receiver
against the number of receivers, store vs relay trees), ``reload_timeline.png`` (the per-stage
spans of one delta reload), and prints both benchmarks' markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def plot_reload(res: dict, out: str, plt) -> list:
    import reload
    rows = res["rows"]
    big = max(r["elements"] for r in rows)
    rates = sorted({r["link_mbit"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 3.6), squeeze=False)
    for ax, mbit in zip(axes[0], rates):
        for via, mark in (("s3", "o"), ("relay", "s")):
            rs = sorted((r for r in rows if r["elements"] == big and r["link_mbit"] == mbit and r["via"] == via),
                        key=lambda r: r["change"])
            x = [100 * r["change"] for r in rs]
            ax.plot(x, [r["delta"]["seconds"] for r in rs], marker=mark, label=f"delta via {via}")
            ax.plot(x, [r["dense"] for r in rs], marker=mark, linestyle=":", label=f"dense via {via}")
        rs = sorted((r for r in rows if r["elements"] == big and r["link_mbit"] == mbit and r["via"] == "s3"),
                    key=lambda r: r["change"])
        ax.plot([100 * r["change"] for r in rs], [r["floor"] for r in rs], "k--", label="floor")
        ax.set_yscale("log")
        ax.set_xlabel("change rate (%), injected")
        ax.set_ylabel("reload time (s)")
        ax.set_title(f"{big / 1e6:.0f}M BF16 elements, {mbit:g} Mbit/s (measured)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "reload_vs_change.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)

    r = reload.timeline_row(rows)
    spans = r["delta"]["spans"]
    stages = list(dict.fromkeys(s[0] for s in spans))
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(stages)))
    for i, st in enumerate(stages):
        ax.broken_barh([(a * 1e3, max((b - a) * 1e3, 0.2)) for s, _, a, b in spans if s == st], (i - 0.35, 0.7))
    ax.set_yticks(range(len(stages)), stages)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the sync")
    ax.set_title(f"delta reload timeline: {r['elements'] / 1e6:.0f}M elements, {r['change']:.0%}, "
                 f"{r['link_mbit']:g} Mbit/s via {r['via']} (measured)", fontsize=9)
    fig.tight_layout()
    tpath = os.path.join(out, "reload_timeline.png")
    fig.savefig(tpath, dpi=110)
    plt.close(fig)
    return [path, tpath]


def plot_fanout(res: dict, out: str, plt) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for how in dict.fromkeys(r["how"] for r in res["runs"]):
        rs = sorted((r for r in res["runs"] if r["how"] == how), key=lambda r: r["receivers"])
        ax.plot([r["receivers"] for r in rs], [r["to_last"] for r in rs], marker="o", label=f"from {how}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("receivers")
    reps = res.get("config", {}).get("reps", 1)  # (a JSON from before --reps: one run a row)
    ax.set_ylabel("time to the last receiver (s)" + (f", best of {reps}" if reps > 1 else ""))
    ax.set_title(f"{res['elements'] / 1e6:.0f}M elements, {res['change']:.0%}, {res['link_mbit']:g} Mbit/s (measured)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "fanout_vs_receivers.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reload_json")
    ap.add_argument("fanout_json")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "docs"))
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import fanout
    import matplotlib.pyplot as plt
    import reload
    with open(a.reload_json) as f:
        rl = json.load(f)
    with open(a.fanout_json) as f:
        fo = json.load(f)
    written = plot_reload(rl, a.out, plt) + [plot_fanout(fo, a.out, plt)]
    print(reload.table(rl))
    print()
    print(fanout.table(fo))
    print("\nwrote " + ", ".join(written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
