"""`tpcomm doctor` (or `python -m tpcomm.doctor`): what a user runs first and
pastes into a bug report. It reports, in plain lines:

  - tpcomm's version (with the label naming the CUDA it was built for),
    Python, torch, its CUDA / ROCm and NCCL versions;
  - the driver and the GPUs, with the NVLink / P2P links between them (NVML
    through nvidia-ml-py when it imports, else `nvidia-smi topo -m`, else
    torch's can_device_access_peer);
  - whether the compiled extension loads, and why not;
  - the routing table in force and its bands for this world size;
  - every TPCOMM_* variable set (and the NCCL / multicast ones), checked;
  - with 2 or more GPUs (or --share-gpu on one), a short self-test: each
    collective run by tpcomm and by torch.distributed on the same inputs,
    compared bit for bit, with the latency of each.

The inputs of the self-test are small integers, so every sum is exact in any
order and tpcomm's results must equal torch.distributed's bit for bit; the
fused add + RMSNorm is held to 0 ulp on its residual output and 1 ulp on the
normed output (its mean of squares is summed in another order than torch's).

Exit status: 0 when nothing is wrong (a machine without GPUs included), 1
when something is (the extension does not load, a TPCOMM_* variable is bad,
a self-test result differs or fails)."""
import argparse
import ctypes
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

# Variables shown besides TPCOMM_*: the ones that change what NCCL, torch's
# symmetric memory or the CUDA runtime do under tpcomm.
OTHER_ENV = ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
             "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG")
# Per-rank input sizes of the self-test: one in each band of the shipped
# table (packet, line, bulk kernels).
SELF_TEST_BYTES = (8 * 1024, 512 * 1024, 4 * 1024 * 1024)
NORM_SHAPE = (16, 4096)  # tokens x hidden of the fused add + RMSNorm case
NORM_EPS = 1e-6


class Report:
    """Lines under section headings, and the problems found on the way."""

    def __init__(self, out=None):
        self.out = out  # None: sys.stdout as it is at each line
        self.problems = []

    def section(self, title):
        print(f"\n== {title}", file=self.out or sys.stdout)

    def line(self, key, value=""):
        print(f"{key}: {value}" if value != "" else key, file=self.out or sys.stdout)

    def problem(self, key, value):
        self.problems.append(f"{key}: {value}")
        self.line(key, f"PROBLEM: {value}")


def _version_facts(report):
    import torch

    import tpcomm

    report.section("versions")
    try:
        installed = importlib.metadata.version("tpcomm")
    except importlib.metadata.PackageNotFoundError:
        installed = "not installed as a package (imported from a source tree)"
    report.line("tpcomm", f"{tpcomm.__version__} from {os.path.dirname(tpcomm.__file__)}")
    report.line("tpcomm distribution", installed)
    report.line("python", f"{platform.python_version()} ({sys.executable})")
    report.line("platform", f"{platform.platform()} on {socket.gethostname()}")
    report.line("torch", torch.__version__)
    report.line("torch CUDA", torch.version.cuda or "none")
    if torch.version.hip:
        report.line("torch ROCm (HIP)", torch.version.hip)
    report.line("NCCL (torch's)", _nccl_version())


