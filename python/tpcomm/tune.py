"""python -m tpcomm.tune: measure this machine and write the routing table
the Communicator loads (Communicator(table=path) or TPCOMM_TABLE=path): one
file per GPU model with a row per world size. Run it once per world size with
the same --out: each run replaces its own world size's rows and keeps the
others' (a new file starts from the shipped table of the GPU model).

It runs tpcomm.bench in graph mode for the backends the dispatcher routes to
(tpcomm's packet, line, two_shot and bulk kernels, NCCL), every size checked
bit for bit, and keeps, per op, dtype and size, the fastest correct backend;
consecutive sizes with the same winner become one band. It also times the
quantized all-reduce (each mode, checked against its error bound) and writes
the world size's "quantized_min_bytes": the smallest bfloat16 size from which
every mode beats the fastest exact backend at every larger size measured
(past every size: QUANTIZED_NEVER), which Config.quantize routes by. And it
times the fused all-reduce + add + RMSNorm and its FP8 epilogues on the fused
kernel and on the route past its cap, and writes the world size's
"fused_norm_max_bytes" (fused_norm_maximum), which routing.add_rms_norm
caps the fused kernel family by. `--from results.json` derives the table from
an earlier benchmark run instead of measuring (no GPU needed).

    torchrun --nproc-per-node=4 -m tpcomm.tune --out h200.json   # then 8, with the same --out
    python -m tpcomm.tune --from benchmarks/results/h200x2.json --out h200.json
"""
import argparse
import json
import os
import sys
import tempfile

from . import _constants as C
from . import routing, routing_table
from .bench.vocabulary import ALL_OPS, NORM_OPS

# Benchmark backend names -> the routing table's backend names.
ROUTABLE = {**{f"tpcomm_{kernel}": kernel for kernel in routing.KERNELS}, "nccl": "nccl"}
# On a tie (equal medians) the earlier one wins: tpcomm's kernels first.
PREFERENCE = routing.BACKENDS
# The quantized all-reduce's benchmark backends: timed, never a band's.
QUANTIZED = tuple(f"tpcomm_{kernel}" for kernel in routing.QUANTIZED)
QUANTIZED_NEVER = C.TPC_MAX_BYTES_LIMIT + 16  # larger than any op: quantized never won
# The fused norm ops' benchmark backends: the fused kernel, and the route the
# dispatcher takes past its cap (bench/norm_cases.py).
FUSED_NORM = ("tpcomm_fused", "tpcomm_past_cap")
FUSED_NORM_NEVER = 1  # smaller than any input the fused kernel takes (16-byte rows): it never won


def _graph_rows(rows, op, dtype):
    for r in rows:
        if (r.get("op") == op and r.get("dtype") == dtype and r.get("mode") == "graph" and r.get("correct")
                and isinstance(r.get("median_us"), (int, float))):
            yield r


def quantized_minimum(rows, dtype="bfloat16"):
    """The smallest all_reduce size (bytes per rank) from which every
    quantized mode measured is faster than the fastest exact routable
    backend, at that size and every larger one measured where all were
    measured; QUANTIZED_NEVER when the largest such size is no win; None
    when the quantized kernel was not measured."""
    exact, quantized = {}, {}
    for r in _graph_rows(rows, "all_reduce", dtype):
        size, backend = int(r["bytes_per_rank"]), r.get("backend")
        if backend in ROUTABLE:
            exact[size] = min(exact.get(size, float("inf")), r["median_us"])
        elif backend in QUANTIZED:
            quantized.setdefault(size, {})[backend] = r["median_us"]
    modes = {b for by in quantized.values() for b in by}
    sizes = sorted(s for s in exact if s in quantized and set(quantized[s]) == modes)
    if not sizes:
        return None
    minimum = QUANTIZED_NEVER
    for size in reversed(sizes):
        if max(quantized[size].values()) >= exact[size]:
            break
        minimum = size
    return minimum


def fused_norm_maximum(rows, dtype="bfloat16"):
    """The largest size (bytes per rank) measured with both up to which the
    fused norm kernel (tpcomm_fused) is at least as fast as the route past
    its cap (tpcomm_past_cap) at every size measured, over every norm op and
    hidden size (where it never lost, the largest measured: the cap goes no
    further than the measurements; a fused row that failed its check lost);
    FUSED_NORM_NEVER where it lost at the smallest size; None when the two
    were not measured side by side."""
    times = {}
    for r in rows:
        if (r.get("op") in NORM_OPS and r.get("dtype") == dtype and r.get("mode") == "graph"
                and r.get("backend") in FUSED_NORM and isinstance(r.get("median_us"), (int, float))):
            us = r["median_us"] if r.get("correct") else (float("inf") if r["backend"] == FUSED_NORM[0] else None)
            if us is not None:
                times.setdefault((r["op"], r.get("hidden"), int(r["bytes_per_rank"])), {})[r["backend"]] = us
    won = sorted((size, by[FUSED_NORM[0]] <= by[FUSED_NORM[1]]) for (_, _, size), by in times.items() if len(by) == 2)
    if not won:
        return None
    first_loss = min((size for size, ok in won if not ok), default=float("inf"))
    return max((size for size, _ in won if size < first_loss), default=FUSED_NORM_NEVER)


