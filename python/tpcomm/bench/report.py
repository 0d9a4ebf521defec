"""The pure-Python half of tpcomm.bench: size lists, bandwidth figures, the
terminal tables and the results file. Nothing here needs torch or a GPU, so
results can be re-read and re-printed anywhere.

Bandwidth (rows of at least BANDWIDTH_MIN_BYTES per rank), with n ranks, b
bytes per rank and t the median time per op; GB/s means 1e9 bytes per second:

* algbw_gbps: the op's data over its time. all_reduce and reduce_scatter
  (b is its input): b / t. all_gather: n * b / t (the gathered output).
* link bytes: what each rank must at least send to its peers. all_reduce:
  2 * (n - 1) / n * b (reduce-scatter then all-gather); all_gather: (n - 1) * b;
  reduce_scatter: (n - 1) / n * b.
* peer_fraction: (link bytes / t) divided by the peer-copy bandwidth measured
  once at start (env["peer_copy_gbps"]: rank 0 copies 256 MiB from GPU 0 into
  GPU 1, median of 5). 1.0 means the op moves data across the link as fast
  as a plain one-way copy engine transfer.
"""
import json
import math
import os

KiB = 1024
MiB = 1024 * KiB

OPS = ("all_reduce", "all_gather", "reduce_scatter")  # reduce_scatter's size: its input per rank
# The fused all-reduce + add + RMSNorm (pattern ADD_NORM) and its FP8
# epilogues (bench/norm_cases.py): inputs (tokens, hidden), rows with "hidden".
NORM_OPS = ("all_reduce_add_rms_norm", "all_reduce_add_rms_norm_fp8_per_tensor",
            "all_reduce_add_rms_norm_fp8_per_token", "all_reduce_add_rms_norm_fp8_per_token_group")
ALL_OPS = OPS + NORM_OPS
# Column order of the tables and plots.
BACKENDS = ("nccl", "nccl_nomix", "nccl_window", "nccl_window_nomix", "symm_one_shot", "symm_two_shot",
            "symm_two_shot_copied", "tpcomm", "tpcomm_packet", "tpcomm_line", "tpcomm_two_shot",
            "tpcomm_bulk", "tpcomm_quantized_fp8", "tpcomm_quantized_int8", "tpcomm_quantized_int4",
            "tpcomm_fused", "tpcomm_past_cap")
# NCCL reads NCCL_GRAPH_MIXING_SUPPORT once per process, at its first
# communicator: these run in a second set of processes with it set to 0 (NCCL
# at its fastest under CUDA graphs), graph mode only.
NOMIX_BACKENDS = ("nccl_nomix", "nccl_window_nomix")
NCCL_BACKENDS = ("nccl", "nccl_nomix", "nccl_window", "nccl_window_nomix")
BACKEND_HELP = {
    "nccl": "NCCL through torch.distributed on ordinary tensors",
    "nccl_nomix": "as nccl, in processes with NCCL_GRAPH_MIXING_SUPPORT=0 (graph mode only)",
    "nccl_window": "NCCL on tensors in a MemPool registered as a symmetric window (register_mem_pool(pool, symm=True))",
    "nccl_window_nomix": "as nccl_window, in processes with NCCL_GRAPH_MIXING_SUPPORT=0 (graph mode only)",
    "symm_one_shot": "torch.ops.symm_mem.one_shot_all_reduce on a SymmetricMemory buffer (all_reduce only)",
    "symm_two_shot": "torch.ops.symm_mem.two_shot_all_reduce_ on a SymmetricMemory buffer (all_reduce only)",
    "symm_two_shot_copied": "as symm_two_shot, with the input copied in and the result copied out, as a "
                            "dispatcher serving ordinary tensors (vLLM's SymmMemCommunicator) runs it",
    "tpcomm": "tpcomm.Communicator (the dispatcher's choice of kernel)",
    "tpcomm_packet": "tpcomm's packet kernel, forced",
    "tpcomm_line": "tpcomm's line kernel (128-byte lines of data and flag), forced",
    "tpcomm_two_shot": "tpcomm's two-phase all-reduce in lines (each rank sums one chunk), forced",
    "tpcomm_bulk": "tpcomm's bulk kernel, forced",
    "tpcomm_quantized_fp8": "tpcomm's quantized all-reduce, e4m3 codes, forced (not exact: within its error bound)",
    "tpcomm_quantized_int8": "tpcomm's quantized all-reduce, int8 codes, forced (not exact: within its error bound)",
    "tpcomm_quantized_int4": "tpcomm's quantized all-reduce, int4 codes, forced (not exact: within its error bound)",
    "tpcomm_fused": "tpcomm's fused all-reduce + add + RMSNorm kernel (with its FP8 epilogue), forced (norm ops only)",
    "tpcomm_past_cap": "the route tpcomm's dispatcher takes past the fused norm kernel's cap: split or unfused "
                       "(norm ops only)",
}
MODES = ("graph", "eager")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16",
                 "float16": "float16", "fp32": "float32", "float": "float32", "float32": "float32"}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
