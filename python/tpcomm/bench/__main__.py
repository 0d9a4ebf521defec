"""python -m tpcomm.bench: tpcomm against NCCL and torch's symmetric memory on
every visible GPU.

One process per GPU (spawned here, or one per rank under torchrun). For every
op (all_reduce, all_gather, reduce_scatter), dtype, size and backend it records the median
time per op in two modes: "graph" captures N back-to-back ops in one CUDA
graph and takes the median over --replays replays divided by N; "eager" times
N plain calls, --eager-reps times. N is --ops-per-graph up to --large-bytes
per rank and --ops-per-graph-large above. Every backend is warmed up, checked
bit for bit on integer-valued data and timed after a barrier; the figure kept
is the slowest rank's median. In graph mode the backends of one op, dtype and
size are replayed in shared rounds (each timed replay after an untimed one),
so that drift of the machine weighs on all of them alike; --sequential times
one backend after the other.

Backends: nccl (torch.distributed), nccl_nomix and nccl_window_nomix (the
same in a first set of processes started with NCCL_GRAPH_MIXING_SUPPORT=0,
graph mode only: NCCL at its best under CUDA graphs), nccl_window (NCCL symmetric kernels on a
MemPool registered with ProcessGroupNCCL.register_mem_pool(pool, symm=True)),
symm_one_shot / symm_two_shot (torch.ops.symm_mem.one_shot_all_reduce /
two_shot_all_reduce_, all_reduce only, input already in the buffer),
symm_two_shot_copied (the two-shot with the copies in and out a dispatcher
would add), tpcomm (the dispatcher's choice),
tpcomm_packet, tpcomm_line, tpcomm_two_shot, tpcomm_bulk (kernels forced). A backend that cannot run a case
is listed under "not run" with the reason; the run goes on. NVLink multicast
stays off throughout.

--ops may also name the fused all-reduce + add + RMSNorm and its FP8
epilogues (all_reduce_add_rms_norm, all_reduce_add_rms_norm_fp8_per_tensor,
..._per_token, ..._per_token_group; bench/norm_cases.py): inputs (tokens,
hidden) for every --hidden, on tpcomm, tpcomm_fused (the fused kernel forced)
and tpcomm_past_cap (the route past the routing table's fused_norm_max_bytes),
checked against tpcomm.reference. Under torchrun with TPCOMM_SHARE_GPU=1,
ranks past the GPUs share them over gloo: results checked, times meaningless.

Writes tables to the terminal (bandwidth for sizes >= 1 MiB under each),
JSON to results/<gpu>x<n>.json under the working directory (or --out) and PNG figures next to
it (<stem>_<op>_<mode>.png, <stem>_speedup.png; python -m tpcomm.bench.plots
redraws them). With fewer than 2 GPUs it prints the environment and exits 0.
"""
import argparse
import os
import signal
import sys
import time

from .. import topology
from . import options, results_file, tables
from .vocabulary import ALL_OPS, BACKENDS, MODES, NOMIX_BACKENDS, NORM_HIDDEN, NORM_OPS



