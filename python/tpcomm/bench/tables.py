"""The terminal tables and summary of a results file: median times per
backend, the bandwidth under them, the not-run list, the speed-ups over
NCCL, and the dispatcher against the fastest backend measured.
No torch: scripts/benchmark_tables.py loads this without the package."""
from .rows import backends_in, finite_positive, labelled, preferred_dtype
from .vocabulary import DTYPE_SHORT, DTYPES, MODES, NCCL_BACKENDS, OPS, human_bytes, ordered


def format_tables(data):
    """One table per (op, dtype, mode): median us per op, every backend a
    column, x = the best NCCL configuration measured / tpcomm; under it, for
    sizes >= 1 MiB, the bandwidth."""
    rows = labelled(data.get("rows", []))
    env = data.get("env", {})
    out = []
    keys = {(r["op"], r["dtype"], r["mode"]) for r in rows}
    for op in ordered({k[0] for k in keys}, OPS):
        for dtype in ordered({k[1] for k in keys if k[0] == op}, DTYPES):
            for mode in ordered({k[2] for k in keys if k[:2] == (op, dtype)}, MODES):
                sel = [r for r in rows if (r["op"], r["dtype"], r["mode"]) == (op, dtype, mode)]
                out.append(_table(op, dtype, mode, sel, env))
    return "\n".join(out)


def _table(op, dtype, mode, rows, env):
    backends = backends_in(rows)
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
        if best and tp and finite_positive(tp.get("median_us")):
            line += f" {best / tp['median_us']:>6.2f}"
        lines.append(line)
    big = [n for n in sorted(by_size) if any("algbw_gbps" in r for r in by_size[n].values())]
    if big:
        peer = env.get("peer_copy_gbps")
        what = (f"algbw GB/s / fraction of the {peer:.0f} GB/s peer copy" if finite_positive(peer)
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
             if b in cells and finite_positive(cells[b].get("median_us"))]
    return min(times) if times else None


def _cell(r, w):
    if r is None or not finite_positive(r.get("median_us")):
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
        dtypes = ",".join(DTYPE_SHORT.get(d, d) for d in ordered(g["dtypes"], DTYPES))
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
    for op in ordered({r["op"] for r in rows}, OPS):
        for mode in ordered({r["mode"] for r in rows if r["op"] == op}, MODES):
            dtype = preferred_dtype([r for r in rows if r["op"] == op])
            parts = []
            for b in backends_in([r for r in rows if r["op"] == op]):
                if b == "nccl":
                    continue
                sp = [(n, idx[(op, "nccl", dtype, mode, n)]["median_us"] / r["median_us"])
                      for (o, bb, d, m, n), r in sorted(idx.items(), key=lambda kv: kv[0][4])
                      if (o, bb, d, m) == (op, b, dtype, mode) and (op, "nccl", dtype, mode, n) in idx
                      and finite_positive(r["median_us"])
                      and finite_positive(idx[(op, "nccl", dtype, mode, n)]["median_us"])]
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
                    if "tpcomm" in c and b and finite_positive(c["tpcomm"]["median_us"])]
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
        if r.get("mode") == mode and r.get("correct") is not False and finite_positive(r.get("median_us")):
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
    for op in ordered({c[0] for c in checked}, OPS):
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