def winners(rows, op, dtype):
    """[(bytes per rank, fastest routable backend), ...] by size, from the
    correct graph-mode rows of one op and dtype."""
    by_size = {}
    for r in rows:
        backend = ROUTABLE.get(r.get("backend"))
        if (backend is None or r.get("op") != op or r.get("dtype") != dtype or r.get("mode") != "graph"
                or not r.get("correct") or not isinstance(r.get("median_us"), (int, float))):
            continue
        by_size.setdefault(int(r["bytes_per_rank"]), []).append((r["median_us"], PREFERENCE.index(backend), backend))
    return [(size, min(times)[2]) for size, times in sorted(by_size.items())]


def bands(won):
    """Bands [limit, backend] from the winners by size: each band ends at the
    last size its backend won; past the last band the Communicator uses NCCL,
    so a trailing NCCL band is dropped."""
    out = []
    for size, backend in won:
        if out and out[-1][1] == backend:
            out[-1][0] = size
        else:
            out.append([size, backend])
    while out and out[-1][1] == "nccl":
        out.pop()
    return out


def derive_table(results, base=None):
    """A routing table (routing_table's format) from benchmark results: a row for
    the measured world size, one per measured dtype (its "*" row is
    bfloat16's, the dtype of serving), and every other world size kept from
    `base` (default: the shipped table)."""
    base = routing_table.load_table(base)
    env = results.get("env", {})
    world = str(env.get("world_size", ""))
    if not world.isdigit():
        raise ValueError("the benchmark results name no world size (env.world_size)")
    rows = results.get("rows", [])
    routes = {}
    for op in routing.OPS:
        dtypes = sorted({r["dtype"] for r in rows if r.get("op") == op and r.get("dtype") in routing_table.DTYPES})
        by_dtype = {d: bands(winners(rows, op, d)) for d in dtypes}
        by_dtype = {d: b for d, b in by_dtype.items() if b}
        # the base table's rows, as JSON lists; the measured world size replaces its own
        routes[op] = {w: {d: [list(b) for b in bs] for d, bs in by_d.items()}
                      for w, by_d in base["routes"][op].items()}
        if not by_dtype:  # not measured (the benchmark has no such op yet)
            continue
        star = by_dtype.get("bfloat16") or next(iter(by_dtype.values()))
        routes[op][world] = {"*": star} if op == "all_gather" else {"*": star, **by_dtype}
    about = (f"python -m tpcomm.tune: {world}x {env.get('gpu', '?')}, driver {env.get('driver', '?')}, "
             f"torch {env.get('torch', '?')}, NCCL {env.get('nccl', '?')}, {env.get('date', '?')}: fastest correct "
             f"of {', '.join(PREFERENCE)} per op, dtype and size (CUDA graphs, median per op)")
    minimums = dict(base.get("quantized_min_bytes", {}))
    measured = quantized_minimum(rows)
    if measured is not None:
        minimums[world] = measured
    maxima = dict(base.get("fused_norm_max_bytes", {}))
    measured = fused_norm_maximum(rows)
    if measured is not None:
        maxima[world] = measured
    about += (f"; fused_norm_max_bytes measured at world size {', '.join(sorted(maxima))} (tpcomm_fused against "
              "tpcomm_past_cap), the cost-model default elsewhere" if maxima else
              "; no fused_norm_max_bytes measured: the fused norm kernel's cap is the cost-model default")
    table = {"about": about, "routes": routes}
    if minimums:
        table["quantized_min_bytes"] = minimums
    if maxima:
        table["fused_norm_max_bytes"] = maxima
    routing_table.load_table(table)  # what we write must load
    return table


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tpcomm tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", help="derive from this benchmark results JSON instead of measuring")
    p.add_argument("--out", help="the table to write or extend (default: tpcomm_table_<gpu model>.json here)")
    p.add_argument("--dtypes", default="bfloat16,float16,float32", help="dtypes to measure")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest size per rank to measure")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.source:
        with open(args.source) as f:
            results = json.load(f)
    else:
        from .bench.__main__ import main as bench_main

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "tune.json")
            bench_main(["--modes", "graph", "--backends", ",".join((*ROUTABLE, *QUANTIZED, *FUSED_NORM)),
                        "--ops", ",".join(ALL_OPS), "--dtypes", args.dtypes,
                        "--max-bytes", str(args.max_bytes), "--no-plots", "--out", path])
            if not os.path.exists(path):
                print("tpcomm.tune: nothing was measured (it needs 2 or more CUDA GPUs); no table written")
                return 1
            with open(path) as f:
                results = json.load(f)
    env = results.get("env", {})
    out = args.out or f"tpcomm_table_{routing_table.gpu_model(str(env.get('gpu', 'gpu')))}.json"
    extended = os.path.exists(out)
    table = derive_table(results, out if extended else routing_table.table_for_device(env.get("gpu")))
    with open(out, "w") as f:
        json.dump(table, f, indent=2)
        f.write("\n")
    for op in routing.OPS:
        for world, by_dtype in sorted(table["routes"][op].items()):
            for dtype, bs in sorted(by_dtype.items()):
                print(f"{op:11s} world {world:2s} {dtype:9s} " + ", ".join(f"{b} to {n} B" for n, b in bs))
    for world, minimum in sorted(table.get("quantized_min_bytes", {}).items()):
        print(f"quantized  world {world:2s} from {minimum} B" + (" (never won)" if minimum == QUANTIZED_NEVER else ""))
    for world, largest in sorted(table.get("fused_norm_max_bytes", {}).items()):
        never = " (never won)" if largest == FUSED_NORM_NEVER else ""
        print(f"fused norm world {world:2s} up to {largest} B{never}")
    print(f"{'extended' if extended else 'wrote'} {out} (world size {env.get('world_size')}): "
          f"use it with Communicator(table={out!r}) or TPCOMM_TABLE={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