BANDWIDTH_MIN_BYTES = 1 * MiB


# -------------------------------------------------------------------- sizes
def size_list(lo, hi, step=4):
    """lo, lo*step, lo*step**2, ... up to hi; hi itself is appended when the
    steps miss it. 64 B .. 64 MiB with step 4: 64, 256, 1 KiB, ..., 64 MiB."""
    lo, hi, step = int(lo), int(hi), int(step)
    if lo <= 0 or hi < lo:
        raise ValueError(f"sizes need 0 < min ({lo}) <= max ({hi})")
    if step < 2:
        raise ValueError(f"size step must be at least 2, got {step}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= step
    if out[-1] != hi:
        out.append(hi)
    return out


NORM_HIDDEN = "4096,8192"  # the norm ops' default hidden sizes (--hidden)


def parse_hidden(text):
    """'4096,8192' -> [4096, 8192]; raises ValueError unless positive integers."""
    try:
        out = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise ValueError(f"hidden sizes must be positive integers, comma-separated; got {text!r}")
    return list(dict.fromkeys(out))


def shapes(op, itemsize, sizes, world, hiddens):
    """The input shapes of `op` for the requested sizes per rank, each once:
    (numel,) for the collectives (reduce_scatter: `world` equal parts);
    (tokens, hidden) for the norm ops, tokens = size // row, at least 1."""
    out = []
    for req in sizes:
        if op in NORM_OPS:
            out += [(max(1, req // (h * itemsize)), h) for h in hiddens]
            continue
        numel = max(1, req // itemsize)
        out.append((max(world, numel // world * world),) if op == "reduce_scatter" else (numel,))
    return list(dict.fromkeys(out))


def labelled(rows):
    """Rows (or not-run entries) for the tables: a norm op's hidden size
    joined to its op ("all_reduce_add_rms_norm_h4096"), so that sizes of two
    hidden sizes stay apart."""
    return [{**{k: v for k, v in r.items() if k != "hidden"}, "op": f"{r['op']}_h{r['hidden']}"} if "hidden" in r
            else r for r in rows]


def human_bytes(n):
    """64 -> '64 B', 1024 -> '1 KiB', 3 * 2**20 -> '3 MiB', 1536 -> '1.5 KiB'."""
    n = int(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def parse_dtypes(text):
    """'bf16,fp32' -> ['bfloat16', 'float32']; raises ValueError on unknown names."""
    out = []
    for name in (t.strip().lower() for t in text.split(",")):
        if not name:
            continue
        if name not in DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(sorted(DTYPE_ALIASES))})")
        if DTYPE_ALIASES[name] not in out:
            out.append(DTYPE_ALIASES[name])
    if not out:
        raise ValueError("no dtype given")
    return out


def parse_choices(text, allowed, what):
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {', '.join(bad)} (choose from {', '.join(allowed)})")
    if not out:
        raise ValueError(f"no {what} given")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- bandwidth
def algbw_gbps(op, nbytes, world, median_us):
    """Data of the op over its time, GB/s (see the module docstring)."""
    data = nbytes * world if op == "all_gather" else nbytes
    return data / (median_us * 1e-6) / 1e9


def link_bytes(op, nbytes, world):
    """Bytes each rank must send to its peers at least."""
    if op == "all_gather":
        return (world - 1) * nbytes
    if op == "reduce_scatter":
        return (world - 1) / world * nbytes
    return 2.0 * (world - 1) / world * nbytes


def peer_fraction(op, nbytes, world, median_us, peer_gbps):
    """(link bytes / time) over the measured peer-copy bandwidth."""
    if not peer_gbps or peer_gbps <= 0:
        return None
    return link_bytes(op, nbytes, world) / (median_us * 1e-6) / (peer_gbps * 1e9)


def add_bandwidth(rows, world, peer_gbps):
    """Adds algbw_gbps (and peer_fraction where the peer copy was measured) to
    every row of at least BANDWIDTH_MIN_BYTES per rank with a valid time."""
    for r in rows:
        t = r.get("median_us")
        if r["bytes_per_rank"] < BANDWIDTH_MIN_BYTES or not _finite_positive(t):
            continue
        r["algbw_gbps"] = round(algbw_gbps(r["op"], r["bytes_per_rank"], world, t), 2)
        pf = peer_fraction(r["op"], r["bytes_per_rank"], world, t, peer_gbps)
        if pf is not None:
            r["peer_fraction"] = round(pf, 3)
    return rows


def _finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ------------------------------------------------------------------- tables
def _backends_in(rows):
    present = {r["backend"] for r in rows}
    return [b for b in BACKENDS if b in present] + sorted(present - set(BACKENDS))


def _ordered(values, order):
    values = set(values)
    return [v for v in order if v in values] + sorted(values - set(order))


def format_tables(data):
    """One table per (op, dtype, mode): median us per op, every backend a
    column, x = the best NCCL configuration measured / tpcomm; under it, for
    sizes >= 1 MiB, the bandwidth."""
    rows = labelled(data.get("rows", []))
    env = data.get("env", {})
    out = []
    keys = {(r["op"], r["dtype"], r["mode"]) for r in rows}
    for op in _ordered({k[0] for k in keys}, OPS):
        for dtype in _ordered({k[1] for k in keys if k[0] == op}, DTYPES):
            for mode in _ordered({k[2] for k in keys if k[:2] == (op, dtype)}, MODES):
                sel = [r for r in rows if (r["op"], r["dtype"], r["mode"]) == (op, dtype, mode)]
                out.append(_table(op, dtype, mode, sel, env))
    return "\n".join(out)


def _table(op, dtype, mode, rows, env):
    backends = _backends_in(rows)
    w = max(11, max(len(b) for b in backends) + 1)
    by_size = {}
    for r in rows:
        by_size.setdefault(r["bytes_per_rank"], {})[r["backend"]] = r
    lines = [f"\n{op} {dtype} {mode}: median us per op (slowest rank); x = best nccl* / tpcomm; "
             f"! = differs from the reference"]
    lines.append(f"{'bytes/rank':>10} " + " ".join(f"{b:>{w}}" for b in backends) + f" {'x':>6}")
    for n in sorted(by_size):
        cells = by_size[n]
        line = f"{human_bytes(n):>10} " + " ".join(_cell(cells.get(b), w) for b in backends)
        best, tp = best_nccl_us(cells), cells.get("tpcomm")
        if best and tp and _finite_positive(tp.get("median_us")):
            line += f" {best / tp['median_us']:>6.2f}"
        lines.append(line)
    big = [n for n in sorted(by_size) if any("algbw_gbps" in r for r in by_size[n].values())]
    if big:
        peer = env.get("peer_copy_gbps")
        what = (f"algbw GB/s / fraction of the {peer:.0f} GB/s peer copy" if _finite_positive(peer)
                else "algbw GB/s (peer copy not measured)")
        lines.append(f"{'':>10} {what}:")
        for n in big:
            cells = by_size[n]
            lines.append(f"{human_bytes(n):>10} " + " ".join(_bw_cell(cells.get(b), w) for b in backends))
    return "\n".join(lines)


def best_nccl_us(cells):
    """The fastest NCCL configuration's time among one size's rows
    ({backend: row}), or None."""
    times = [cells[b]["median_us"] for b in NCCL_BACKENDS
             if b in cells and _finite_positive(cells[b].get("median_us"))]
    return min(times) if times else None


def _cell(r, w):
    if r is None or not _finite_positive(r.get("median_us")):
        return f"{'-':>{w}}"
    mark = "" if r.get("correct", True) else "!"
    return f"{r['median_us']:>{w - 1}.2f}{mark:1}"


def _bw_cell(r, w):
    if r is None or "algbw_gbps" not in r:
        return f"{'-':>{w}}"
    text = f"{r['algbw_gbps']:.0f}"
    if r.get("peer_fraction") is not None:
        text += f"/{r['peer_fraction']:.2f}"
    return f"{text:>{w}}"


def format_not_run(not_run):
    """The "not run" list, one line per (op, backend, reason), sizes and
    dtypes folded together."""
    groups = {}
    for e in labelled(not_run):
        key = (e.get("op"), e.get("backend"), e.get("mode"), e.get("why"))
        g = groups.setdefault(key, {"dtypes": set(), "sizes": set()})
        if e.get("dtype"):
            g["dtypes"].add(e["dtype"])
        if e.get("bytes_per_rank") is not None:
            g["sizes"].add(e["bytes_per_rank"])
    lines = []
    for (op, backend, mode, why), g in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        sizes = sorted(g["sizes"])
        where = ""
        if sizes:
            where = human_bytes(sizes[0]) if len(sizes) == 1 else \
                f"{human_bytes(sizes[0])}..{human_bytes(sizes[-1])} ({len(sizes)} sizes)"
        dtypes = ",".join(DTYPE_SHORT.get(d, d) for d in _ordered(g["dtypes"], DTYPES))
        mode_txt = f" {mode}" if mode else ""
        lines.append(f"  not run: {op} {backend}{mode_txt} [{dtypes}] {where}: {why}")
    return "\n".join(lines)


def format_summary(data):
    """A few lines for the end of the log: correctness, and the speed-up of
    each backend over NCCL at the smallest and largest size measured."""
    rows = labelled(data.get("rows", []))
    bad = [r for r in rows if r.get("correct") is False]
    lines = []
    if bad:
        lines.append(f"INCORRECT results ({len(bad)} rows): " + "; ".join(
            f"{r['op']} {r['backend']} {r['dtype']} {human_bytes(r['bytes_per_rank'])} {r['mode']}" for r in bad[:10]))
    else:
        lines.append(f"all {len(rows)} measured rows match the reference bit for bit")
    idx = {(r["op"], r["backend"], r["dtype"], r["mode"], r["bytes_per_rank"]): r for r in rows}
    for op in _ordered({r["op"] for r in rows}, OPS):
        for mode in _ordered({r["mode"] for r in rows if r["op"] == op}, MODES):
            dtype = preferred_dtype([r for r in rows if r["op"] == op])
            parts = []
            for b in _backends_in([r for r in rows if r["op"] == op]):
                if b == "nccl":
                    continue
                sp = [(n, idx[(op, "nccl", dtype, mode, n)]["median_us"] / r["median_us"])
                      for (o, bb, d, m, n), r in sorted(idx.items(), key=lambda kv: kv[0][4])
                      if (o, bb, d, m) == (op, b, dtype, mode) and (op, "nccl", dtype, mode, n) in idx
                      and _finite_positive(r["median_us"])
                      and _finite_positive(idx[(op, "nccl", dtype, mode, n)]["median_us"])]
                if sp:
                    parts.append(f"{b} {sp[0][1]:.2f}x@{human_bytes(sp[0][0])}"
                                 + (f" {sp[-1][1]:.2f}x@{human_bytes(sp[-1][0])}" if len(sp) > 1 else ""))
            if parts:
                lines.append(f"speed-up over nccl, {op} {dtype} {mode}: " + ", ".join(parts))
            by_size = {}
            for r in rows:
                if (r["op"], r["dtype"], r["mode"]) == (op, dtype, mode):
                    by_size.setdefault(r["bytes_per_rank"], {})[r["backend"]] = r
            best = [(n, b / c["tpcomm"]["median_us"])
                    for n, c, b in ((n, c, best_nccl_us(c)) for n, c in sorted(by_size.items()))
                    if "tpcomm" in c and b and _finite_positive(c["tpcomm"]["median_us"])]
            if best:
                lines.append(f"tpcomm over the best NCCL measured, {op} {dtype} {mode}: "
                             + ", ".join(f"{x:.2f}x@{human_bytes(n)}" for n, x in best))
    check = format_dispatcher_check(rows)
    if check:
        lines.append(check)
    return "\n".join(lines)


DISPATCHER_SLACK = 1.05  # the dispatcher's row may be 5 % slower than the fastest backend


def dispatcher_vs_fastest(rows, mode="graph"):
    """Per (op, dtype, size) measured in `mode`, ordered: (op, dtype, bytes,
    the dispatcher's median or None where it has no row, the backend it
    routed to, the fastest other backend, its median, dispatcher / fastest).
    Only correct rows count."""
    cells = {}
    for r in labelled(rows):
        if r.get("mode") == mode and r.get("correct") is not False and _finite_positive(r.get("median_us")):
            cells.setdefault((r["op"], r["dtype"], r["bytes_per_rank"]), {})[r["backend"]] = r
    out = []
    order = {op: i for i, op in enumerate(OPS)}
    for key in sorted(cells, key=lambda k: (order.get(k[0], len(order)), k[1], k[2])):
        # the exact backends only: the quantized kernel is no alternative to an exact route
        others = {b: r["median_us"] for b, r in cells[key].items()
                  if b != "tpcomm" and not b.startswith("tpcomm_quantized")}
        if not others:
            continue
        fastest = min(others, key=others.get)
        mine = cells[key].get("tpcomm")
        us = mine["median_us"] if mine else None
        out.append((*key, us, mine.get("route") if mine else None, fastest, others[fastest],
                    us / others[fastest] if mine else None))
    return out


def format_dispatcher_check(rows, mode="graph"):
    """Per op: how many (dtype, size) rows of the dispatcher are within
    DISPATCHER_SLACK of the fastest backend measured, and the others."""
    lines = []
    checked = dispatcher_vs_fastest(rows, mode)
    for op in _ordered({c[0] for c in checked}, OPS):
        mine = [c for c in checked if c[0] == op]
        ok = [c for c in mine if c[7] is not None and c[7] <= DISPATCHER_SLACK]
        line = (f"dispatcher within {100 * (DISPATCHER_SLACK - 1):.0f} % of the fastest backend, {op} {mode}: "
                f"{len(ok)} of {len(mine)} dtype x size rows")
        over = [c for c in mine if c[7] is not None and c[7] > DISPATCHER_SLACK]
        # routed to the very kernel that measured fastest (its tpcomm_<route> row):
        # the two rows time one kernel twice, so their gap is run-to-run noise
        same = [c for c in over if c[4] and c[5] == f"tpcomm_{c[4]}"]
        slow = [c for c in over if c not in same]
        if same:
            line += (f"; {len(same)} more routed to the fastest backend's own kernel (one kernel timed twice: "
                     + ", ".join(f"{DTYPE_SHORT.get(d, d)} {human_bytes(n)} {x:.2f}x" for _, d, n, _, _, _, _, x in same)
                     + ")")
        if slow:
            line += "; slower: " + ", ".join(
                f"{DTYPE_SHORT.get(d, d)} {human_bytes(n)} {us:.2f} us{f' ({route})' if route else ''} vs {b} {best:.2f} "
                f"({x:.2f}x)"
                for _, d, n, us, route, b, best, x in slow)
        missing = [c for c in mine if c[3] is None]
        if missing:
            line += "; no dispatcher row: " + ", ".join(f"{DTYPE_SHORT.get(c[1], c[1])} {human_bytes(c[2])}"
                                                        for c in missing)
        lines.append(line)
    return "\n".join(lines)


def preferred_dtype(rows):
    """bfloat16 when present, else the first dtype present (for plots/summaries)."""
    present = {r["dtype"] for r in rows}
    for d in DTYPES:
        if d in present:
            return d
    return sorted(present)[0] if present else "bfloat16"


# ---------------------------------------------------------------- the file
RESULTS_DIR = "results"  # the tools' default output directory, under the working directory (ignored by git)


def default_out_path(env):
    gpu = env.get("gpu", "gpu").lower().replace("nvidia", "").strip().replace(" ", "-") or "gpu"
    return os.path.join(RESULTS_DIR, f"{gpu}x{env['world_size']}.json")


def write_json(path, data):
    """Writes atomically (a partial write never replaces a good file)."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(data), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
