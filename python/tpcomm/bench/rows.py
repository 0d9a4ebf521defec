"""The measured rows of a results file as tables, plots and the bandwidth
read them: which values are valid, the label a norm op's row goes by, the
backends present in column order, and the dtype a summary or plot shows.
No torch: scripts/benchmark_tables.py loads this without the package."""
import math

from .vocabulary import BACKENDS, DTYPES


def finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def labelled(rows):
    """Rows (or not-run entries) for the tables: a norm op's hidden size
    joined to its op ("all_reduce_add_rms_norm_h4096"), so that sizes of two
    hidden sizes stay apart."""
    return [{**{k: v for k, v in r.items() if k != "hidden"}, "op": f"{r['op']}_h{r['hidden']}"} if "hidden" in r
            else r for r in rows]


def backends_in(rows):
    present = {r["backend"] for r in rows}
    return [b for b in BACKENDS if b in present] + sorted(present - set(BACKENDS))


def preferred_dtype(rows):
    """bfloat16 when present, else the first dtype present (for plots/summaries)."""
    present = {r["dtype"] for r in rows}
    for d in DTYPES:
        if d in present:
            return d
    return sorted(present)[0] if present else "bfloat16"
