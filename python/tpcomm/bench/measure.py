"""The measurement loop of tpcomm.bench and its backends."""
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess

import torch
import torch.distributed as dist

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BACKENDS = ("nccl", "tpcomm", "tpcomm_packet", "tpcomm_bulk")
OPS = ("all_reduce", "all_gather")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sizes(lo, hi, quick):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2 if not quick else 8
    if quick and out[-1] != hi:
        out.append(hi)
    return out


# ------------------------------------------------------------------ backends
class Unavailable(Exception):
    """A backend cannot run this case; the message says why."""


def make_call(backend, op, comm, x):
    """A zero-argument callable running `op` on x with `backend`, or raises
    Unavailable. The callable returns the result tensor."""
    import tpcomm
    from tpcomm import _lib

    nbytes = x.numel() * x.element_size()
    if backend == "nccl":
        if op == "all_reduce":
            return lambda: dist.all_reduce(x) or x
        out = torch.empty((comm.world_size * x.numel(),), dtype=x.dtype, device=x.device)
        return lambda: dist.all_gather_into_tensor(out, x) or out
    if not comm.enabled:
        raise Unavailable(f"custom path disabled: {comm.disabled_reason}")
    if backend == "tpcomm":
        route = comm.route_all_reduce(x) if op == "all_reduce" else comm.route_all_gather(x)
        if route == "nccl":
            raise Unavailable(f"dispatcher routes {nbytes} B to NCCL (over the cap)")
        return (lambda: comm.all_reduce(x)) if op == "all_reduce" else (lambda: comm.all_gather(x))
    algo = _lib.ALGO_PACKET if backend == "tpcomm_packet" else _lib.ALGO_BULK
    if algo == _lib.ALGO_PACKET and nbytes > comm.packet_max_bytes:
        raise Unavailable(f"over the packet cap of {comm.packet_max_bytes} B")
    limit = comm.max_bytes if op == "all_reduce" else comm.max_bytes // comm.world_size
    if algo == _lib.ALGO_BULK and nbytes > limit:
        raise Unavailable(f"over the cap of {limit} B per rank")
    if op == "all_reduce":
        return lambda: torch.ops.tpcomm.custom_all_reduce(x, comm.handle, algo)
    return lambda: torch.ops.tpcomm.custom_all_gather(x, 0, comm.handle, algo)


# ------------------------------------------------------------------- timing
def _barrier():
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def time_graph(call, ops_per_graph, replays):
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
    for _ in range(3):
        graph.replay()
    _barrier()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / ops_per_graph)
    del graph
    return statistics.median(times)


def time_eager(call, ops, reps):
    for _ in range(3):
        call()
    _barrier()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ops):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / ops)
    return statistics.median(times)


def check_against_nccl(op, call, comm, x):
    """Bit-exact check of a custom backend on integer-valued data."""
    y = call()
    if op == "all_reduce":
        ref = x.clone()
        dist.all_reduce(ref)
    else:
        ref = torch.empty((comm.world_size * x.numel(),), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(ref, x)
    return torch.equal(y.flatten().view(torch.int16 if y.element_size() == 2 else torch.int32),
                       ref.flatten().view(torch.int16 if ref.element_size() == 2 else torch.int32))


# -------------------------------------------------------------- environment
def environment(world):
    env = {"date": datetime.date.today().isoformat(), "world_size": world, "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": platform.node(), "python": platform.python_version()}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - report, do not fail
        env["nccl"] = f"unknown ({e})"
    if torch.cuda.is_available() and torch.cuda.device_count():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
    except Exception as e:  # noqa: BLE001
        env["driver"] = f"unknown ({e})"
    env["multicast"] = "off (" + ", ".join(f"{k}={os.environ.get(k)}" for k in MULTICAST_OFF) + ")"
    return env


def environment_text(world):
    return "\n".join(f"{k:>10}: {v}" for k, v in environment(world).items())


def default_out_path(env):
    gpu = env.get("gpu", "gpu").lower().replace("nvidia", "").strip().replace(" ", "-")
    return os.path.join("benchmarks", "results", f"{gpu}x{env['world_size']}.json")


# ------------------------------------------------------------------- worker
def worker(rank, world, port, args):
    for k, v in MULTICAST_OFF.items():
        os.environ[k] = v
    torch.cuda.set_device(rank)
    if port is None:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    import tpcomm

    max_size = args.max_bytes
    comm = tpcomm.Communicator(max_bytes=max(16 << 20, max_size))
    ops = [o for o in args.ops.split(",") if o]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    backends = [b for b in (args.backends or ",".join(BACKENDS)).split(",") if b]
    replays = 5 if args.quick else args.replays
    rows, skipped = [], []
    for op in ops:
        for dtype in dtypes:
            for nbytes in sizes(args.min_bytes, max_size, args.quick):
                numel = max(1, nbytes // dtype.itemsize)
                x0 = torch.randint(-4, 5, (numel,), device="cuda").to(dtype)
                for backend in backends:
                    x = x0.clone()  # NCCL's in-place timing loop grows its input
                    try:
                        call = make_call(backend, op, comm, x)
                    except Unavailable as e:
                        skipped.append((op, backend, nbytes, str(e)))
                        continue
                    ok = True if backend == "nccl" else check_against_nccl(op, call, comm, x)
                    for mode in modes:
                        if mode == "graph":
                            t = time_graph(call, args.ops_per_graph, replays)
                        else:
                            t = time_eager(call, args.ops_per_graph, replays)
                        worst = torch.tensor([t], device="cuda")
                        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                        rows.append({"op": op, "backend": backend, "dtype": str(dtype).replace("torch.", ""),
                                     "bytes_per_rank": nbytes, "mode": mode, "median_us": round(worst.item(), 3),
                                     "correct": bool(ok)})
    comm.check()
    comm.close()
    if rank == 0:
        env = environment(world)
        print(environment_text(world))
        print_table(rows)
        for op, backend, nbytes, why in skipped:
            if nbytes == max_size or backend != "tpcomm_packet":
                print(f"  not run: {op} {backend} at {nbytes} B: {why}")
        path = args.out or default_out_path(env)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"env": env, "rows": rows,
                       "not_run": [{"op": o, "backend": b, "bytes_per_rank": n, "why": w} for o, b, n, w in skipped]},
                      f, indent=1)
        print(f"wrote {path}")
    dist.destroy_process_group()


def print_table(rows):
    keys = sorted({(r["op"], r["dtype"], r["mode"]) for r in rows})
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
    for op, dtype, mode in keys:
        print(f"\n{op} {dtype} {mode} (median us per op; x = speed-up of tpcomm over nccl)")
        print(f"{'bytes/rank':>12} " + " ".join(f"{b:>14}" for b in backends) + f" {'x':>6}")
        by_size = {}
        for r in rows:
            if (r["op"], r["dtype"], r["mode"]) == (op, dtype, mode):
                by_size.setdefault(r["bytes_per_rank"], {})[r["backend"]] = r
        for n in sorted(by_size):
            cells = by_size[n]
            line = f"{n:>12} " + " ".join(
                f"{cells[b]['median_us']:>13.2f}{'' if cells[b]['correct'] else '!'}" if b in cells else f"{'-':>14}"
                for b in backends)
            if "nccl" in cells and "tpcomm" in cells:
                line += f" {cells['nccl']['median_us'] / cells['tpcomm']['median_us']:>6.2f}"
            print(line)
