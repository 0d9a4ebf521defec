"""The measurement loop of tpcomm.bench (one process per GPU).

For each op, dtype, size and backend: a case is set up (backends.make_case),
checked bit for bit against a reference computed from NCCL's all-gather of
every rank's integer-valued input (exact in every dtype), then timed in each
mode after a warm-up and a barrier. The time kept is the slowest rank's
median. A backend that cannot run a case, fails its check or fails to run is
listed under "not_run" with the reason (or recorded with "correct": false),
and the run goes on. Rank 0 writes the results file after every op/dtype
block (so that a run cut short keeps what it measured) and at the end.

The parts it runs: timing.py (graph and eager timing), inputs.py (the
inputs, their reference and the bit-for-bit check), environment.py and
peer_copy.py (what the results file records about the machine),
kernel_probe.py (NCCL's kernel names).
"""
import datetime
import os
import time

import torch
import torch.distributed as dist

from .. import topology
from ..config import env_flag
from . import bandwidth, options, results_file, tables
from .cases import Resources, agree, describe, make_case
from .environment import environment, format_env
from .inputs import bit_equal, make_input, reference
from .kernel_probe import probe_nccl_kernels
from .peer_copy import measure_peer_copy
from .progress import Progress
from .timing import barrier, time_eager, time_graphs
from .vocabulary import ALL_OPS, BACKEND_HELP, BACKENDS, MODES, NORM_HIDDEN, OPS, human_bytes


def plan(args):
    """(ops, dtypes, modes, backends, sizes) of a run, from the parsed arguments."""
    ops = options.parse_choices(args.ops, ALL_OPS, "op")
    dtypes = options.parse_dtypes(args.dtypes)
    modes = options.parse_choices(args.modes, MODES, "mode")
    backends = options.parse_choices(args.backends or ",".join(BACKENDS), BACKENDS, "backend")
    step = 8 if args.quick else args.sizes_step
    return ops, dtypes, modes, backends, options.size_list(args.min_bytes, args.max_bytes, step)


def placement(rank, world):
    """(device, process-group backend) of a rank: GPU `rank` over NCCL; with
    TPCOMM_SHARE_GPU=1 and more ranks than GPUs, GPU rank % count over gloo
    (NCCL refuses two ranks on one GPU), the custom path kept on there
    (tpcomm._testing): a check of the cases' results on one GPU, whose times
    mean nothing (the ranks' kernels time-slice)."""
    count = torch.cuda.device_count()
    if world <= count or not env_flag("TPCOMM_SHARE_GPU"):
        return torch.device("cuda", rank), "nccl"
    from .. import _testing

    _testing.allow_shared_gpu(True)
    return torch.device("cuda", rank % count), "gloo"


def worker(rank, world, init_method, args, queue=None, destroy=True):
    """One rank. Returns the results path (rank 0) or None. With destroy
    False the process group is left for the process's exit to end."""
    topology.force_multicast_off()
    device, backend = placement(rank, world)
    torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    extra = {"device_id": device} if backend == "nccl" else {}
    if init_method is None:
        dist.init_process_group(backend, timeout=timeout, **extra)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout,
                                **extra)
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
    path = args.out or results_file.default_out_path(env)
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
    barrier()
    res = Resources(rank, world, device, size_list[-1], backends, log=say)
    env.update(res.info)
    for b, why in res.reasons.items():
        say(f"{b}: off: {why}", flush=True)
    env["backends"] = {b: BACKEND_HELP[b] for b in backends}
    if device.type == "cuda" and dist.get_backend() == "gloo":  # placement()'s shared GPUs
        env["shared_gpu"] = "ranks share GPUs (TPCOMM_SHARE_GPU=1): the results are checked, the times mean nothing"
        say(f"note: {env['shared_gpu']}", flush=True)
    env["bench"] = {"sizes_step": 8 if args.quick else args.sizes_step, "ops_per_graph": args.ops_per_graph,
                    "ops_per_graph_large": args.ops_per_graph_large, "large_bytes": args.large_bytes,
                    "replays": _replays(args), "eager_reps": _eager_reps(args), "timeout_s": args.timeout_s,
                    "graph_order": "interleaved rounds, one settling replay" if args.interleave else "sequential",
                    "time": "slowest rank's median us per op", "check": "bit-exact vs float64 sum / NCCL all-gather "
                    "of integer-valued inputs"}

    rows, not_run = [], []
    if rank == 0 and getattr(args, "merge_from", None):
        merged = results_file.read_json(args.merge_from)
        rows += [r for r in merged.get("rows", [])]
        not_run += list(merged.get("not_run", []))
        env["merged_run"] = {"backends": sorted({r["backend"] for r in merged.get("rows", [])}),
                             "env": "NCCL_GRAPH_MIXING_SUPPORT=0", "complete": merged.get("env", {}).get("complete"),
                             "elapsed_s": merged.get("env", {}).get("elapsed_s")}
        env["backends"].update(merged.get("env", {}).get("backends", {}))
    hiddens = options.parse_hidden(getattr(args, "hidden", NORM_HIDDEN))
    cells = sum(len(options.shapes(op, getattr(torch, d).itemsize, size_list, world, hiddens))
                for op in ops for d in dtypes)
    progress = Progress(cells * len(backends) * len(modes), enabled=rank == 0 and not args.no_progress)

    def skip(op, backend, dtype, nbytes, why, mode=None):
        e = {"op": op, "backend": backend, "dtype": dtype, "bytes_per_rank": nbytes, "why": why, **extra}
        if mode:
            e["mode"] = mode
        not_run.append(e)

    for op in ops:
        for dname in dtypes:
            dtype = getattr(torch, dname)
            for shape in options.shapes(op, dtype.itemsize, size_list, world, hiddens):
                numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
                nbytes = numel * dtype.itemsize
                extra = {"hidden": shape[1]} if len(shape) > 1 else {}  # a norm op's rows: (tokens, hidden)
                x0 = make_input(rank, op, dtype, numel, device).view(shape)
                ref = reference(op, x0, world) if op in OPS else None  # the norm ops' cases check themselves
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
                                         "mode": mode, "median_us": round(worst, 3), "correct": ok, **extra,
                                         **({"route": case.route} if case.route else {})})
                        progress.advance(1, f"{op} {dname} {human_bytes(nbytes)} {backend} {mode}")
                del ready
            if rank == 0:
                _write(path, env, rows, not_run, world, complete=False, t0=t0, log=progress.write)
    progress.close()

    if not args.no_kernel_probe:
        env["nccl_kernels"] = probe_nccl_kernels([op for op in ops if op in OPS], dtypes, backends, size_list, res, rank, world, device)
    data = _write(path, env, rows, not_run, world, complete=True, t0=t0, log=say) if rank == 0 else None
    if rank == 0 and not quiet:
        print("\n" + format_env(data["env"]))
        print(tables.format_tables(data))
        if not_run:
            print("\nnot run:")
            print(tables.format_not_run(not_run))
        print("\n" + tables.format_summary(data))
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
    rows = bandwidth.add_bandwidth([dict(r) for r in rows], world, env.get("peer_copy_gbps"))
    data = {"env": env, "rows": rows, "not_run": list(not_run)}
    try:
        results_file.write_json(path, data)
    except Exception as e:  # noqa: BLE001
        log(f"could not write {path}: {describe(e)}")
    return data
