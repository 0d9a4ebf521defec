"""Trust: after a fault, misuse or skew tpcomm raises; it never returns a
silent wrong answer, touches freed memory, or hangs.

Every body asserts that the custom path ran (comm.enabled, and stats() shows
tpcomm's kernels and no NCCL fallback), so a silent fallback cannot pass.
Skew: one rank, drawn at random (the same draw on every rank), sleeps on the
GPU before an op, and inputs are overwritten right after each op. Timings of
the error paths are printed as "TIMING ..." lines (run pytest with -s)."""
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from gpu_checks import (KERNELS, LINE, PACKET, KiB, MiB, all_reduce_algo, assert_bits_equal, assert_custom_only,
                        delay_random_rank, int_valued, nccl_all_gather, nccl_all_reduce, overwrite, rounds, sleep_us)

pytestmark = pytest.mark.gpu


def _timing(what, seconds):
    print(f"TIMING rank {dist.get_rank()}: {what}: {seconds:.3f} s", flush=True)


# ----------------------------------------------------------------------------
def body_stale_handle_and_replay_after_close(rank, world):
    comm = tpcomm.Communicator(timeout_s=5.0)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(3 + rank)
    xs = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in (512, 64 * KiB, 1 * MiB)]  # packet, packet, bulk
    g_in = torch.zeros(8, 256, dtype=torch.float16, device="cuda")
    rng = random.Random(2)  # the same draws on every rank
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        outs = []
        for x in xs:
            delay_random_rank(rank, world, rng)
            outs.append(comm.all_reduce(x))
        delay_random_rank(rank, world, rng)
        g_out = comm.all_gather(g_in, dim=1)
    assert_custom_only(comm)
    for x in xs:
        x.copy_(int_valued(x.numel(), x.dtype, gen))
    g_in.copy_(int_valued(g_in.numel(), g_in.dtype, gen).view(8, 256))
    kept, g_kept = [x.clone() for x in xs], g_in.clone()
    graph.replay()
    for x in xs + [g_in]:
        overwrite(x)  # right after the replay, on the stream
    for x, y in zip(kept, outs):
        assert_bits_equal(y, nccl_all_reduce(x), f"replay before close, {x.numel()} elements")
    assert_bits_equal(g_out, nccl_all_gather(g_kept, 1), "all_gather replay before close")

    stale = comm.comm_id
    comm.close()
    x = torch.ones(64, device="cuda")
    with pytest.raises(RuntimeError, match=f"comm_id {stale} is closed"):
        torch.ops._tpcomm.all_reduce(x, stale, PACKET)
    with pytest.raises(RuntimeError, match=f"comm_id {stale} is closed"):
        torch.ops._tpcomm.all_gather(x, 0, stale, PACKET)
    with pytest.raises(RuntimeError, match=f"comm_id {stale} is closed"):
        torch.ops._tpcomm.all_reduce_out(x, torch.empty_like(x), stale, PACKET)
    with pytest.raises(RuntimeError, match="unknown"):
        torch.ops._tpcomm.all_reduce(x, stale + 100000, PACKET)
    with pytest.raises(RuntimeError, match="comm_id 0 is unknown"):
        torch.ops._tpcomm.all_reduce(x, 0, PACKET)
    with pytest.raises(tpcomm.CommunicatorClosed, match="closed"):
        comm.all_reduce(x)
    comm.check()  # closed, but nothing ran after close yet

    fresh = tpcomm.Communicator(timeout_s=5.0)  # created between close and the stale replay
    assert fresh.enabled and fresh.comm_id not in (0, stale)
    for y in outs + [g_out]:
        y.zero_()
    graph.replay()  # its kernels find the slot dead: NaN out, nothing else touched
    torch.cuda.synchronize()
    for y in outs + [g_out]:
        assert torch.isnan(y).all(), "a graph replayed after close() must write NaN, not data"
    with pytest.raises(tpcomm.CommunicatorClosed, match="ran after it was closed"):
        comm.check()

    fresh.check()
    for n in (256, 48 * KiB, 3 * MiB // 2):
        v = int_valued(n, torch.bfloat16, gen)
        assert_bits_equal(fresh.all_reduce(v), nccl_all_reduce(v), f"fresh communicator, {n} elements")
    g = int_valued(8 * 256, torch.float16, gen).view(8, 256)
    assert_bits_equal(fresh.all_gather(g, dim=1), nccl_all_gather(g, 1), "fresh all_gather")
    assert_custom_only(fresh)
    fresh.close()


# ----------------------------------------------------------------------------
# (op, bf16 elements or gather shape, dim): packet and bulk sizes of both ops
SKEW_OPS = [("ar", 128), ("ar", 2048), ("ar", 24 * KiB), ("ar", 320 * KiB), ("ar", 1 * MiB), ("ar", 5 * MiB // 2 + 8),
            ("ag", (1, 1024), 0), ("ag", (48, 1024), 1), ("ag", (768, 1024), 0), ("ag", (6, 40), -1)]


def _run_op(comm, spec, x):
    return comm.all_reduce(x) if spec[0] == "ar" else comm.all_gather(x, dim=spec[2])


def _make_input(spec, gen):
    if spec[0] == "ar":
        return int_valued(spec[1], torch.bfloat16, gen)
    rows, cols = spec[1]
    return int_valued(rows * cols, torch.bfloat16, gen).view(rows, cols)


def _reference(spec, x):
    return nccl_all_reduce(x) if spec[0] == "ar" else nccl_all_gather(x, spec[2])


def body_skew(rank, world):
    """>= 2,000 mixed ops, eager and graph replays, a random rank 0-60 us late
    before each, inputs overwritten right after: every result bitwise equal
    to NCCL's."""
    comm = tpcomm.Communicator(timeout_s=10.0)
    assert comm.enabled, comm.disabled_reason
    rng = random.Random(77)  # the same draws on every rank
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    checked = 0
    for batch in range(40):  # eager: 40 x 40 ops
        pending = []
        for _ in range(40):
            spec = rng.choice(SKEW_OPS)
            x = _make_input(spec, gen)
            kept = x.clone()
            delay_random_rank(rank, world, rng)
            y = _run_op(comm, spec, x)
            overwrite(x)  # right after the op, on the stream
            pending.append((spec, kept, y))
        for i, (spec, kept, y) in enumerate(pending):
            assert_bits_equal(y, _reference(spec, kept), f"eager batch {batch} op {i} {spec}")
            checked += 1
    # graph: 20 ops with their skew captured, replayed 25 times with new inputs
    specs = [rng.choice(SKEW_OPS) for _ in range(20)]
    delays = [(rng.randrange(world), rng.uniform(0, 60)) for _ in specs]
    static_in = [torch.zeros_like(_make_input(s, gen)) for s in specs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        static_out = []
        for spec, x, (who, us) in zip(specs, static_in, delays):
            if who == rank:
                sleep_us(us)
            static_out.append(_run_op(comm, spec, x))
    for replay in range(25):
        kept = []
        for spec, x in zip(specs, static_in):
            x.copy_(_make_input(spec, gen))
            kept.append(x.clone())
        graph.replay()
        for x in static_in:
            overwrite(x)  # right after the replay, on the stream
        if replay % 5 == 0:  # eager ops between replays share the device epoch
            spec = rng.choice(SKEW_OPS)
            e = _make_input(spec, gen)
            assert_bits_equal(_run_op(comm, spec, e), _reference(spec, e), f"eager between replays {replay}")
            checked += 1
        for i, (spec, k, y) in enumerate(zip(specs, kept, static_out)):
            assert_bits_equal(y, _reference(spec, k), f"replay {replay} op {i} {spec}")
            checked += 1
    assert checked >= 2000, checked
    comm.check()
    assert_custom_only(comm)
    comm.close()


# ----------------------------------------------------------------------------
def body_epoch_wrap(rank, world):
    """The device epoch seeded just below 2^32: ops run across the wrap, and
    the flags that ops 1-3 left in the packet slots (epochs 2 and 3 come back
    after the wrap) are never taken for fresh data, even when the peer is late,
    by the packet kernels or the line kernels, whose flags sit elsewhere."""
    comm = tpcomm.Communicator(timeout_s=5.0)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(300 + rank)
    packet, line = PACKET, LINE
    big = 256 * KiB  # bf16 elements: 512 KiB of packets per peer

    def run(n, late=None, gather=False, algo=packet):
        x = int_valued(n, torch.bfloat16, gen)
        kept = x.clone()
        if late == rank:
            sleep_us(300)  # the peer reads its slots before this rank's packets land
        if gather:
            y = torch.ops._tpcomm.all_gather(x, 0, comm.comm_id, algo)
        else:
            y = torch.ops._tpcomm.all_reduce(x, comm.comm_id, algo)
        overwrite(x)  # right after the op, on the stream
        return ("ag" if gather else "ar", kept, y)

    def verify(done, what):
        for i, (kind, x, y) in enumerate(done):
            ref = nccl_all_reduce(x) if kind == "ar" else nccl_all_gather(x, 0)
            assert_bits_equal(y, ref, f"{what} op {i}")

    verify([run(big) for _ in range(3)], "epochs 1-3")  # flags 1, 2, 3 across 512 KiB
    assert comm._lib.tpc_comm_debug_set_epoch(comm._comm, 2**32 - 16) == tpcomm._lib.OK
    dist.barrier()  # every rank seeded before any runs the next op
    done = [run(64) for _ in range(14)]        # epochs 2^32-15 .. 2^32-2
    done.append(run(64, gather=True))          # epoch 2^32-1: clears every flag
    done += [run(big, late=i % world, gather=i % 3 == 2, algo=line if i % 2 else packet)
             for i in range(8)]  # epochs 2..9: flags reused
    verify(done, "across the wrap")
    x = int_valued(3 * MiB // 2, torch.bfloat16, gen)
    assert_bits_equal(torch.ops._tpcomm.all_reduce(x, comm.comm_id, all_reduce_algo(comm, "bulk")), nccl_all_reduce(x),
                      "bulk after the wrap")
    comm.check()
    comm.close()


# ----------------------------------------------------------------------------
SOAK_AR = [64, 512, 4 * KiB, 24 * KiB, 160 * KiB, 640 * KiB]        # bf16 elements, the last one bulk
SOAK_AG = [(1, 256), (16, 512), (300, 1024)]                          # the last one bulk (600 KiB per rank)


# A table that sends the soak's and the chain's middle sizes (8 KiB to 600 KiB
# a rank) to the kernels of 128-byte lines, all_reduce from 64 KiB to the
# two-phase one, so that they mix with packet and bulk ops whatever the
# shipped table routes.
LINE_TABLE = {"routes": {
    "all_reduce": {"*": {"*": [[1 * KiB, "packet"], [64 * KiB, "line"], [1 * MiB, "two_shot"], [16 * MiB, "bulk"]]}},
    "all_gather": {"*": {"*": [[1 * KiB, "packet"], [1 * MiB, "line"], [16 * MiB, "bulk"]]}}}}
LINE_KERNELS = ("packet", "line", "two_shot", "bulk")


def body_soak(rank, world):
    _soak(rank, world, None, ("packet", "bulk"))


def body_soak_line(rank, world):
    _soak(rank, world, LINE_TABLE, LINE_KERNELS)


def _soak(rank, world, table, want):
    """100,000 mixed ops (a tenth where ranks share a GPU: rounds()) with
    skew, inside CUDA graphs: each op's input is
    computed on the GPU from a replay counter (so it changes every replay),
    compared in the graph with an exact reference every rank computes for
    itself, and overwritten right after the op. The mismatch count must be 0."""
    comm = tpcomm.Communicator(timeout_s=10.0, table=table)
    assert comm.enabled, comm.disabled_reason
    rng = random.Random(4242)
    counter = torch.zeros((), dtype=torch.int64, device="cuda")
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    ops_per_graph, replays_per_graph = 50, rounds(1000, world)
    graphs = []
    static = []  # keeps every tensor the graphs use alive
    for g in range(2):  # two graphs with different skew patterns, alternated
        slots = []
        for i in range(ops_per_graph):
            kind = rng.choice(["ar", "ar", "ag"])
            shape = (rng.choice(SOAK_AR),) if kind == "ar" else rng.choice(SOAK_AG)
            cpu = torch.Generator().manual_seed(1000 * g + i)
            bases = [torch.randint(0, 17, shape, generator=cpu).cuda() for _ in range(world)]
            steps = [rng.randrange(1, 17) for _ in range(world)]
            slots.append((kind, shape, bases, steps, rng.randrange(world), rng.uniform(0, 60)))
        static.append(slots)  # the graph reads the bases on every replay: they must outlive the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with comm.capture(), torch.cuda.graph(graph):
            counter.add_(1)
            for kind, shape, bases, steps, who, us in slots:
                vals = [(b + counter * s) % 17 - 8 for b, s in zip(bases, steps)]  # int64, exact
                x = vals[rank].to(torch.bfloat16)
                if who == rank:
                    sleep_us(us)
                if kind == "ar":
                    y = comm.all_reduce(x)
                    ref = torch.stack(vals).sum(0).to(torch.bfloat16)
                else:
                    y = comm.all_gather(x, dim=0)
                    ref = torch.cat(vals, 0).to(torch.bfloat16)
                overwrite(x)  # right after the op, on the stream
                mismatches.add_((y.view(torch.int16) != ref.view(torch.int16)).sum())
                static.append((x, y, ref))
        graphs.append(graph)
    start = time.monotonic()
    for r in range(replays_per_graph):
        for graph in graphs:
            graph.replay()
        if r % 100 == 99:
            comm.check()
    torch.cuda.synchronize()
    _timing(f"soak of {2 * ops_per_graph * replays_per_graph} ops", time.monotonic() - start)
    assert int(counter) == 2 * replays_per_graph
    assert int(mismatches) == 0, f"{int(mismatches)} elements differ from the exact reference"
    comm.check()
    assert_custom_only(comm, want)
    comm.close()


# ----------------------------------------------------------------------------
CHAIN_SIZES = [8, 1024, 12 * KiB, 96 * KiB, 1 * MiB]  # bf16 elements: one block, more blocks, bulk


def body_back_to_back_chain(rank, world):
    _chain(rank, world, None, ("packet", "bulk"))


def body_back_to_back_chain_line(rank, world):
    """The same through the line kernels, whose readers poll while the lines
    land (a reader that took a line's data from the load that found its flag
    would pass stale data down this chain)."""
    _chain(rank, world, LINE_TABLE, LINE_KERNELS)


def _chain(rank, world, table, want):
    """tpcomm kernels with nothing between them: each op's input is the
    previous op's output, so a kernel launched early (programmatic dependent
    launch) reads its epoch while the kernel before it still runs. Five chains of
    different sizes and kernels are interleaved for 40 steps inside one graph,
    replayed 200 times (a tenth where ranks share a GPU: rounds()) with inputs
    that change every replay; after k steps a
    chain holds the sum of the inputs multiplied by world k-1 times, each
    product rounded to bf16 as the kernels round their fp32 sums. One stale
    epoch would pair an op with the previous op's packets. A random rank is
    late once, before the chain; no delay and no overwrite sits between the
    ops (either would put a kernel between them)."""
    comm = tpcomm.Communicator(timeout_s=10.0, table=table)
    assert comm.enabled, comm.disabled_reason
    counter = torch.zeros((), dtype=torch.int64, device="cuda")
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    steps = 40
    bases = [[torch.randint(0, 17, (n,), generator=torch.Generator().manual_seed(7 * n + r)).cuda()
              for r in range(world)] for n in CHAIN_SIZES]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        counter.add_(1)
        vals = [[(b + counter * (r + 1)) % 17 - 8 for r, b in enumerate(bs)] for bs in bases]
        ys = [v[rank].to(torch.bfloat16) for v in vals]
        delay_random_rank(rank, world, random.Random(12))
        for _ in range(steps):
            ys = [comm.all_reduce(y) for y in ys]
        for v, y in zip(vals, ys):
            # step by step: world^(steps-1) overflows int64 beyond 2 ranks (4^39 = 2^78)
            ref = torch.stack(v).sum(0).to(torch.bfloat16)
            for _ in range(steps - 1):
                ref = (ref.float() * world).to(torch.bfloat16)
            mismatches.add_((y.view(torch.int16) != ref.view(torch.int16)).sum())
    replays = rounds(200, world)
    start = time.monotonic()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    _timing(f"back-to-back chain of {replays * steps * len(CHAIN_SIZES)} ops", time.monotonic() - start)
    assert int(counter) == replays
    assert int(mismatches) == 0, f"{int(mismatches)} elements differ from the exact reference"
    comm.check()
    assert_custom_only(comm, want)
    comm.close()


# ----------------------------------------------------------------------------
def body_timeout_queue_and_late_peer(rank, world):
    """Rank 0 issues an op and 10 more behind it; the others are absent. All 11
    fail within timeout + 2 s in total (NaN outputs, CollectiveTimeout). Then
    the late ranks run the op rank 0 gave up: they raise too, and return NaN,
    never a result rank 0 does not have."""
    timeout = 1.0
    comm = tpcomm.Communicator(timeout_s=timeout)
    assert comm.enabled, comm.disabled_reason
    xs = [torch.ones(n, dtype=torch.bfloat16, device="cuda") for n in (256, 4 * KiB, 400 * KiB, 2 * MiB)]
    assert all(comm.route_all_reduce(x) in KERNELS for x in xs) and comm.route_all_gather(xs[1]) in KERNELS
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        outs = [comm.all_reduce(xs[i % len(xs)]) for i in range(11)]
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
        _timing("timeout with 10 ops queued behind it", elapsed)
        assert elapsed < timeout + 2.0, f"11 failing ops took {elapsed:.2f} s"
        for i, y in enumerate(outs):
            assert torch.isnan(y).all(), f"op {i} after the timeout returned data"
        with pytest.raises(tpcomm.CollectiveTimeout, match=r"did not arrive within 1\.000 s"):
            comm.check()
        start = time.monotonic()
        with pytest.raises(tpcomm.CollectiveTimeout):
            comm.all_reduce(xs[0])  # refused at the call, at once
        assert time.monotonic() - start < 0.5
    dist.barrier()  # the others wait here until rank 0 gave up
    if rank != 0:
        y = comm.all_reduce(xs[0])  # the op rank 0 gave up
        torch.cuda.synchronize()
        assert torch.isnan(y).all(), "a late rank returned data its peer gave up on"
        with pytest.raises(tpcomm.CollectiveTimeout, match="peer 0 gave up"):
            comm.check()
        with pytest.raises(tpcomm.CollectiveTimeout):
            comm.all_gather(xs[1])
    dist.barrier()
    start = time.monotonic()
    comm.close()
    _timing("close after a timeout", time.monotonic() - start)


# ----------------------------------------------------------------------------
def body_sigkill(rank, world):
    """Rank 1 is killed with SIGKILL in the middle of a run: the survivor
    raises CollectiveTimeout within timeout + 5 s, and abort() returns within
    5 s. Runs on a gloo group, so no NCCL communicator waits for the dead rank."""
    timeout = 2.0
    comm = tpcomm.Communicator(timeout_s=timeout)
    assert comm.enabled, comm.disabled_reason
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    big = torch.ones(1 * MiB, dtype=torch.bfloat16, device="cuda")
    assert comm.route_all_reduce(x) in KERNELS and comm.route_all_reduce(big) in KERNELS
    for i in range(200):
        if rank == 1 and i == 100:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            y = comm.all_reduce(x if i % 2 else big)
            torch.cuda.synchronize()
            comm.check()
        except tpcomm.CollectiveTimeout as e:
            waited = time.monotonic() - start
            _timing("survivor's CollectiveTimeout after the peer's SIGKILL", waited)
            assert i == 100, f"op {i} failed: {e}"
            assert waited < timeout + 5.0, waited
            assert "peer 1" in str(e), str(e)
            break
        assert torch.equal(y, torch.full_like(y, world)), f"op {i}"
    else:
        raise AssertionError("the survivor never noticed the dead peer")
    start = time.monotonic()
    comm.abort()
    took = time.monotonic() - start
    _timing("abort() after the peer died", took)
    assert took < 5.0, took
    with pytest.raises(tpcomm.CommunicatorClosed):
        comm.all_reduce(x)
    torch.cuda.synchronize()
    os._exit(0)  # the gloo group's teardown would wait for the dead rank


# ----------------------------------------------------------------------------
def body_misaligned_one_rank(rank, world):
    """A view at an odd offset on rank 0 only: every rank takes the same route
    (the custom kernel), and the answers equal NCCL's bit for bit."""
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(500 + rank)
    rng = random.Random(13)  # the same draws on every rank
    for dtype, offset in ((torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 1), (torch.float16, 5),
                          (torch.bfloat16, 7)):
        for n in (4096, 600 * KiB):  # packet and bulk
            data = int_valued(n, dtype, gen)
            ref = nccl_all_reduce(data)

            def view(odd):
                base = torch.empty(n + 16, dtype=dtype, device="cuda")
                t = base[offset:offset + n] if odd else base[:n]
                return t.copy_(data)

            x = view(rank == 0)
            route = comm.route_all_reduce(x)
            routes = [None] * world
            dist.all_gather_object(routes, route)
            assert len(set(routes)) == 1 and route in KERNELS, routes
            delay_random_rank(rank, world, rng)
            y = comm.all_reduce(x)
            overwrite(x)  # right after the op, on the stream
            assert_bits_equal(y, ref, f"{dtype} {n} input misaligned on rank 0")
            x, out = view(rank == 0), view(rank == world - 1)
            delay_random_rank(rank, world, rng)
            assert comm.all_reduce(x, out=out) is out
            overwrite(x)
            assert_bits_equal(out, ref, f"{dtype} {n} out= misaligned on rank {world - 1}")
            z = view(rank == 0)
            delay_random_rank(rank, world, rng)
            comm.all_reduce(z, out=z)
            assert_bits_equal(z, ref, f"{dtype} {n} in place, misaligned on rank 0")
            # each rank gives at most max_bytes / world, so the output fits the
            # custom path at every world size (600 Ki fp32 at 8 ranks would not)
            m = min(n, comm.max_bytes // (world * data.element_size()) // 64 * 64)
            for dim in (0, 1):
                g = view(rank == 0)[:m].view(-1, 64)
                assert comm.route_all_gather(g, dim) in KERNELS, (dtype, m, dim)
                delay_random_rank(rank, world, rng)
                y = comm.all_gather(g, dim=dim)
                overwrite(g)
                assert_bits_equal(y, nccl_all_gather(data[:m].view(-1, 64), dim),
                                  f"{dtype} {n} all_gather dim {dim}, misaligned on rank 0")
    assert_custom_only(comm)
    comm.close()


# ----------------------------------------------------------------------------
def body_groups_in_different_orders(rank, world):
    """Four processes on two GPUs: TP groups {0,1} and {2,3}, and a group
    {0,3} across them. Ranks 0 and 3 create the cross-group communicator
    first; 1 and 2 never do. Every communicator keeps the custom path
    (creation numbers are counted per group, not per process)."""
    groups = {"a": dist.new_group([0, 1]), "b": dist.new_group([2, 3]), "c": dist.new_group([0, 3])}
    order = {0: "ca", 1: "a", 2: "b", 3: "cb"}[rank]
    device = torch.device("cuda", rank % 2)
    comms = [(name, tpcomm.Communicator(groups[name], device=device)) for name in order]
    members = {"a": [0, 1], "b": [2, 3], "c": [0, 3]}
    for name, comm in comms:
        assert comm.enabled, f"group {name}: {comm.disabled_reason}"
        for seed in range(5):
            mine = torch.Generator().manual_seed(seed * 10 + rank)
            x = torch.randint(-8, 9, (4096,), generator=mine).to(torch.bfloat16)
            expected = sum(torch.randint(-8, 9, (4096,), generator=torch.Generator().manual_seed(seed * 10 + r))
                           for r in members[name]).to(torch.bfloat16)
            y = comm.all_reduce(x.to(device))
            assert torch.equal(y.cpu(), expected), f"group {name} seed {seed}"
        assert_custom_only(comm, want=("packet",))
    for _, comm in comms:
        comm.close()


@pytest.mark.parametrize("body", [body_stale_handle_and_replay_after_close, body_skew, body_epoch_wrap, body_soak,
                                  body_soak_line, body_back_to_back_chain, body_back_to_back_chain_line,
                                  body_timeout_queue_and_late_peer, body_misaligned_one_rank],
                         ids=lambda f: f.__name__[5:])
def test_trust(body):
    multiproc.run_gpu(body, timeout=300)


def test_sigkill_survivor_raises_and_aborts():
    multiproc.run_gpu(body_sigkill, world=2, backend="gloo", expect_killed={1}, timeout=120)


def test_groups_created_in_different_orders():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    multiproc.run_gpu(body_groups_in_different_orders, world=4, devices=[0, 1, 0, 1], backend="gloo", timeout=120)