def _nccl_version():
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001 - a CPU-only torch has no NCCL
        return f"unavailable ({e})"
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def _driver_version():
    """(driver version string or None, how it was found)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return (version.decode() if isinstance(version, bytes) else version), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml or no NVML: the next way
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.split()[0], "nvidia-smi"
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"supports CUDA {version.value // 1000}.{version.value % 1000 // 10}", "libcuda"
    except (OSError, AttributeError):
        pass
    return None, "no NVIDIA driver found (no NVML, nvidia-smi or libcuda.so.1)"


def _gpu_facts(report):
    """Reports the driver, the GPUs and their links; returns the GPU count."""
    import torch

    report.section("driver and GPUs")
    driver, how = _driver_version()
    report.line("driver", f"{driver} ({how})" if driver else how)
    try:
        count = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001
        report.line("GPUs", f"none usable ({e})")
        return 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        report.line("GPUs", "no GPUs visible to torch" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                                           if visible is not None else ""))
        return 0
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        report.line(f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability "
                                f"{p.major}.{p.minor}, uuid {getattr(p, 'uuid', '?')}")
    report.section("GPU links")
    for line in _topology_lines(count):
        report.line(line)
    return count


def _topology_lines(count):
    """NVLink / P2P between the visible GPUs, by the best source available."""
    lines = _nvml_topology(count)
    if lines:
        return lines
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return ["(nvidia-smi topo -m)"] + out.stdout.rstrip().splitlines()
        except (OSError, subprocess.TimeoutExpired):
            pass
    import torch

    lines = ["(torch.cuda.can_device_access_peer; install nvidia-ml-py for NVLink facts)"]
    for a in range(count):
        peers = [str(b) for b in range(count) if b != a and torch.cuda.can_device_access_peer(a, b)]
        lines.append(f"GPU {a} reaches by P2P: {', '.join(peers) or 'none'}")
    return lines


def _nvml_topology(count):
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no pynvml or no NVML
        return None
    try:
        handles = []
        for i in range(count):  # by UUID: CUDA_VISIBLE_DEVICES renumbers GPUs, NVML does not
            uuid = str(torch.cuda.get_device_properties(i).uuid)
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid))
        lines = ["(NVML)"]
        for i, h in enumerate(handles):
            links = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break
            lines.append(f"GPU {i}: {links} NVLinks active")
        for i, a in enumerate(handles):
            for j in range(i + 1, count):
                nvlink = pynvml.nvmlDeviceGetP2PStatus(a, handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                p2p = pynvml.nvmlDeviceGetP2PStatus(a, handles[j], pynvml.NVML_P2P_CAPS_INDEX_READ)
                ok = pynvml.NVML_P2P_STATUS_OK
                lines.append(f"GPU {i} - GPU {j}: NVLink {'yes' if nvlink == ok else 'no'}, "
                             f"P2P read {'yes' if p2p == ok else 'no'}")
        return lines
    except Exception as e:  # noqa: BLE001 - report what NVML could not tell
        return [f"(NVML could not tell: {e})"]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _linked_runtime(path):
    """The GPU runtime the library names (libcudart.so.13, libamdhip64.so.6), read from its bytes."""
    try:
        with open(path, "rb") as f:
            found = re.search(rb"lib(cudart|amdhip64)\.so\.\d+", f.read())
    except OSError:
        return None
    return found.group(0).decode() if found else None


def _extension_facts(report):
    import torch

    from . import _lib

    report.section("extension")
    try:
        path = _lib.library_path()
    except ImportError as e:
        report.problem("tpcomm._C", str(e))
        return False
    report.line("tpcomm._C", path)
    runtime = _linked_runtime(path)
    report.line("links", runtime or "no CUDA or HIP runtime named")
    loaded = True
    try:
        _lib.load()
        report.line("loads", "yes (torch.ops.tpcomm registered)")
    except ImportError as e:
        report.problem("loads", f"no: {e}")
        loaded = False
    if runtime and runtime.startswith("libcudart.so.") and torch.version.cuda:
        built, running = runtime.rsplit(".", 1)[1], torch.version.cuda.split(".")[0]
        if built != running:
            report.problem("CUDA major", f"the extension was built for CUDA {built}, torch runs CUDA "
                                         f"{torch.version.cuda}: install the tpcomm wheel for CUDA {running}")
    if loaded:
        report.line("eager fast path", "bound" if _lib.fastpath() is not None else "not built (eager calls go "
                                                                                   "through the torch op)")
    return loaded


def _routing_facts(report, world_size, config):
    report.section(f"routing (world size {world_size})")
    import torch

    from . import _group_setup, routing, routing_table
    source = getattr(config, "table", None) if config is not None else None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    path = _group_setup.table_source(source, torch.device("cuda", 0) if gpu else torch.device("cpu"))
    try:
        table = routing_table.load_table(path)
    except Exception as e:  # noqa: BLE001 - a bad table is a finding
        report.problem("table", str(e))
        return
    report.line("table", source or f"{path} (shipped, for {routing_table.gpu_model(gpu) if gpu else 'no GPU'})")
    about = table.get("about", "")
    if about:
        report.line("measured on", about.split(":", 1)[1].split(",", 2)[0].strip() if ":" in about else about[:120])
    force = dict(getattr(config, "force", ()) or ())
    forbid = getattr(config, "forbid", ()) or ()
    routes = routing_table.effective_routes(table, world_size, force, forbid)
    from .config import Config

    defaults = Config()
    caps = routing.Caps(world_size, getattr(config, "max_bytes", defaults.max_bytes),
                        getattr(config, "packet_max_bytes", defaults.packet_max_bytes), torch.version.hip is None)
    report.line("caps", f"max_bytes {_size(caps.max_bytes)}, packet_max_bytes {_size(caps.packet_max_bytes)} "
                        "(TPCOMM_MAX_BYTES, TPCOMM_PACKET_MAX_BYTES)")
    for op, by_dtype in routes.items():
        row = "own row" if str(world_size) in table["routes"][op] else "'*' row"
        try:
            routed = routed_bands(routes, caps, op)
        except ImportError as e:  # the kernels' limits come from the extension
            report.problem(f"{op} ({row})", f"no routed sizes without the extension: {e}")
            continue
        bands = ", ".join(f"<= {_size(limit)} {backend}" for limit, backend in routed)
        report.line(f"{op} ({row})", f"{bands}, larger: nccl" if bands else "nccl at every size")


def routed_bands(routes, caps, op, dtype=None):
    """[(limit, backend)] of what a call of `op` really takes, size by size
    (bytes per rank of well-aligned input): the table's bands after the caps
    (max_bytes, packet_max_bytes) and each kernel's own limits, by asking
    routing.route at every size where some rule changes its answer. The last
    band is the largest size a kernel takes; larger ones go to NCCL. dtype:
    a torch dtype (default bfloat16, the reducing ops' usual one)."""
    import torch

    from . import _constants as C, routing

    dtype = dtype or torch.bfloat16
    world = caps.world_size
    align = 16 * world if op == "reduce_scatter" else 16
    limits = {limit for bands in routes[op].values() for limit, _ in bands if limit < 1 << 40}
    limits |= {caps.max_bytes, caps.max_bytes // world, caps.packet_max_bytes, caps.packet_max_bytes * world,
               C.TPC_LINE_STEP_BYTES * (world - 1)}
    points = sorted({t - t % align for t in limits if t >= align})
    bands = []
    for t in points:
        backend = routing.route(routes, caps, op, dtype, t, t)
        if bands and bands[-1][1] == backend:
            bands[-1] = (t, backend)
        else:
            bands.append((t, backend))
    while bands and bands[-1][1] == "nccl":
        bands.pop()
    return bands


def _size(nbytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _env_facts(report):
    """Reports the variables in force; returns the checked Config, or None when one is bad."""
    from .config import Config, unknown_variables

    report.section("environment")
    names = sorted(n for n in os.environ if n.startswith("TPCOMM_")) + [n for n in OTHER_ENV if n in os.environ]
    unknown = {name: f" (not a tpcomm variable: did you mean {closest}?)" if closest else " (not a tpcomm variable)"
               for name, closest in unknown_variables()}
    for name in names:
        report.line(name, repr(os.environ[name]) + unknown.get(name, ""))
    if not names:
        report.line("(no TPCOMM_* variables set)")
    try:
        config = Config.from_env()
        if hasattr(config, "checked"):
            config = config.checked()
    except ValueError as e:
        report.problem("TPCOMM_* variables", str(e))
        return None
    return config


# ----------------------------------------------------------------- self-test

def _rank_inputs(rank, op, nbytes, dtype, world):
    """This rank's input: small integers (exact sums in any order), from a
    seed, so that every run of the doctor sends the same data."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + 7 * nbytes + len(op))
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    numel -= numel % (8 * world)  # every kernel takes it; reduce_scatter splits it by rank
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def _timed(fn, iters, device):
    """Mean seconds per call of fn() over iters calls, after 5 warm-up calls
    (tpcomm._ranks.seconds_per_call: CUDA events on a GPU, the host clock on the CPU)."""
    from . import _ranks

    for _ in range(5):
        fn()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return _ranks.seconds_per_call(fn, iters, device)


def _self_test_rank(rank, world, init_method, devices, backend, share_gpu, iters, sizes, out_dir):
    """One rank of the self-test on `device` (a GPU; the CPU only in tpcomm's
    own tests of this code); it writes its rows to out_dir/rank{rank}.json."""
    import torch
    import torch.distributed as dist

    from . import topology

    topology.force_multicast_off()
    if share_gpu:
        _allow_shared_gpu()
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    rows = []
    try:
        import tpcomm

        comm = tpcomm.Communicator(device=device)
        rows.append({"op": "communicator", "ok": comm.enabled,
                     "note": "custom path on" if comm.enabled else f"custom path off: {comm.disabled_reason}"})
        # torch.distributed's side: NCCL on the GPUs, or gloo (host copies) where ranks share one.
        on_ref = (lambda t: t.cpu()) if backend == "gloo" else (lambda t: t)
        for nbytes in sizes:
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                x = _rank_inputs(rank, op, nbytes, torch.bfloat16, world).to(device)
                ours, theirs, route = _run_pair(comm, op, x, world, on_ref)
                same = _on_every_rank(torch.equal(ours.cpu(), theirs.cpu()))
                row = {"op": op, "bytes": nbytes, "route": route, "ok": same}
                if same:  # the same on every rank, so every rank runs the same timed collectives
                    row["tpcomm_s"] = _timed(lambda: _run_ours(comm, op, x), iters, device)
                    if backend == "nccl":  # gloo's host copies say nothing about NCCL
                        row["torch_s"] = _timed(lambda: _run_theirs(op, x, world), iters, device)
                rows.append(row)
        rows.append(_fused_row(comm, rank, world, device, on_ref, iters))
        comm.close()
    except Exception as e:  # noqa: BLE001 - the doctor reports, it does not crash
        rows.append({"op": "error", "ok": False, "note": f"rank {rank}: {type(e).__name__}: {e}"})
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(rows, f)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _on_every_rank(flag):
    """True when flag is true on every rank (a collective: every rank calls it)."""
    import torch.distributed as dist

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return all(flags)


def _allow_shared_gpu():
    """Lets ranks on one GPU keep the custom path (a test of the kernels' results only)."""
    from . import _testing

    _testing.allow_shared_gpu(True)


def _run_ours(comm, op, x):
    return getattr(comm, op)(x)


def _run_theirs(op, x, world):
    """The op by torch.distributed. On gloo (ranks sharing a GPU; host
    tensors) reduce_scatter is an all_reduce and this rank's slice, and
    all_gather fills a list, which every gloo build has."""
    import torch
    import torch.distributed as dist

    gloo = x.device.type == "cpu"
    if op == "all_reduce" or (op == "reduce_scatter" and gloo):
        y = x.clone()
        dist.all_reduce(y)
        return y.chunk(world)[dist.get_rank()].clone() if op == "reduce_scatter" else y
    if op == "all_gather":
        if gloo:
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            return torch.cat(parts)
        y = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(y, x)
        return y
    y = torch.empty(x.numel() // world, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(y, x)
    return y


def _run_pair(comm, op, x, world, on_ref):
    route = getattr(comm, f"route_{op}")(x) + ("" if comm.enabled else " (custom path off)")  # the fallback: nccl, gloo
    return _run_ours(comm, op, x), _run_theirs(op, on_ref(x), world), route


def _fused_row(comm, rank, world, device, on_ref, iters):
    import torch

    from .reference import reference_add_rms_norm, ulp_distance

    g = torch.Generator().manual_seed(99 + rank)
    x = torch.randint(-8, 9, NORM_SHAPE, generator=g).to(torch.bfloat16).to(device)
    shared = torch.Generator().manual_seed(5)  # the same residual and weight on every rank
    residual = torch.randint(-8, 9, NORM_SHAPE, generator=shared).to(torch.bfloat16).to(device)
    weight = (torch.rand(NORM_SHAPE[1], generator=shared) + 0.5).to(torch.bfloat16).to(device)
    route = comm.route_all_reduce_add_rms_norm(x, weight) if comm.enabled else "unfused (custom path off)"
    normed, summed = comm.all_reduce_add_rms_norm(x, residual, weight, NORM_EPS)
    total = _run_theirs("all_reduce", on_ref(x), world).to(device)
    ref_normed, ref_summed = reference_add_rms_norm([total], residual, weight, NORM_EPS)
    residual_ulps = int(ulp_distance(summed, ref_summed).max())
    normed_ulps = int(ulp_distance(normed, ref_normed).max())
    row = {"op": "all_reduce_add_rms_norm", "bytes": x.numel() * x.element_size(), "route": route,
           "ok": _on_every_rank(residual_ulps == 0 and normed_ulps <= 1),
           "note": f"residual_out {residual_ulps} ulp, normed {normed_ulps} ulp"}
    if row["ok"]:
        row["tpcomm_s"] = _timed(lambda: comm.all_reduce_add_rms_norm(x, residual, weight, NORM_EPS), iters, device)
    return row


def _self_test(report, count, share_gpu, world, iters, timeout_s, on_cpu=False, sizes=SELF_TEST_BYTES):
    """The self-test over `world` spawned ranks (on_cpu: ranks on the CPU over
    gloo, for tpcomm's own tests of this code on a machine without GPUs)."""
    from . import _ranks

    world = world or (2 if share_gpu or on_cpu else count)
    devices = ["cpu"] * world if on_cpu else [f"cuda:{0 if share_gpu else r}" for r in range(world)]
    backend = "gloo" if share_gpu or on_cpu else "nccl"  # NCCL refuses two ranks on one GPU
    report.section(f"self-test ({world} ranks on {', '.join(sorted(set(devices)))}, "
                   f"tpcomm against torch.distributed/{backend})")
    clock = "the host clock" if on_cpu else "CUDA events"
    report.line("latency", f"eager calls, mean of {iters} after 5 warm-up calls ({clock})")
    if share_gpu:
        report.line("note", "ranks share one GPU: results are checked, latencies only say the kernels ran")
    with _ranks.rendezvous() as (init_method, out_dir):
        target = importlib.import_module("tpcomm.doctor")._self_test_rank  # not __main__'s: spawn re-imports it
        procs = _ranks.start(world, target, init_method, devices, backend, share_gpu, iters, sizes, out_dir)
        # every rank writes its rows, errors included, and leaves: only a hang is killed
        late = _ranks.wait(procs, timeout_s, grace_s=timeout_s).hung
        if late:
            report.problem("self-test", f"ranks {late} still running after {timeout_s:.0f} s: killed")
        rows = []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{r}.json")
            if not os.path.exists(path):
                report.problem(f"rank {r}", f"wrote no results (exit code {p.exitcode})")
                continue
            with open(path) as f:
                ranks_rows = json.load(f)
            # Rank 0's rows (their verdicts hold for every rank), and every rank's errors.
            rows += [row for row in ranks_rows if r == 0 or row["op"] == "error"]
    for row in rows:
        _report_row(report, row)


def _report_row(report, row):
    name = row["op"] + (f" {_size(row['bytes'])}/rank" if "bytes" in row else "")
    parts = [f"via {row['route']}"] if "route" in row else []
    if row["op"] in ("all_reduce", "all_gather", "reduce_scatter"):
        parts.append("bit-exact" if row["ok"] else "DIFFERS from torch.distributed")
    if row.get("note"):
        parts.append(row["note"])
    if "tpcomm_s" in row:
        parts.append(f"tpcomm {row['tpcomm_s'] * 1e6:.1f} us")
    if "torch_s" in row:
        parts.append(f"torch.distributed {row['torch_s'] * 1e6:.1f} us")
    (report.line if row["ok"] else report.problem)(name, ", ".join(parts))


# ---------------------------------------------------------------------- main

def build_parser():
    parser = argparse.ArgumentParser(prog="tpcomm doctor", description="Checks this machine for tpcomm and "
                                     "prints a report to paste into a bug report.")
    parser.add_argument("--share-gpu", action="store_true",
                        help="run the self-test with every rank on GPU 0 (a check of results on one GPU)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks in the self-test (default: every visible GPU; 2 with --share-gpu)")
    parser.add_argument("--no-self-test", action="store_true", help="report only; run no collective")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per self-test case (default 50)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on the self-test in seconds")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.world_size is not None and not 2 <= args.world_size <= 8:
        build_parser().error("--world-size must be 2..8")
    if args.iters < 1:
        build_parser().error("--iters must be at least 1")
    report = Report()
    print("tpcomm doctor")
    _version_facts(report)
    count = _gpu_facts(report)
    loaded = _extension_facts(report)
    config = _env_facts(report)
    world = args.world_size or (2 if args.share_gpu else max(count, 2))
    _routing_facts(report, world, config)
    report.section("summary")
    if count == 0:
        report.line("no GPUs", "nothing to self-test on this machine")
    elif args.no_self_test:
        report.line("self-test", "skipped (--no-self-test)")
    elif count < 2 and not args.share_gpu:
        report.line("self-test", "needs 2 GPUs (or --share-gpu to check results on one)")
    elif not args.share_gpu and args.world_size and args.world_size > count:
        report.problem("self-test", f"--world-size {args.world_size} but {count} GPUs visible")
    elif not loaded or config is None:
        report.line("self-test", "skipped: fix the problems above first")
    else:
        _self_test(report, count, args.share_gpu, args.world_size, args.iters, args.timeout)
        report.section("summary")
    if report.problems:
        report.line(f"{len(report.problems)} problem(s)")
        for p in report.problems:
            report.line(f"  {p}")
        return 1
    report.line("ok", "no problems found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
