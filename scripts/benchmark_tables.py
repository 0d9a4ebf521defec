"""Writes the benchmark tables of README.md and docs/benchmarks.md, and
docs/testing.md's tables of transformers versions and families, from the committed
results in benchmarks/results/*.json, so the documents cannot drift from
the measurements.

    python scripts/benchmark_tables.py           # rewrite the generated blocks
    python scripts/benchmark_tables.py --check   # exit 1, naming the stale blocks, if any differs

A generated block sits between two marker comments in the Markdown file:

    <!-- generated: NAME -->
    ...                      (replaced by BLOCKS[NAME]())
    <!-- /generated: NAME -->

Everything outside the markers is written by hand. The numbers come only
from the JSON; formatting reuses tpcomm.bench's vocabulary (names, their
order, sizes) and tables (the best NCCL configuration, the dispatcher check),
which need neither torch nor a GPU.
"""
import argparse
import importlib
import json
import os
import re
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOCUMENTS = ("README.md", os.path.join("docs", "benchmarks.md"), os.path.join("docs", "testing.md"))
CONFIG = os.path.join(ROOT, "python", "tpcomm", "config.py")  # Config's defaults


def _load(name):
    """tpcomm/bench/<name>.py as a module of a stand-in package over that
    directory, so its relative imports resolve to its siblings: tpcomm's
    __init__ would import torch and the extension, which tables do not need."""
    package = "_tpcomm_bench"
    if package not in sys.modules:
        stand_in = types.ModuleType(package)
        stand_in.__path__ = [os.path.join(ROOT, "python", "tpcomm", "bench")]
        sys.modules[package] = stand_in
    return importlib.import_module(f"{package}.{name}")


vocabulary = _load("vocabulary")
bench_tables = _load("tables")
scaling = _load("scaling")
human_bytes = vocabulary.human_bytes
SMALL_MAX = 64 * 1024  # "decode sizes": the headline's summary covers 64 B up to this many bytes per rank
TWO_SHOT = "symm_two_shot"
WORLDS = (2, 4)        # the committed runs (benchmarks/results/h200x<N>.json)
HEADLINE_WORLD = 2     # the README's run: its kernels are today's (docs/benchmarks.md dates the 4-rank one)


