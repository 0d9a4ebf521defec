"""What the GPU suites share: exact inputs, NCCL references, bit-for-bit
comparison, the proof that tpcomm's own kernels ran, a random rank made late,
the kernels' algorithm numbers, and sizes valid at any world size 2..8.
A helper module, not a test module."""
import contextlib
import random

import torch
import torch.distributed as dist

import multiproc
from bitexact import assert_bits_equal
from tpcomm import _constants, routing

KiB, MiB = 1024, 1024 * 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CYCLES_PER_US = 1980  # torch.cuda._sleep counts SM cycles; an H200 runs at about 1.98 GHz


# The internal ops' `algo` argument for each kernel, from the C header
# (tpcomm._constants is generated from csrc/tpcomm.h).
ALGO = {"packet": _constants.TPC_ALGO_PACKET, "bulk": _constants.TPC_ALGO_BULK, "line": _constants.TPC_ALGO_LINE,
        "two_shot": _constants.TPC_ALGO_TWO_SHOT}
PACKET, BULK, LINE, TWO_SHOT = ALGO["packet"], ALGO["bulk"], ALGO["line"], ALGO["two_shot"]
KERNELS = tuple(ALGO)  # tpcomm's own kernels: the backends routes and stats() name besides the fallback and "aiter"


def rounds(full, world):
    """How many replays a long run makes: `full` with a GPU per rank, a tenth
    where ranks share a GPU. There the ranks' processes take turns on it, so
    every wait for a peer costs a time slice and the full count takes tens of
    minutes at 8 ranks; a tenth still checks every op's result at that world
    size (the early-launch overlaps these runs probe need a GPU per rank)."""
    return max(1, full // 10) if multiproc.gpus_shared(world) else full


@contextlib.contextmanager
def no_compile_caches(**inductor):
    """torch.compile without its on-disk caches (inductor's FX graph cache,
    AOTAutograd's), with `inductor` as further inductor config patches: a
    graph an earlier run left on this machine's disk would skip the passes a
    test counts, and the caches key a graph without the world size of the
    group its tpcomm ops name (docs/design.md, Limits). Compilation happens
    at the first call, so that call goes inside."""
    with torch._inductor.config.patch(fx_graph_cache=False, **inductor), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def all_reduce_algo(comm, kernel):
    """The internal all_reduce op's `algo` for kernel `kernel` ("bulk":
    the one-shot at two ranks, the streamed two-shot from three on, as
    routing picks it)."""
    caps = routing.Caps(comm.world_size, comm.max_bytes, comm.packet_max_bytes, comm.platform)
    return routing.algo_code("all_reduce", kernel, caps)


def takes(comm, op, algo, x):
    """Whether tpcomm's kernel `algo` can run op on x (a dim-0 all_gather):
    tpcomm.routing's rules for the communicator's caps."""
    caps = routing.Caps(comm.world_size, comm.max_bytes, comm.packet_max_bytes, comm.platform)
    nbytes = x.numel() * x.element_size()
    return routing.refusal(op, algo, caps, x.dtype, nbytes, nbytes) is None


# ------------------------------------------------------------------ inputs
def int_valued(numel, dtype, gen):
    """Integers in [-8, 8]: every sum over up to 8 ranks is exact in any
    order, in every dtype the kernels reduce."""
    return torch.randint(-8, 9, (numel,), generator=gen, device="cuda").to(dtype)


def chunk_numel(world, dtype, part_bytes):
    """Elements of an input whose `world` equal parts are part_bytes each
    (part_bytes a multiple of 16: what the reduce-scatter kernels need of a
    part, whatever the world size)."""
    assert part_bytes % 16 == 0 and part_bytes % dtype.itemsize == 0, part_bytes
    return world * part_bytes // dtype.itemsize


def round16(nbytes):
    """nbytes rounded down to a multiple of 16, at least 16."""
    return max(16, nbytes // 16 * 16)


def overwrite(x):
    """Overwrites x in place, on the current stream (an op that still read
    its input after it returned on the stream would see this): NaN in the
    reduced float dtypes, every bit flipped in any other."""
    if x.dtype in DTYPES:
        x.fill_(float("nan"))
    else:
        x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).bitwise_not_()


# -------------------------------------------------------------- references
def nccl_all_reduce(x):
    y = x.clone()
    dist.all_reduce(y)
    return y


def nccl_all_gather(x, dim=0):
    parts = [torch.empty_like(x.contiguous()) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def nccl_reduce_scatter(x, dim=0):
    world = dist.get_world_size()
    parts = x.movedim(dim, 0).contiguous()
    out = torch.empty((parts.shape[0] // world,) + tuple(parts.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, parts)
    return out.movedim(0, dim).contiguous()


def same_on_all_ranks(t, what):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    for r, g in enumerate(gathered):
        assert_bits_equal(g, gathered[0], f"{what}: rank {r} differs from rank 0")


# ------------------------------------------------------------------- skew
def sleep_us(us):
    if us > 0:
        torch.cuda._sleep(int(us * CYCLES_PER_US))


def delay_random_rank(rank, world, rng, max_us=60):
    """Delays one rank, drawn from `rng` (seeded alike on every rank, so every
    rank draws the same), by 0..max_us on the GPU before the next op."""
    who, us = rng.randrange(world), rng.uniform(0, max_us)
    if who == rank:
        sleep_us(us)
    return who


def shared_rng(seed):
    """A random.Random with the same draws on every rank."""
    return random.Random(seed)


# -------------------------------------------------- the custom path ran
def stats_label(comm, backend):
    """The backend as stats() and the route_* methods name it: "nccl", a
    test's name for the fallback, is the group's torch.distributed backend,
    gloo where ranks share a GPU (tests/multiproc.py)."""
    return comm._nccl.backend if backend == "nccl" else backend


class Calls:
    """comm.stats() counted from the moment it is made: `ran(op, backend)`
    is how many calls of op went to backend since (a backend or route name:
    "nccl" is the fallback, whatever the group runs it on)."""

    def __init__(self, comm):
        self.comm, self.before = comm, comm.stats()

    def ran(self, op, backend):
        backend = stats_label(self.comm, backend)
        now = self.comm.stats().get((op, backend), {"calls": 0})["calls"]
        return now - self.before.get((op, backend), {"calls": 0})["calls"]

    def expect(self, op, backend, calls=1):
        """Exactly `calls` calls of op on backend since the last reset, then resets."""
        got = self.ran(op, backend)
        assert got == calls, f"{op}: {got} calls on {backend}, expected {calls}: {self.comm.stats()}"
        self.before = self.comm.stats()


def assert_custom_only(comm, want=("packet", "bulk")):
    """comm is enabled, no op fell back to NCCL, and each kernel in `want` ran."""
    stats = comm.stats()
    backends = {b for _, b in stats}
    assert comm.enabled, comm.disabled_reason
    assert stats_label(comm, "nccl") not in backends, f"an op fell back to torch.distributed: {stats}"
    assert set(want) <= backends, f"expected {want} to run: {stats}"


def kernel_calls(comm, op):
    """Calls of op on tpcomm's kernels so far."""
    return sum(s["calls"] for (o, b), s in comm.stats().items() if o == op and b in KERNELS)
