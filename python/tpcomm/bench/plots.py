"""PNG figures of a tpcomm.bench results file (matplotlib, Agg backend).

    python -m tpcomm.bench.plots benchmarks/results/h200x2.json [--stem STEM] [--dtype bfloat16]

writes, next to the JSON (same stem):
  <stem>_<op>_<mode>.png for every op and mode measured: median latency per
      op against bytes per rank, log-log, one line per backend (one dtype,
      bfloat16 by default, named in the title);
  <stem>_speedup.png: t_best_nccl / t_backend against size (log x), where
      t_best_nccl is the fastest NCCL configuration measured at that size
      (nccl, nccl_window, and their graph-mixing-off runs), for the dispatcher
      (tpcomm) and the symm_mem backends, one panel per op and mode; above 1
      means faster than NCCL at its best.
"""
import argparse
import math
import os
import sys

from . import options, results_file, tables
from .rows import backends_in, labelled, preferred_dtype
from .vocabulary import MODES, NCCL_BACKENDS, OPS, human_bytes, ordered

SPEEDUP_BACKENDS = ("tpcomm", "symm_one_shot", "symm_two_shot")
STYLE = {
    "nccl": dict(color="black", marker="o"),
    "nccl_nomix": dict(color="tab:green", marker="o", linestyle="-."),
    "nccl_window": dict(color="tab:gray", marker="s", linestyle="--"),
    "nccl_window_nomix": dict(color="tab:olive", marker="s", linestyle="-."),
    "symm_one_shot": dict(color="tab:purple", marker="^"),
    "symm_two_shot": dict(color="tab:pink", marker="v"),
    "symm_two_shot_copied": dict(color="tab:pink", marker="v", linestyle=":"),
    "tpcomm": dict(color="tab:red", marker="D", linewidth=2.2),
    "tpcomm_packet": dict(color="tab:orange", marker="x", linestyle=":"),
    "tpcomm_line": dict(color="tab:brown", marker="*", linestyle=":"),
    "tpcomm_two_shot": dict(color="tab:olive", marker="1", linestyle=":"),
    "tpcomm_bulk": dict(color="tab:blue", marker="+", linestyle=":"),
    "tpcomm_quantized_fp8": dict(color="tab:cyan", marker="<", linestyle="--"),
    "tpcomm_quantized_int8": dict(color="tab:cyan", marker=">", linestyle="-."),
    "tpcomm_quantized_int4": dict(color="tab:cyan", marker="P", linestyle=":"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ok(t):
    return isinstance(t, (int, float)) and math.isfinite(t) and t > 0


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    if sizes:
        ticks = sorted(set(sizes))
        if len(ticks) > 12:
            ticks = ticks[::2]
        ax.set_xticks(ticks)
        ax.set_xticklabels([human_bytes(s).replace(" ", "") for s in ticks], rotation=45, fontsize=8)
        ax.minorticks_off()
    ax.set_xlabel("bytes per rank")


def _ratio_ticks(ax):
    """Plain ticks (0.5x, 1x, 2x, ...) on a log ratio axis that includes 1."""
    lo, hi = ax.get_ylim()
    lo, hi = min(lo, 0.9), max(hi, 1.1)
    ax.set_ylim(lo, hi)
    ticks = [t for t in (0.125, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if lo <= t <= hi]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}x" for t in ticks])
    ax.minorticks_off()


def _where(env):
    gpu = env.get("gpu", "GPU")
    n = env.get("world_size", "?")
    return f"{n} x {gpu}"


def render(data, stem, dtype=None):
    """Writes the figures for results `data` (the JSON dict) under `stem`;
    returns the paths written. Raises ImportError without matplotlib."""
    plt = _pyplot()
    rows = [r for r in labelled(data.get("rows", [])) if _ok(r.get("median_us"))]
    env = data.get("env", {})
    dtype = dtype or preferred_dtype(rows)
    rows = [r for r in rows if r["dtype"] == dtype]
    d = os.path.dirname(stem)
    if d:
        os.makedirs(d, exist_ok=True)
    written = []
    ops = ordered({r["op"] for r in rows}, OPS)
    modes = ordered({r["mode"] for r in rows}, MODES)
    for mode in modes:
        for op in ops:
            sel = [r for r in rows if r["op"] == op and r["mode"] == mode]
            if not sel:
                continue
            fig, ax = plt.subplots(figsize=(8, 5.2))
            for b in backends_in(sel):
                pts = sorted((r["bytes_per_rank"], r["median_us"]) for r in sel if r["backend"] == b)
                bad = any(r.get("correct") is False for r in sel if r["backend"] == b)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=b + (" (INCORRECT)" if bad else ""),
                        markersize=4, **STYLE.get(b, {}))
            _size_axis(ax, [r["bytes_per_rank"] for r in sel])
            ax.set_yscale("log")
            ax.set_ylabel("median time per op (us)")
            ax.set_title(f"{op}, {mode} mode, {dtype}: latency ({_where(env)})")
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = f"{stem}_{op}_{mode}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    panels = [(op, mode) for op in ops for mode in modes
              if any(r["backend"] in NCCL_BACKENDS and r["op"] == op and r["mode"] == mode for r in rows)
              and any(r["backend"] in SPEEDUP_BACKENDS and r["op"] == op and r["mode"] == mode for r in rows)]
    if panels:
        cols = len(modes)
        nrows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.3 * nrows), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (op, mode) in zip(axes.flat, panels):
            sel = [r for r in rows if r["op"] == op and r["mode"] == mode]
            by_size = {}
            for r in sel:
                by_size.setdefault(r["bytes_per_rank"], {})[r["backend"]] = r
            best = {n: tables.best_nccl_us(c) for n, c in by_size.items()}
            nccl = {n: t for n, t in best.items() if t}
            for b in SPEEDUP_BACKENDS:
                pts = sorted((r["bytes_per_rank"], nccl[r["bytes_per_rank"]] / r["median_us"])
                             for r in sel if r["backend"] == b and r["bytes_per_rank"] in nccl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"best nccl / {b}", markersize=4,
                            **STYLE.get(b, {}))
            ax.axhline(1.0, color="black", linewidth=0.8)
            _size_axis(ax, sorted(nccl))
            ax.set_yscale("log", base=2)
            _ratio_ticks(ax)
            ax.set_ylabel("speed-up: t_best_nccl / t_backend")
            ax.set_title(f"{op}, {mode} mode, {dtype}", fontsize=10)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"speed-up over the fastest NCCL configuration measured at each size ({_where(env)})")
        fig.tight_layout()
        path = f"{stem}_speedup.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def stem_for(json_path):
    return json_path[:-5] if json_path.endswith(".json") else json_path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tpcomm.bench.plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="results file written by python -m tpcomm.bench")
    p.add_argument("--stem", default=None, help="output path stem (default: the JSON path without .json)")
    p.add_argument("--dtype", default=None, help="dtype of the figures (default bfloat16, else the first present)")
    args = p.parse_args(argv)
    data = results_file.read_json(args.json)
    dtype = options.parse_dtypes(args.dtype)[0] if args.dtype else None
    try:
        paths = render(data, args.stem or stem_for(args.json), dtype)
    except ImportError as e:
        print(f"plots need matplotlib: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