def _read(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _run(world):
    return _read(f"h200x{world}.json")


def _cells(data, op, dtype, mode):
    """{bytes per rank: {backend: row}} of one (op, dtype, mode)."""
    out = {}
    for r in data["rows"]:
        if (r["op"], r["dtype"], r["mode"]) == (op, dtype, mode):
            out.setdefault(r["bytes_per_rank"], {})[r["backend"]] = r
    return out


def _us(row):
    return None if row is None or row.get("median_us") is None else row["median_us"]


def _fmt(x):
    return "–" if x is None else f"{x:.2f}"


def _span(values, fmt="{:.2f}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def _gpu_label(env):
    return f"{env['world_size']}×{env['gpu'].replace('NVIDIA ', '')}"


# ------------------------------------------------------------------ README
def default_max_bytes():
    """tpcomm.config.Config's default max_bytes, read from config.py's source
    (importing tpcomm would import torch and the extension)."""
    with open(CONFIG) as f:
        m = re.search(r"^\s+max_bytes: int = (\d+) \* MiB$", f.read(), re.MULTILINE)
    return int(m.group(1)) << 20


def headline():
    """The README's table: bf16 all-reduce under CUDA graphs on HEADLINE_WORLD
    ranks, tpcomm against NCCL's default, NCCL at its best and torch's
    two-shot; then one sentence summarising decode sizes. A tpcomm figure of
    a size above the default max_bytes was measured with the run's raised cap
    and is marked so (by default NCCL takes those sizes)."""
    data = _run(HEADLINE_WORLD)
    env, cells = data["env"], _cells(data, "all_reduce", "bfloat16", "graph")
    cap = default_max_bytes()
    head = ["bytes per rank", f"TP{HEADLINE_WORLD} tpcomm", "NCCL default", "NCCL best", "torch two-shot"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    raised = False
    for n in sorted(cells):
        c = cells[n]
        times = [_us(c.get("tpcomm")), _us(c.get("nccl")), bench_tables.best_nccl_us(c), _us(c.get(TWO_SHOT))]
        fastest = min(t for t in times if t is not None)
        row = [f"**{_fmt(t)}**" if t == fastest else _fmt(t) for t in times]
        if n > cap and times[0] is not None:
            row[0] += " †"
            raised = True
        lines.append("| " + " | ".join([human_bytes(n)] + row) + " |")
    lines += ["", "The fastest of each row in bold."]
    if raised:
        lines[-1] += (f" † with `max_bytes` raised to {human_bytes(env['tpcomm_max_bytes'])} "
                      f"(`TPCOMM_MAX_BYTES`); by default ({human_bytes(cap)}) larger all-reduces go to NCCL.")
    small = [c for n, c in cells.items() if n <= SMALL_MAX and "tpcomm" in c]
    tp = [_us(c["tpcomm"]) for c in small]
    vs_default = [_us(c["tpcomm"]) / _us(c["nccl"]) for c in small]
    vs_best = [_us(c["tpcomm"]) / bench_tables.best_nccl_us(c) for c in small]
    lines += ["", f"{_gpu_label(env)}, driver {env['driver']}, torch {env['torch']}, NCCL {env['nccl']}, "
                  f"{env['date']}. Up to {human_bytes(SMALL_MAX)} per rank: {_span(tp)} µs, "
                  f"{_span(vs_default)}× the time of NCCL's default and {_span(vs_best)}× that of NCCL at its best."]
    return "\n".join(lines)


def decode_headline():
    """One sentence on examples/tp_decode.py's step times."""
    data = _read("tp_decode_h200x2.json")
    env, model, summary = data["env"], data["model"], data["summary"]
    batches = sorted(summary, key=int)
    plain = [summary[b]["tpcomm_faster_than_pct"]["nccl"] for b in batches]
    fused = [summary[b]["tpcomm_fused_faster_than_pct"]["nccl"] for b in batches]
    return (f"In a decode step of a Llama-3-8B-shaped model ({model['layers']} layers, hidden {model['hidden']}, "
            f"TP={model['ranks']} on {_gpu_label(env)}, CUDA graphs, batch {', '.join(batches)}; "
            f"`examples/tp_decode.py`), tpcomm's all-reduce makes the step {_span(plain, '{:.1f}')} % shorter "
            f"than NCCL's default does, and the fused all-reduce + add + RMSNorm {_span(fused, '{:.1f}')} % shorter.")


# ------------------------------------------------------ docs/benchmarks.md
def environment(world):
    """The run's machine and method, its correctness count and the dispatcher check."""
    data = _run(world)
    env, bench = data["env"], data["env"].get("bench", {})
    rows = [("GPUs", f"{env['world_size']}× {env['gpu']}, driver {env['driver']}"),
            ("software", f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, Python {env['python']}"),
            ("date", env["date"]),
            ("multicast", env["multicast"]),
            ("peer copy", f"{env['peer_copy_gbps']} GB/s ({env['peer_copy']})"),
            ("time", f"{bench['time']}; graph mode: {bench['ops_per_graph']} ops per graph "
                     f"({bench['ops_per_graph_large']} from {human_bytes(bench['large_bytes'])}), "
                     f"{bench['replays']} replays, {bench['graph_order']}; eager: {bench['eager_reps']} calls"),
            ("check", bench["check"])]
    if "tpcomm_max_bytes" in env:
        rows.append(("tpcomm max_bytes", f"{human_bytes(env['tpcomm_max_bytes'])}, raised so that every size is "
                     f"timed on tpcomm's kernels; the default ({human_bytes(default_max_bytes())}) sends larger "
                     "calls to NCCL"))
    if "merged_run" in env:
        merged = env["merged_run"]
        rows.append(("second process set", f"{', '.join(merged['backends'])} with {merged['env']}"))
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    bad = [r for r in data["rows"] if r.get("correct") is False]
    lines += ["", f"Rows checked bit for bit against the reference: {len(data['rows']) - len(bad)} of "
                  f"{len(data['rows'])} match."]
    lines += ["", "Dispatcher (`tpcomm`) against the fastest backend measured at each op, dtype and size:", ""]
    lines += [f"- {line}" for line in bench_tables.format_dispatcher_check(data["rows"]).splitlines()]
    return "\n".join(lines)


def backends(world):
    """What each column is, as the run describes it."""
    described = _run(world)["env"]["backends"]
    return "\n".join(f"- `{b}`: {described[b]}" for b in vocabulary.BACKENDS if b in described)


def tables(world):
    """Every (op, dtype, mode) of the run: µs per op, the best NCCL
    configuration in bold, and tpcomm's time over it."""
    data = _run(world)
    out = []
    for mode in vocabulary.MODES:
        for op in vocabulary.OPS:
            for dtype in vocabulary.DTYPES:
                cells = _cells(data, op, dtype, mode)
                if cells:
                    out.append(_table(op, dtype, mode, cells))
    return "\n\n".join(out)


def _table(op, dtype, mode, cells):
    present = {b for c in cells.values() for b in c}
    cols = [b for b in vocabulary.BACKENDS if b in present]
    lines = [f"**{op}** {dtype}, {'CUDA graph' if mode == 'graph' else 'eager'}, µs per op", "",
             "| bytes per rank | " + " | ".join(cols) + " | tpcomm / best NCCL |",
             "|" + "---:|" * (len(cols) + 2)]
    for n in sorted(cells):
        c = cells[n]
        best = bench_tables.best_nccl_us(c)
        row = [human_bytes(n)]
        for b in cols:
            us = _us(c.get(b))
            text = _fmt(us)
            if us is not None and c[b].get("correct") is False:
                text += " (wrong)"
            if b in vocabulary.NCCL_BACKENDS and us is not None and us == best:
                text = f"**{text}**"
            row.append(text)
        tp = _us(c.get("tpcomm"))
        row.append(_fmt(tp / best) if tp and best else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def tp_decode():
    """examples/tp_decode.py's steps: ms per step by backend and batch."""
    data = _read("tp_decode_h200x2.json")
    env, model, summary = data["env"], data["model"], data["summary"]
    cols = ["none (mixing default)", "none_fused (mixing default)", "nccl", "nccl_nomix", "tpcomm", "tpcomm_fused"]
    cols = [c for c in cols if any(c in row["ms_per_step"] for row in summary.values())]  # the backends run
    lines = [f"{_gpu_label(env)}, {env['date']}: {model['layers']} layers, hidden {model['hidden']}, "
             f"vocabulary {model['vocab']}, context {model['context']}, {model['dtype']}, TP={model['ranks']}; "
             f"{data['method']}", "",
             "| batch | " + " | ".join(c.replace(" (mixing default)", " (floor)") for c in cols)
             + " | tpcomm faster than nccl / nccl_nomix | tpcomm_fused faster than nccl / nccl_nomix |",
             "|" + "---:|" * (len(cols) + 3)]
    for batch in sorted(summary, key=int):
        s = summary[batch]
        ms = s["ms_per_step"]
        faster = s["tpcomm_faster_than_pct"]
        fused = s["tpcomm_fused_faster_than_pct"]
        lines.append(f"| {batch} | " + " | ".join(f"{ms[c]:.2f}" for c in cols)
                     + f" | {faster['nccl']:.1f} % / {faster['nccl_nomix']:.1f} %"
                     + f" | {fused['nccl']:.1f} % / {fused['nccl_nomix']:.1f} % |")
    return "\n".join(lines)


def add_rms_norm_routes():
    """benchmarks/add_rms_norm_routes.py: each route of the fused op against
    NCCL's all-reduce followed by torch's add and norm."""
    data = _read("add_rms_norm_routes_h200x2.json")
    env = data["env"]
    lines = [f"{_gpu_label(env)}, {env['date']}: {env['method']}", "",
             "| tokens | hidden | route | tpcomm, its route | tpcomm unfused | NCCL bf16 + add + norm |",
             "|---:|---:|---|---:|---:|---:|"]
    for r in data["rows"]:
        us = r["us"]
        nccl = next(v for k, v in us.items() if k.startswith("nccl"))
        lines.append(f"| {r['tokens']} | {r['hidden']} | {r['route']} | {us['tpcomm ' + r['route']]:.2f} | "
                     f"{us['tpcomm unfused']:.2f} | {nccl:.2f} |")
    return "\n".join(lines)


NORM_FP8_MODES = ("per_tensor", "per_token", "per_token_group")
NORM_FP8_TARGET_PCT = 10.0  # the target: the epilogue adds at most this much to the fused kernel


def norm_fp8_probe():
    """benchmarks/norm_fp8_probe.cu and .py (`bash scripts/device_run.sh
    fp8_probe`), one table per result file norm_fp8_probe_<card>.json: the
    fused norm with each FP8 epilogue against the kernel without it, then
    torch's quantization kernel in the same graph; the quantization kernel
    alone beside, and how far the probe's own times of the kernels lie."""
    out = []
    for name in sorted(f for f in os.listdir(RESULTS) if re.fullmatch(r"norm_fp8_probe_\w+\.json", f)):
        data = _read(name)
        env = data["env"]
        lines = [f"{env['gpu'].replace('NVIDIA ', '')}, driver {env['driver']}, torch {env['torch']}, "
                 f"CUDA {env['cuda']}, {env['date']} ([`{name}`](../benchmarks/results/{name})): {env['method']}.",
                 "", "| tokens | hidden | epilogue | fused | fused + epilogue | epilogue adds | quant kernel alone | "
                     "fused, then quant kernel | the epilogue saves |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        adds, saves, differ, probe_off = [], [], [], []
        for r in data["rows"]:
            us = r["us"]
            probe_off.append(abs(r["probe_us"]["none"] / us["fused"] - 1))
            for mode in NORM_FP8_MODES:
                fused, epilogue = us["fused"], us[f"fused + {mode} epilogue"]
                two = us[f"fused, then {mode} kernel"]
                # rounded as printed (+ 0.0: a share that rounds to zero prints 0.0, not -0.0)
                adds.append(round(100 * (epilogue / fused - 1), 1) + 0.0)
                saves.append(round(100 * (1 - epilogue / two), 1) + 0.0)
                lines.append(f"| {r['tokens']} | {r['hidden']} | {mode} | {fused:.2f} | {epilogue:.2f} | "
                             f"{adds[-1]:.1f} % | {us[f'{mode} quant kernel']:.2f} | {two:.2f} | {saves[-1]:.1f} % |")
                probe_off.append(abs(r["probe_us"][mode] / epilogue - 1))
                if not r["quant_matches_eager"][mode]:
                    differ.append(f"{r['tokens']} x {r['hidden']} {mode}")
        met = sum(a <= NORM_FP8_TARGET_PCT for a in adds)
        lines += ["", f"µs per call. The epilogue adds {_span(adds, '{:.1f}')} % to the fused kernel (at most "
                      f"{NORM_FP8_TARGET_PCT:.0f} % in {met} of {len(adds)} rows) and the fused path takes "
                      f"{_span(saves, '{:.1f}')} % less time than the two kernels "
                      f"(less in {sum(s > 0 for s in saves)} of {len(saves)} rows). Inductor's codes and scales "
                      + (f"differ from eager torch's at {', '.join(differ)}." if differ else
                         "are eager torch's bit for bit at every shape.")
                  + f" The probe's own graphs time the same kernels within {100 * max(probe_off):.0f} % of these."]
        out.append("\n".join(lines))
    return "\n\n".join(out)


ASSUMED_HOP_US = 1.0  # two_shot's second crossing: not measured yet (benchmarks/scale_probe.cu will)


def scaling_model():
    """tpcomm.bench.scaling fitted to each committed run's all_reduce rows
    (bf16, CUDA graphs), and where two_shot would start to pay."""
    lines = ["| ranks | kernel | latency at 64 B, µs | GB/s sent per rank, at its largest size | "
             "worst model error, 64 KiB and up |", "|---:|---|---:|---:|---:|"]
    fitted = []
    for world in WORLDS:
        rows = _run(world)["rows"]
        for kernel in ("packet", "line", "bulk"):
            measured = scaling.times(rows, kernel)
            latency, gbps = scaling.fit(measured, kernel, world)
            fitted.append(gbps)
            error = scaling.worst_error(measured, kernel, world, 64 * 1024)
            lines.append(f"| {world} | {kernel} | {latency:.2f} | {gbps:.0f} (at {human_bytes(max(measured))}) | "
                         f"{100 * error:.0f} % |")
    gbps = sorted(fitted)[len(fitted) // 2]
    pays = ", ".join(f"{human_bytes(int(scaling.two_shot_pays_from(w, gbps, ASSUMED_HOP_US)))} at {w} ranks"
                     for w in (4, 8))
    lines += ["", f"With the median fitted rate ({gbps:.0f} GB/s) and a second hop of {ASSUMED_HOP_US:.0f} µs "
                  f"(assumed), two_shot sends enough less than line to pay for the hop from about {pays}."]
    return "\n".join(lines)


TRANSFORMERS_RUNS = "transformers_versions_cpu.json"  # .ci/transformers_versions.sh with TPCOMM_TEST_VERSIONS_JSON


def transformers_versions():
    """docs/testing.md: each transformers version x family of the CPU runs,
    its row-parallel all-reduces a forward and how many ran fused, compiled."""
    data = _read(TRANSFORMERS_RUNS)
    torch_versions = sorted({run["torch"] for run in data["runs"].values()})
    lines = [f"CPU, 2 gloo ranks, torch {', '.join(torch_versions)}, {data['date']} "
             f"(`benchmarks/results/{TRANSFORMERS_RUNS}`):", "",
             "| transformers | family | row-parallel all-reduces | fused, float32 | fused, bf16 | pattern "
             "| without the hooks helper | graph breaks |", "|---|---|---:|---:|---:|---|---:|---:|"]

    def fused(mode, key=None):
        """mode's fused calls: under `key`, or under any pattern's key (all_reduce_<pattern>)."""
        if not mode:
            return None
        ops = [k.split("/")[0] for k in mode["calls"]]
        return sum(n for op, n in zip(ops, mode["calls"].values())
                   if op == key or (key is None and op.startswith("all_reduce_")))

    for version in sorted(data["runs"], key=lambda v: tuple(int(p) for p in v.split("."))):
        for family, by_dtype in data["runs"][version]["families"].items():
            first = next(iter(by_dtype.values()))
            key = first["fused_key"]
            cells = [fused(by_dtype[d]["modes"]["compiled"], key) if d in by_dtype else None
                     for d in ("float32", "bfloat16")]
            unprepared = [fused(r["modes"].get("compiled_unprepared")) for r in by_dtype.values()]
            breaks = sorted({r["modes"]["compiled"]["graph_breaks"] for r in by_dtype.values()})
            lines.append(f"| {version} | {family} | {first['row_parallel_per_forward']} | "
                         + " | ".join("–" if c is None else str(c) for c in cells)
                         + f" | `{key}` | {'–' if unprepared[0] is None else ', '.join(map(str, unprepared))} "
                         f"| {', '.join(map(str, breaks))} |")
    return "\n".join(lines)


HF_FAMILIES = "hf_families_cpu.json"  # tests/hf_families.py's output at 2 ranks, float32 (docs/testing.md says how)


def hf_families():
    """docs/testing.md: each transformers family of the CPU run, its row-parallel
    all-reduces a forward, the pairs the compile pass merged, the fused calls
    and whether every mode's greedy tokens are plain torch's."""
    data = _read(HF_FAMILIES)
    lines = [f"CPU, 2 gloo ranks, float32, transformers {data['transformers']}, torch {data['torch']} "
             f"(`benchmarks/results/{HF_FAMILIES}`):", "",
             "| family | row-parallel all-reduces | merged pairs | fused calls, compiled | pattern "
             "| tokens as plain torch's |", "|---|---:|---:|---:|---|---|"]
    for family, by_dtype in data["families"].items():
        r = by_dtype["float32"]
        compiled = r["modes"]["compiled"]
        fused = sum(n for k, n in compiled["calls"].items() if k.split("/")[0] == r["fused_key"])
        agree = ", ".join(f"{mode} {'yes' if m['tokens_agree'] else 'NO'}" for mode, m in r["modes"].items())
        lines.append(f"| {family} | {r['row_parallel_per_forward']} | {compiled['pass'].get('all_reduce_merged', 0)} "
                     f"| {fused} | `{r['fused_key']}` | {agree} |")
    return "\n".join(lines)


BLOCKS = {"headline": headline, "scaling-model": scaling_model, "decode-headline": decode_headline,
          "tp-decode": tp_decode, "add-rms-norm-routes": add_rms_norm_routes,
          "transformers-versions": transformers_versions, "norm-fp8-probe": norm_fp8_probe,
          "hf-families": hf_families}
for _w in WORLDS:
    BLOCKS[f"environment-h200x{_w}"] = lambda w=_w: environment(w)
    BLOCKS[f"backends-h200x{_w}"] = lambda w=_w: backends(w)
    BLOCKS[f"tables-h200x{_w}"] = lambda w=_w: tables(w)

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated: (?P=name) -->)",
                    re.DOTALL)


def regenerate(text):
    """`text` with every generated block rewritten; raises KeyError for a block no renderer knows."""
    return _BLOCK.sub(lambda m: m.group(1) + BLOCKS[m.group("name")]() + "\n" + m.group(4), text)


def block_names(text):
    return [m.group("name") for m in _BLOCK.finditer(text)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated block is stale")
    args = parser.parse_args(argv)
    stale = []
    for rel in DOCUMENTS:
        path = os.path.join(ROOT, rel)
        with open(path) as f:
            text = f.read()
        fresh = regenerate(text)
        if fresh == text:
            continue
        stale.append(rel)
        if not args.check:
            with open(path, "w") as f:
                f.write(fresh)
    if args.check and stale:
        print(f"stale generated blocks in {', '.join(stale)}: run python scripts/benchmark_tables.py",
              file=sys.stderr)
        return 1
    for rel in stale:
        print(f"rewrote the generated blocks of {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
