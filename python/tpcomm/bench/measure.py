"""The measurement loop of tpcomm.bench (one process per GPU).

For each op, dtype, size and backend: a case is set up (backends.make_case),
checked bit for bit against a reference computed from NCCL's all-gather of
every rank's integer-valued input (exact in every dtype), then timed in each
mode after a warm-up and a barrier. The time kept is the slowest rank's
median. A backend that cannot run a case, fails its check or fails to run is
listed under "not_run" with the reason (or recorded with "correct": false),
and the run goes on. Rank 0 writes the results file after every op/dtype
block (so that a run cut short keeps what it measured) and at the end.
"""
import datetime
import math
import os
import platform
import statistics
import subprocess
import time
import zlib

import torch
import torch.distributed as dist

from .. import _ranks, topology
from . import report
from .cases import Resources, Unavailable, agree, describe, make_case
from .progress import Progress
from .report import BACKENDS, OPS, human_bytes  # noqa: F401 - re-exported

PEER_COPY_BYTES = 256 << 20


# ------------------------------------------------------------------- timing
def _barrier():
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def rotated(items, r):
    """items in round r's order: starting r places further on, so that over
    len(items) rounds each goes first once."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def capture_graph(call, ops_per_graph):
    """A CUDA graph of `ops_per_graph` back-to-back calls (warmed up eagerly
    on a side stream first, as torch's graph capture asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops_per_graph):
            call()
    return graph


def time_graphs(calls, ops_per_graph, replays, settle=0):
    """[(median us per op, None) or (nan, error text)] for each call, each
    captured in a graph of `ops_per_graph` ops, after 3 untimed replays of
    each. With one call: `replays` timed replays in a row. With several
    (the benchmark's default; --sequential times one call at a time):
    rounds, each replaying every graph in an order rotated by one, so the
    backends compared at one size are timed over the same seconds; `settle`
    untimed replays of a graph come before its timed one,
    since a graph replayed right after another backend's ran up to 1.6x
    slower (seen on 2xH200: a graph that always followed an NCCL graph)."""
    out = [None] * len(calls)
    graphs = {}
    for i, call in enumerate(calls):
        try:
            graphs[i] = capture_graph(call, ops_per_graph)
        except Exception as e:  # noqa: BLE001 - that backend's row becomes a reason
            out[i] = (float("nan"), describe(e))
    live = list(graphs)
    times = {i: [] for i in live}
    try:
        for _ in range(3):
            for i in live:
                graphs[i].replay()
        _barrier()
        for r in range(replays):
            for i in rotated(live, r):
                for _ in range(settle):
                    graphs[i].replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[i].replay()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) * 1000.0 / ops_per_graph)
    except Exception as e:  # noqa: BLE001 - a replay failed: no row of this size is trusted
        for i in live:
            out[i] = (float("nan"), f"replays failed: {describe(e)}")
        return out
    finally:
        graphs.clear()
    for i in live:
        out[i] = (statistics.median(times[i]), None)
    return out


def time_eager(call, ops, reps):
    """Median us per op over `reps` runs of `ops` back-to-back calls."""
    for _ in range(3):
        call()
    _barrier()
    device = torch.device("cuda", torch.cuda.current_device())
    return statistics.median(_ranks.seconds_per_call(call, ops, device) * 1e6 for _ in range(reps))


def make_input(rank, op, dtype, numel, device):
    """Integer values in [-4, 4] of torch dtype `dtype`, different on every
    rank: sums are exact."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(f"{op}/{dtype}/{numel}".encode()) * 8 + rank)
    return torch.randint(-4, 5, (numel,), generator=g, device=device, dtype=torch.int32).to(dtype)


def reference(op, x0, world):
    """NCCL's all-gather of the inputs (a bit copy); for all_reduce, their sum
    in float64 rounded to the dtype (exact on these integers); for
    reduce_scatter, this rank's part of that sum."""
    gathered = torch.empty((world * x0.numel(),), dtype=x0.dtype, device=x0.device)
    dist.all_gather_into_tensor(gathered, x0)
    if op == "all_gather":
        return gathered
    total = gathered.view(world, -1).double().sum(0).to(x0.dtype)
    if op == "reduce_scatter":
        return total.view(world, -1)[dist.get_rank()].clone()
    return total


def bit_equal(y, ref):
    if not isinstance(y, torch.Tensor) or y.numel() != ref.numel() or y.dtype != ref.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
    return torch.equal(y.contiguous().view(-1).view(as_int), ref.contiguous().view(-1).view(as_int))