def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="tpcomm bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter",
                   help="comma-separated ops (default: the three collectives; reduce_scatter's size is its input "
                        "per rank); also " + ",".join(NORM_OPS) + ": the fused all-reduce + add + RMSNorm "
                        "and its FP8 epilogues, on backends tpcomm, tpcomm_fused, tpcomm_past_cap")
    p.add_argument("--hidden", default=NORM_HIDDEN,
                   help="the norm ops' hidden sizes, comma-separated (default %(default)s); inputs (tokens, hidden), "
                        "tokens = size per rank // row bytes")
    p.add_argument("--dtypes", default="bfloat16,float16,float32",
                   help="comma-separated: bfloat16,float16,float32 (or bf16,fp16,fp32)")
    p.add_argument("--min-bytes", type=int, default=64, help="smallest size per rank (default 64)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest size per rank (default 64 MiB)")
    p.add_argument("--sizes-step", type=int, default=4,
                   help="factor between consecutive sizes (default 4: 64 B, 256 B, 1 KiB, ..., 64 MiB)")
    p.add_argument("--modes", default="graph,eager")
    p.add_argument("--backends", default=None,
                   help="comma-separated subset of: " + ",".join(BACKENDS) + " (default: all)")
    p.add_argument("--ops-per-graph", type=int, default=50, help="ops per graph / eager run up to --large-bytes")
    p.add_argument("--ops-per-graph-large", type=int, default=10, help="ops per graph / eager run above it")
    p.add_argument("--large-bytes", type=int, default=1 << 20, help="size per rank above which ops are fewer")
    p.add_argument("--replays", type=int, default=20, help="graph replays timed (default 20)")
    p.add_argument("--eager-reps", type=int, default=10, help="eager runs timed (default 10)")
    p.add_argument("--sequential", dest="interleave", action="store_false",
                   help="graph mode: time one backend after the other, each in its own stretch, instead of every "
                        "backend of a size in shared rounds (each timed replay after one untimed one)")
    p.add_argument("--out", default=None, help="JSON path (default results/<gpu>x<n>.json here)")
    p.add_argument("--quick", action="store_true", help="x8 size steps, 5 replays, 3 eager runs (smoke run)")
    p.add_argument("--no-plots", action="store_true", help="write no PNG figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
    p.add_argument("--no-kernel-probe", action="store_true",
                   help="skip recording the NCCL kernel names of nccl / nccl_window (torch.profiler)")
    p.add_argument("--timeout-s", type=int, default=120,
                   help="NCCL watchdog timeout of the process group: a hung rank is aborted after it")
    p.add_argument("--merge-from", default=None, help=argparse.SUPPRESS)  # rows of the NCCL mixing-off run
    p.add_argument("--deadline-s", type=int, default=330,
                   help="the spawned ranks are stopped after this many seconds (partial results are kept, "
                        "tables and figures drawn from them); keep it under any outer time limit")
    args = p.parse_args(argv)
    try:
        options.parse_choices(args.ops, ALL_OPS, "op")
        options.parse_hidden(args.hidden)
        options.parse_dtypes(args.dtypes)
        options.parse_choices(args.modes, MODES, "mode")
        options.parse_choices(args.backends or ",".join(BACKENDS), BACKENDS, "backend")
        options.size_list(args.min_bytes, args.max_bytes, args.sizes_step)
        if min(args.ops_per_graph, args.ops_per_graph_large, args.replays, args.eager_reps) < 1:
            raise ValueError("ops per graph, replays and eager reps must be at least 1")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    topology.force_multicast_off()
    import torch

    from . import environment, worker

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank = int(os.environ["RANK"])
        path = worker.worker(int(os.environ.get("LOCAL_RANK", rank)), int(os.environ["WORLD_SIZE"]), None, args)
        if rank == 0 and path and not args.no_plots:
            make_plots(path)
        return 0
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        n = 0
    if n < 2:
        print(environment.environment_text(n))
        print(f"tpcomm.bench needs at least 2 CUDA GPUs on this machine; found {n}. Nothing to measure.")
        print(f"not run: {', '.join(BACKENDS)}: needs at least 2 CUDA GPUs (found {n})")
        return 0
    return spawn_with_nomix(n, args)


def spawn_with_nomix(n, args):
    """The NCCL mixing-off backends first, in their own processes (NCCL reads
    NCCL_GRAPH_MIXING_SUPPORT once per process), graph mode only, into a
    temporary file; then everything else, whose rank 0 merges those rows."""
    import copy
    import tempfile

    from .worker import plan

    backends = plan(args)[3]
    nomix = [b for b in backends if b in NOMIX_BACKENDS]
    if not nomix or "graph" not in options.parse_choices(args.modes, MODES, "mode"):
        return spawn(n, args)
    rest = [b for b in backends if b not in NOMIX_BACKENDS]
    with tempfile.TemporaryDirectory(prefix="tpcomm-bench-nomix-") as tmp:
        first = copy.copy(args)
        first.backends, first.modes, first.out = ",".join(nomix), "graph", os.path.join(tmp, "nomix.json")
        first.no_plots, first.no_kernel_probe, first.no_progress, first.quiet = True, True, True, True
        previous = os.environ.get("NCCL_GRAPH_MIXING_SUPPORT")
        os.environ["NCCL_GRAPH_MIXING_SUPPORT"] = "0"  # inherited by the spawned ranks
        print(f"tpcomm.bench: {','.join(nomix)} first, in processes with NCCL_GRAPH_MIXING_SUPPORT=0", flush=True)
        try:
            spawn(n, first)
        finally:
            if previous is None:
                del os.environ["NCCL_GRAPH_MIXING_SUPPORT"]
            else:
                os.environ["NCCL_GRAPH_MIXING_SUPPORT"] = previous
        if not rest:
            rest = ["nccl"]  # the tables need a reference column
        second = copy.copy(args)
        second.backends = ",".join(rest)
        second.merge_from = first.out if os.path.exists(first.out) else None
        return spawn(n, second)


def spawn(n, args, target=None):
    """Runs one rank per GPU (target(rank, n, init_method, args, queue), default
    worker.spawned_worker) under --deadline-s; then draws the figures.
    Returns 0 when the results file is complete, else 1."""
    import torch.multiprocessing as mp

    from .. import _ranks
    from .worker import spawned_worker

    target = target or spawned_worker
    queue = mp.get_context("spawn").SimpleQueue()
    start = time.monotonic()
    failure = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # an outer `timeout`: keep what was measured
    with _ranks.rendezvous(prefix="tpcomm-bench-") as (init_method, tmp):
        procs = []
        try:
            procs = _ranks.start(n, _rank, init_method, target, args, queue, tmp)
            outcome = _ranks.wait(procs, args.deadline_s, grace_s=10.0)
            if outcome.hung:
                failure = f"the ranks were still running after --deadline-s {args.deadline_s} s and were stopped"
            elif outcome.failed:
                r = outcome.failed[0]
                failure = f"a rank failed: rank {r} ({_ranks.exit_text(procs[r].exitcode)}): {_error(tmp, r)}"
        except _Terminated:
            failure = "stopped by SIGTERM"
            _ranks.stop(procs, term_wait_s=10.0)
        finally:
            signal.signal(signal.SIGTERM, previous)
    path = None
    try:
        while not queue.empty():
            path = queue.get()
    except Exception:  # noqa: BLE001
        pass
    complete = False
    if path and os.path.exists(path):
        try:
            complete = bool(results_file.read_json(path).get("env", {}).get("complete"))
        except Exception:  # noqa: BLE001
            complete = False
    if failure and complete:
        print(f"\ntpcomm.bench: note: {failure}; the results in {path} are complete", flush=True)
        failure = None
    if failure:
        print(f"\ntpcomm.bench: {failure}", flush=True)
        if path and os.path.exists(path):
            try:
                data = results_file.read_json(path)
                print(f"partial results ({len(data.get('rows', []))} rows) in {path}:")
                print(tables.format_tables(data))
                if data.get("not_run"):
                    print("\nnot run:")
                    print(tables.format_not_run(data["not_run"]))
                print("\n" + tables.format_summary(data))
            except Exception as e:  # noqa: BLE001
                print(f"could not read the partial results in {path}: {e}")
        else:
            print("no results file was written")
    if path and os.path.exists(path) and not args.no_plots:
        make_plots(path)
    print(f"tpcomm.bench took {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failure else 0


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


def _rank(rank, n, init_method, target, args, queue, tmp):
    """One spawned rank: target(rank, n, init_method, args, queue); an
    exception's traceback is left in tmp/rank<r>.error for the parent's
    report before it ends the rank."""
    try:
        target(rank, n, init_method, args, queue)
    except BaseException:
        import traceback

        with open(os.path.join(tmp, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _error(tmp, rank):
    """The last line of a rank's traceback, or what is known without one."""
    try:
        with open(os.path.join(tmp, f"rank{rank}.error")) as f:
            lines = f.read().strip().splitlines()
        return lines[-1] if lines else "no traceback"
    except OSError:
        return "no traceback (a crash or a signal)"


def make_plots(path):
    """Figures next to the JSON; a failure is reported, never raised."""
    try:
        from . import plots

        for f in plots.render(results_file.read_json(path), plots.stem_for(path)):
            print(f"wrote {f}")
    except ImportError as e:
        print(f"no figures: matplotlib is not importable ({e})")
    except Exception as e:  # noqa: BLE001
        print(f"no figures: {type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
