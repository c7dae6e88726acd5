"""The grid of ``benchmarks/auto_drafting.py --json`` runs as one table and one plot.

    python benchmarks/plot_auto_grid.py q4.json f32.json --plot grid.svg --markdown grid.md

Per cell (weights, batch, temperature) of every file given: target-only's speed is 1.0, the
best fixed setting is the fastest contender that is neither target-only nor auto (a fixed K,
with or without the lookup, or a fixed tree), and auto is ``auto (cap N)``, the default policy.
The table gives auto's speedup over target-only with its range over rounds, the best fixed
setting's, and their ratio; a cell meets the aim when auto is at least target-only's speed
within its range over rounds and at least 0.95 of the best fixed setting. The plot draws each
weights' panel against the batch, one line per temperature, for auto (with its range over
rounds as error bars), the best fixed setting and every fixed K.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

AIM_OF_BEST = 0.95


def is_auto(name: str) -> bool:
    return name.startswith("auto (cap ") and name.endswith(")")


def is_fixed(name: str) -> bool:
    """A setting chosen by hand: a fixed K (with the lookup or not) or a fixed tree."""
    return name.startswith("fixed K=") or name.startswith("tree ")


def summarise(cell: dict) -> dict:
    """One cell of ``auto_drafting.py --json``: auto, the best fixed setting, their ratio and
    whether the cell meets the aim (auto at least 1.0x target-only within its range over rounds,
    and at least 0.95 of the best fixed setting)."""
    rows = cell["contenders"]
    auto = next((name for name in rows if is_auto(name)), None)
    fixed = [name for name in rows if is_fixed(name)]
    if auto is None or not fixed:
        raise ValueError(f"cell {cell['weights']} batch {cell['batch']} T={cell['temperature']:g} has no "
                         f"'auto (cap N)' row or no fixed setting: {sorted(rows)}")
    best = max(fixed, key=lambda name: rows[name]["speedup"])
    a, b = rows[auto], rows[best]
    # Target-only is the better choice where no fixed setting beats it: then it is the best fixed one.
    best_speedup = max(b["speedup"], 1.0)
    return dict(weights=cell["weights"], batch=cell["batch"], temperature=cell["temperature"],
                prompts=cell["prompts"], busy=cell.get("busy", False), auto=auto, auto_speedup=a["speedup"],
                auto_rounds=(min(a["rounds"]), max(a["rounds"])), drafts_per_cycle=a.get("drafts_per_cycle"),
                best=best, best_speedup=b["speedup"], of_best=a["speedup"] / best_speedup,
                meets=max(a["rounds"]) >= 1.0 and a["speedup"] / best_speedup >= AIM_OF_BEST)


def markdown(summaries: list[dict]) -> str:
    head = ("| weights | batch | T | best fixed setting | auto [rounds] | auto's drafts a cycle "
            "| auto / best of target-only and fixed | aim met |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for s in summaries:
        lo, hi = s["auto_rounds"]
        drafts = "" if s["drafts_per_cycle"] is None else f"{s['drafts_per_cycle']:.2f}"
        best = f"{s['best']} {s['best_speedup']:.2f}x"
        if s["best_speedup"] < 1.0:
            best = f"target-only ({best})"
        met = "yes" if s["meets"] else "**no**"
        if not s["meets"] and s["drafts_per_cycle"] == 0:
            met += " (target-only's own program)"
        lines.append(f"| {s['weights']} | {s['batch']} | {s['temperature']:g} | {best} | "
                     f"{s['auto_speedup']:.2f}x [{lo:.2f}-{hi:.2f}] | {drafts} | {s['of_best']:.2f} | {met} |")
    return "\n".join(lines)


def plot(cells: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: a small, diffable SVG

    weights = sorted({c["weights"] for c in cells}, key=lambda w: (w != "float32", w))
    fig, axes = plt.subplots(1, len(weights), figsize=(5.2 * len(weights), 4.0), squeeze=False, sharey=True)
    colors = {0.0: "tab:blue", 1.0: "tab:red"}
    for ax, w in zip(axes[0], weights):
        for t in sorted({c["temperature"] for c in cells if c["weights"] == w}):
            mine = sorted((c for c in cells if c["weights"] == w and c["temperature"] == t), key=lambda c: c["batch"])
            batches = [c["batch"] for c in mine]
            color = colors.get(t, "tab:green")
            for name in sorted({n for c in mine for n in c["contenders"] if n.startswith("fixed K=")}):
                ys = [c["contenders"].get(name, {}).get("speedup", float("nan")) for c in mine]
                ax.plot(batches, ys, color=color, alpha=0.18, lw=1)
            sums = [summarise(c) for c in mine]
            ax.plot(batches, [s["best_speedup"] for s in sums], color=color, ls="--", marker="s", ms=4,
                    label=f"best fixed setting, T={t:g}")
            y = [s["auto_speedup"] for s in sums]
            err = [[s["auto_speedup"] - s["auto_rounds"][0] for s in sums],
                   [s["auto_rounds"][1] - s["auto_speedup"] for s in sums]]
            ax.errorbar(batches, y, yerr=err, color=color, marker="o", lw=2, capsize=3, label=f"auto, T={t:g}")
        ax.axhline(1.0, color="black", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c["batch"] for c in cells if c["weights"] == w}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("batch (sequences decoded together)")
        ax.set_title(f"{w} target")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over target-only decoding")
    axes[0][-1].legend(fontsize=8, loc="upper right")
    fig.suptitle("drafting.auto() against every fixed K (faint lines)\nand the best of them, on the real pair",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None} if path.endswith(".svg") else None)


def read_cells(path: str) -> list[dict]:
    """The cells of one ``auto_drafting.py --json`` file; a clear error for any other file."""
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e}); pass the files auto_drafting.py --json wrote") from e
    if not isinstance(run, dict) or not isinstance(run.get("cells"), list):
        raise ValueError(f"{path} holds no 'cells' list: it is not a file benchmarks/auto_drafting.py --json wrote")
    return run["cells"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="JSON files written by benchmarks/auto_drafting.py --json")
    ap.add_argument("--plot", help="write the plot here (.svg or .png)")
    ap.add_argument("--markdown", help="also write the table here")
    args = ap.parse_args(argv)
    cells = [cell for run in args.runs for cell in read_cells(run)]
    summaries = [summarise(c) for c in cells]
    table = markdown(summaries)
    met = sum(s["meets"] for s in summaries)
    text = f"{table}\n\nThe aim is met in {met} of {len(summaries)} cells."
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot:
        plot(cells, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