# -------------------------------------------------------------- environment
def environment(world):
    env = {"date": datetime.date.today().isoformat(), "world_size": world, "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": platform.node(), "python": platform.python_version()}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - report, do not fail
        env["nccl"] = f"unknown ({e})"
    try:
        if torch.cuda.is_available() and torch.cuda.device_count():
            env["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        env["gpu_error"] = str(e)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
    except Exception as e:  # noqa: BLE001
        env["driver"] = f"unknown ({e})"
    env["multicast"] = "off (" + ", ".join(f"{k}={os.environ.get(k)}" for k in topology.MULTICAST_OFF) + ")"
    return env


def format_env(env):
    lines = []
    for k, v in env.items():
        if isinstance(v, dict):
            lines.append(f"{k:>16}:")
            lines.extend(f"{'':>18}{kk}: {vv}" for kk, vv in v.items())
        else:
            lines.append(f"{k:>16}: {v}")
    return "\n".join(lines)


def environment_text(world):
    return format_env(environment(world))


def default_out_path(env):
    return report.default_out_path(env)


def measure_peer_copy(nbytes=PEER_COPY_BYTES, reps=5):
    """Rank 0: GB/s of Tensor.copy_ from cuda:0 into cuda:1 (median of reps)."""
    try:
        if torch.cuda.device_count() < 2:
            return {"peer_copy_gbps": None, "peer_copy": "not measured: rank 0 sees one GPU"}
        if not torch.cuda.can_device_access_peer(0, 1):
            return {"peer_copy_gbps": None, "peer_copy": "not measured: cuda:0 cannot access cuda:1 as a peer"}
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        times = []
        with torch.cuda.device(0):
            for _ in range(2):
                dst.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            torch.cuda.synchronize(1)
        ms = statistics.median(times)
        del src, dst
        torch.cuda.empty_cache()
        return {"peer_copy_gbps": round(nbytes / (ms * 1e-3) / 1e9, 1),
                "peer_copy": f"rank 0, Tensor.copy_ of {human_bytes(nbytes)} cuda:0 -> cuda:1, "
                             f"median of {reps} after 2 warm-ups ({ms:.3f} ms)"}
    except Exception as e:  # noqa: BLE001
        return {"peer_copy_gbps": None, "peer_copy": f"failed: {describe(e)}"}


def probe_kernels(cases, world):
    """Names of the GPU kernels each case launches (torch.profiler), to tell
    NCCL's symmetric kernels (ncclSymk...) from its ring/tree ones. Collective;
    returns {key: [names] or "error: ..."} (rank 0's view)."""
    out = {}
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:  # noqa: BLE001
        return {"error": describe(e)}
    for key, case in cases:
        prof, err = None, None
        try:
            case.prepare()
            case.call()
            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as e:  # noqa: BLE001
            err = describe(e)
        err = agree(err, world)
        if err:
            out[key] = f"error: {err}"
            continue
        try:
            for _ in range(2):
                case.call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            err = describe(e)
        try:
            prof.__exit__(None, None, None)
            names = sorted({e.name for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA})
            names = [n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()]
            out[key] = [n[:120] for n in names[:8]] or "no GPU kernel recorded"
        except Exception as e:  # noqa: BLE001
            out[key] = f"error: {describe(e)}"
        err = agree(err, world)
        if err:
            out[key] = f"error: {err}"
    return out


# ------------------------------------------------------------------- worker
def plan(args):
    """(ops, dtypes, modes, backends, sizes) of a run, from the parsed arguments."""
    ops = report.parse_choices(args.ops, OPS, "op")
    dtypes = report.parse_dtypes(args.dtypes)
    modes = report.parse_choices(args.modes, report.MODES, "mode")
    backends = report.parse_choices(args.backends or ",".join(BACKENDS), BACKENDS, "backend")
    step = 8 if args.quick else args.sizes_step
    return ops, dtypes, modes, backends, report.size_list(args.min_bytes, args.max_bytes, step)


def worker(rank, world, init_method, args, queue=None, destroy=True):
    """One rank. Returns the results path (rank 0) or None. With destroy
    False the process group is left for the process's exit to end."""
    topology.force_multicast_off()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if init_method is None:
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                device_id=device, timeout=timeout)
    if not destroy:
        return _run(rank, world, device, args, queue)
    try:
        return _run(rank, world, device, args, queue)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def spawned_worker(rank, world, init_method, args, queue=None):
    """worker() in a process spawned by python -m tpcomm.bench: once the
    results are written and everything is closed, the process leaves with
    os._exit(0), skipping interpreter teardown (destructors of CUDA, NCCL and
    symmetric-memory state at exit, or an NCCL teardown waiting for a peer
    that already left, are not worth a crash or a hang after the work is
    done). An exception still propagates, with its traceback, to the parent."""
    worker(rank, world, init_method, args, queue, destroy=False)
    try:
        dist.barrier()  # every rank is done before any leaves
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(rank, world, device, args, queue):
    t0 = time.monotonic()
    ops, dtypes, modes, backends, size_list = plan(args)
    # Only rank 0 reports (and only rank 0 touches GPU 0's properties).
    env = environment(world) if rank == 0 else {"world_size": world}
    path = args.out or report.default_out_path(env)
    if rank == 0 and queue is not None:
        queue.put(path)
    quiet = getattr(args, "quiet", False)  # a run whose rows another run merges
    say = print if rank == 0 and not quiet else (lambda *a, **k: None)
    say(f"tpcomm.bench: {world} x {env.get('gpu', '?')}; ops {','.join(ops)}; dtypes {','.join(dtypes)}; "
        f"modes {','.join(modes)}; {len(size_list)} sizes {human_bytes(size_list[0])}..{human_bytes(size_list[-1])}; "
        f"backends {','.join(backends)}; results -> {path}", flush=True)

    if rank == 0:
        env.update(measure_peer_copy())
        say(f"peer copy: {env.get('peer_copy_gbps')} GB/s ({env.get('peer_copy')})", flush=True)
    _barrier()
    res = Resources(rank, world, device, size_list[-1], backends, log=say)
    env.update(res.info)
    for b, why in res.reasons.items():
        say(f"{b}: off: {why}", flush=True)
    env["backends"] = {b: report.BACKEND_HELP[b] for b in backends}
    env["bench"] = {"sizes_step": 8 if args.quick else args.sizes_step, "ops_per_graph": args.ops_per_graph,
                    "ops_per_graph_large": args.ops_per_graph_large, "large_bytes": args.large_bytes,
                    "replays": _replays(args), "eager_reps": _eager_reps(args), "timeout_s": args.timeout_s,
                    "graph_order": "interleaved rounds, one settling replay" if args.interleave else "sequential",
                    "time": "slowest rank's median us per op", "check": "bit-exact vs float64 sum / NCCL all-gather "
                    "of integer-valued inputs"}

    rows, not_run = [], []
    if rank == 0 and getattr(args, "merge_from", None):
        merged = report.read_json(args.merge_from)
        rows += [r for r in merged.get("rows", [])]
        not_run += list(merged.get("not_run", []))
        env["merged_run"] = {"backends": sorted({r["backend"] for r in merged.get("rows", [])}),
                             "env": "NCCL_GRAPH_MIXING_SUPPORT=0", "complete": merged.get("env", {}).get("complete"),
                             "elapsed_s": merged.get("env", {}).get("elapsed_s")}
        env["backends"].update(merged.get("env", {}).get("backends", {}))
    progress = Progress(len(ops) * len(dtypes) * len(size_list) * len(backends) * len(modes),
                        enabled=rank == 0 and not args.no_progress)

    def skip(op, backend, dtype, nbytes, why, mode=None):
        e = {"op": op, "backend": backend, "dtype": dtype, "bytes_per_rank": nbytes, "why": why}
        if mode:
            e["mode"] = mode
        not_run.append(e)

    for op in ops:
        for dname in dtypes:
            dtype = getattr(torch, dname)
            for req in size_list:
                numel = max(1, req // dtype.itemsize)
                if op == "reduce_scatter":  # world equal parts
                    numel = max(world, numel // world * world)
                nbytes = numel * dtype.itemsize
                x0 = make_input(rank, op, dtype, numel, device)
                ref = reference(op, x0, world)
                n_ops = args.ops_per_graph if nbytes <= args.large_bytes else args.ops_per_graph_large
                ready = []  # (backend, case, bit-exact on every rank): first run done
                for backend in backends:
                    label = f"{op} {dname} {human_bytes(nbytes)} {backend}"
                    why, case = None, None
                    try:
                        case = make_case(backend, op, x0, res)
                    except Exception as e:  # noqa: BLE001 - Unavailable or a failure: a reason either way
                        why = describe(e)
                    why = agree(why, world)
                    if why:
                        skip(op, backend, dname, nbytes, why)
                        progress.advance(len(modes), label)
                        continue
                    ok = None
                    try:
                        case.prepare()
                        y = case.call()
                        ok = case.check(y) if case.check else bit_equal(y, ref)
                        torch.cuda.synchronize()
                        _check_tpcomm(backend, res)
                    except Exception as e:  # noqa: BLE001
                        why = f"failed its first run: {describe(e)}"
                    why = agree(why, world)
                    if why:
                        skip(op, backend, dname, nbytes, why)
                        _maybe_break_tpcomm(backend, res, why)
                        progress.advance(len(modes), label)
                        continue
                    oks = [None] * world
                    dist.all_gather_object(oks, bool(ok))
                    ready.append((backend, case, all(oks)))
                for mode in modes:
                    if mode == "graph" and args.interleave:  # every backend of this size in the same rounds
                        for _, case, _ in ready:
                            case.prepare()
                        timed = time_graphs([case.call for _, case, _ in ready], n_ops, _replays(args), settle=1)
                    elif mode == "graph":  # one backend after the other, each in its own stretch
                        timed = []
                        for _, case, _ in ready:
                            case.prepare()
                            timed += time_graphs([case.call], n_ops, _replays(args))
                    else:
                        timed = []
                        for _, case, _ in ready:
                            try:
                                case.prepare()
                                timed.append((time_eager(case.call, n_ops, _eager_reps(args)), None))
                            except Exception as e:  # noqa: BLE001
                                timed.append((float("nan"), describe(e)))
                    for (backend, case, ok), (t, err) in zip(ready, timed):
                        if err is None:
                            try:
                                _check_tpcomm(backend, res)
                            except Exception as e:  # noqa: BLE001
                                t, err = float("nan"), describe(e)
                        got = [None] * world
                        dist.all_gather_object(got, (t, err))
                        errs = [f"rank {r}: {e}" for r, (_, e) in enumerate(got) if e]
                        if errs:
                            why = errs[0] if len({e for _, e in got if e}) == 1 else "; ".join(errs)
                            skip(op, backend, dname, nbytes, f"failed to run: {why}", mode)
                            _maybe_break_tpcomm(backend, res, why)
                        else:
                            worst = max(x for x, _ in got)
                            rows.append({"op": op, "backend": backend, "dtype": dname, "bytes_per_rank": nbytes,
                                         "mode": mode, "median_us": round(worst, 3), "correct": ok,
                                         **({"route": case.route} if case.route else {})})
                        progress.advance(1, f"{op} {dname} {human_bytes(nbytes)} {backend} {mode}")
                del ready
            if rank == 0:
                _write(path, env, rows, not_run, world, complete=False, t0=t0, log=progress.write)
    progress.close()

    if not args.no_kernel_probe:
        env["nccl_kernels"] = _probe(ops, dtypes, backends, size_list, res, rank, world, device)
    data = _write(path, env, rows, not_run, world, complete=True, t0=t0, log=say) if rank == 0 else None
    if rank == 0 and not quiet:
        print("\n" + format_env(data["env"]))
        print(report.format_tables(data))
        if not_run:
            print("\nnot run:")
            print(report.format_not_run(not_run))
        print("\n" + report.format_summary(data))
        print(f"wrote {path}", flush=True)
    res.close()
    return path if rank == 0 else None


def _replays(args):
    return 5 if args.quick else max(1, args.replays)


def _eager_reps(args):
    return 3 if args.quick else max(1, args.eager_reps)


def _check_tpcomm(backend, res):
    if backend.startswith("tpcomm") and res.comm is not None:
        res.comm.check()  # raises TpcommError after a device-side failure


def _maybe_break_tpcomm(backend, res, why):
    """A tpcomm device error poisons the communicator: later tpcomm cases are off."""
    if backend.startswith("tpcomm") and ("TpcommError" in why or "device error" in why):
        res.tpcomm_broken(f"off after an earlier device error: {why}")


def _write(path, env, rows, not_run, world, complete, t0, log=print):
    env = dict(env)
    env["complete"] = complete
    env["elapsed_s"] = round(time.monotonic() - t0, 1)
    rows = report.add_bandwidth([dict(r) for r in rows], world, env.get("peer_copy_gbps"))
    data = {"env": env, "rows": rows, "not_run": list(not_run)}
    try:
        report.write_json(path, data)
    except Exception as e:  # noqa: BLE001
        log(f"could not write {path}: {describe(e)}")
    return data


def _probe(ops, dtypes, backends, size_list, res, rank, world, device):
    """Kernel names of nccl and nccl_window at a small and a large size."""
    dname = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    dtype = getattr(torch, dname)
    small = min(size_list, key=lambda s: abs(math.log2(s) - 16))            # near 64 KiB
    large = max([s for s in size_list if s <= (16 << 20)] or size_list[:1])  # up to 16 MiB
    cases = []
    for op in ops:
        for backend in ("nccl", "nccl_window"):
            if backend not in backends or backend in res.reasons:
                continue
            for req in sorted({small, large}):
                numel = max(1, req // dtype.itemsize)
                x0 = make_input(rank, op, dtype, numel, device)
                try:
                    case = make_case(backend, op, x0, res)
                except Unavailable:
                    case = None
                if agree(None if case else "unavailable", world) is None:
                    cases.append((f"{op} {backend} {dname} {human_bytes(numel * dtype.itemsize)}", case))
    try:
        return probe_kernels(cases, world)
    except Exception as e:  # noqa: BLE001
        return {"error": describe(e)}
