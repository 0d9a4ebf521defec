"""The doctor's self-test: each collective run by tpcomm and by
torch.distributed on the same inputs over spawned ranks, compared bit for
bit, with the latency of each; the fused add + RMSNorm held to 0 ulp on its
residual output and 1 ulp on the normed output."""
import json
import os

from .report import size_text

# Per-rank input sizes of the self-test: one in each band of the shipped
# table (packet, line, bulk kernels).
SELF_TEST_BYTES = (8 * 1024, 512 * 1024, 4 * 1024 * 1024)
NORM_SHAPE = (16, 4096)  # tokens x hidden of the fused add + RMSNorm case
NORM_EPS = 1e-6


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
    from .. import _ranks

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

    from .. import topology

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
    from .. import _testing

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

    from ..reference import reference_add_rms_norm, ulp_distance

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


def run_self_test(report, count, share_gpu, world, iters, timeout_s, on_cpu=False, sizes=SELF_TEST_BYTES):
    """The self-test over `world` spawned ranks (on_cpu: ranks on the CPU over
    gloo, for tpcomm's own tests of this code on a machine without GPUs)."""
    from .. import _ranks

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
        procs = _ranks.start(world, _self_test_rank, init_method, devices, backend, share_gpu, iters, sizes, out_dir)
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
    name = row["op"] + (f" {size_text(row['bytes'])}/rank" if "bytes" in row else "")
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
