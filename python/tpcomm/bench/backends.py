"""The backends tpcomm.bench measures and the resources they share.

make_case(backend, op, x0, res) gives a Case: prepare() puts the input x0
where the op reads it (the symmetric buffers, or a copy for the in-place
ops), call() runs the op once and returns its result. A backend that cannot
run the case raises Unavailable with the reason.

Resources sets up, collectively and once per process, what the backends
need; a backend whose set-up fails on any rank is off on every rank, with the
reason (every step that could fail on one rank only is followed by an
exchange of verdicts, so that no rank waits in a collective the others
skipped):

* tpcomm, tpcomm_packet, tpcomm_bulk: one tpcomm.Communicator whose
  max_bytes covers the largest all-gather output (world * largest size).
* nccl_window: NCCL's symmetric kernels. torch 2.11 exposes NCCL windows
  through ProcessGroupNCCL (torch/_C/_distributed_c10d: register_mem_pool(
  pool, symm: bool = False), whose C++ side, ProcessGroupNCCL::registerMemPool
  in torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp, calls
  NCCLComm::registerSegment(..., window=symm), i.e. ncclCommWindowRegister
  with NCCL_WIN_COLL_SYMMETRIC). One buffer is allocated from a
  torch.cuda.MemPool on the backend's mem_allocator (ncclMemAlloc), then the
  pool is registered with symm=True; every case uses views at the same offsets
  on every rank (input at 0, all-gather output after the input region), and
  runs dist.all_reduce / dist.all_gather_into_tensor on them.
* nccl_nomix, nccl_window_nomix: the same calls as nccl and nccl_window, in
  processes whose NCCL was started with NCCL_GRAPH_MIXING_SUPPORT=0 (NCCL's
  fastest setting under CUDA graphs, read once per process): python -m
  tpcomm.bench runs them in a second set of processes, graph mode only, and
  merges their rows (measure.py, --merge-from). In any other process they
  are off, with that reason.
* symm_one_shot, symm_two_shot: torch.distributed._symmetric_memory with the
  "CUDA" backend (peer-to-peer over NVLink, never multicast:
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1): one symm_mem.empty buffer, one
  symm_mem.rendezvous on the world group, then
  torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name) (returns a
  new tensor) and torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum",
  group_name) (in place) on views at offset 0. All-reduce only.
"""
import torch
import torch.distributed as dist

from .report import human_bytes

TPCOMM_BACKENDS = ("tpcomm", "tpcomm_packet", "tpcomm_bulk")
NOMIX_BACKENDS = ("nccl_nomix", "nccl_window_nomix")


def graph_mixing_off():
    """NCCL in this process was told graphs and eager calls do not mix."""
    import os

    return os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0"
SYMM_BACKENDS = ("symm_one_shot", "symm_two_shot")


class Unavailable(Exception):
    """A backend cannot run this case; the message says why."""


def describe(e, limit=400):
    """One line for an exception: type and the first line of its message."""
    text = str(e).strip().splitlines()
    msg = text[0] if text else ""
    msg = f"{type(e).__name__}: {msg}" if not isinstance(e, Unavailable) else msg
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def agree(reason, world):
    """Collective: every rank gets every rank's verdict. Returns None when no
    rank has a reason, else the reason (naming the ranks when they differ)."""
    out = [None] * world
    dist.all_gather_object(out, reason)
    msgs = [(r, m) for r, m in enumerate(out) if m]
    if not msgs:
        return None
    if len(msgs) == world and len({m for _, m in msgs}) == 1:
        return msgs[0][1]
    return "; ".join(f"rank {r}: {m}" for r, m in msgs)


def _round_up(n, k):
    return (int(n) + k - 1) // k * k


class Case:
    def __init__(self, call, prepare=None):
        self.call = call
        self._prepare = prepare

    def prepare(self):
        if self._prepare is not None:
            self._prepare()


class Resources:
    """What the backends share in one process; construction is collective."""

    def __init__(self, rank, world, device, max_bytes, backends, log=print):
        self.rank, self.world, self.device = rank, world, device
        self.group = dist.group.WORLD
        self.max_bytes = int(max_bytes)
        self.log = log
        self.reasons = {}  # backend -> why it cannot run at all
        self.info = {}     # notes for the results' env
        self.comm = None
        self._window = None  # (backend, pool, buf, in_bytes) once registered
        self._window_leak = None
        self._symm_buf = None
        self._symm_handle = None
        self.symm_group_name = None
        wanted = set(backends)
        for b in wanted & set(NOMIX_BACKENDS):
            if not graph_mixing_off():
                self.reasons[b] = ("needs processes started with NCCL_GRAPH_MIXING_SUPPORT=0 (python -m tpcomm.bench "
                                   "runs them so; under torchrun, set it and ask for these backends alone)")
        if wanted & set(TPCOMM_BACKENDS):
            self._setup_tpcomm()
        if "nccl_window" in wanted or ("nccl_window_nomix" in wanted and graph_mixing_off()):
            self._setup_window()
        if wanted & set(SYMM_BACKENDS):
            self._setup_symm()

    # ----------------------------------------------------------------- tpcomm
    def _setup_tpcomm(self):
        reason = None
        cap = _round_up(max(16 << 20, self.max_bytes * self.world), 16)
        try:
            import tpcomm

            self.comm = tpcomm.Communicator(max_bytes=cap)
            if not self.comm.enabled:
                reason = f"custom path disabled: {self.comm.disabled_reason}"
        except Exception as e:  # noqa: BLE001 - a reason, never a crash
            reason = f"tpcomm.Communicator failed: {describe(e)}"
        reason = agree(reason, self.world)
        self.info["tpcomm_max_bytes"] = cap
        if reason:
            self.tpcomm_broken(reason)

    def tpcomm_broken(self, reason):
        for b in TPCOMM_BACKENDS:
            self.reasons[b] = reason

    # ------------------------------------------------------------ nccl_window
    def _setup_window(self):
        in_bytes = _round_up(self.max_bytes, 1 << 16)
        out_bytes = _round_up(self.max_bytes * self.world, 1 << 16)
        reason, backend, pool, buf = None, None, None, None
        try:
            backend = self.group._get_backend(self.device)
            if not hasattr(backend, "register_mem_pool"):
                raise Unavailable(f"{type(backend).__name__} has no register_mem_pool (not ProcessGroupNCCL)")
            allocator = backend.mem_allocator
            if allocator is None:
                raise Unavailable("ProcessGroupNCCL.mem_allocator is None (no ncclMemAlloc)")
            pool = torch.cuda.MemPool(allocator)
            with torch.cuda.use_mem_pool(pool):
                buf = torch.empty(in_bytes + out_bytes, dtype=torch.uint8, device=self.device)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001
            reason = f"NCCL window buffer: {describe(e)}"
        reason = agree(reason, self.world)
        if reason:
            self._window_off(reason)
            return
        try:
            backend.register_mem_pool(pool, symm=True)  # collective: ncclCommWindowRegister
            torch.cuda.synchronize(self.device)
        except TypeError as e:
            reason = f"this torch's register_mem_pool takes no symm argument: {describe(e)}"
        except Exception as e:  # noqa: BLE001
            reason = f"register_mem_pool(pool, symm=True): {describe(e)}"
        local = reason
        reason = agree(reason, self.world)
        if reason:
            self._window_off(reason)
            if local is None:  # registered here but not everywhere: keep the memory alive, unused
                self._window_leak = (backend, pool, buf)
            return
        self._window = (backend, pool, buf, in_bytes)
        self.info["nccl_window"] = (f"{human_bytes(in_bytes + out_bytes)} from torch.cuda.MemPool(ProcessGroupNCCL."
                                    f"mem_allocator), ProcessGroupNCCL.register_mem_pool(pool, symm=True)")

    def _window_off(self, reason):
        for b in ("nccl_window", "nccl_window_nomix"):
            self.reasons.setdefault(b, reason)

    def window_view(self, offset_kind, dtype, numel):
        backend, pool, buf, in_bytes = self._window
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * itemsize
        off = 0 if offset_kind == "in" else in_bytes
        limit = in_bytes if offset_kind == "in" else buf.numel() - in_bytes
        if nbytes > limit:
            raise Unavailable(f"{human_bytes(nbytes)} is over the window's {human_bytes(limit)}")
        return buf[off:off + nbytes].view(dtype)

    # ------------------------------------------------------------------- symm
    def _setup_symm(self):
        reason, buf = None, None
        nbytes = _round_up(self.max_bytes, 1 << 16)
        try:
            import torch.distributed._symmetric_memory as symm_mem

            for name in ("one_shot_all_reduce", "two_shot_all_reduce_"):
                getattr(torch.ops.symm_mem, name)  # raises when this torch lacks the op
            try:
                symm_mem.set_backend("CUDA")
            except Exception as e:  # noqa: BLE001 - keep torch's default backend
                self.info["symm_mem_set_backend"] = f"set_backend('CUDA') failed: {describe(e)}"
            self.symm_group_name = self.group.group_name
            buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
            buf.zero_()
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001
            reason = f"symmetric memory buffer: {describe(e)}"
        reason = agree(reason, self.world)
        if not reason:
            try:
                self._symm_handle = symm_mem.rendezvous(buf, self.symm_group_name)  # collective
                torch.cuda.synchronize(self.device)
            except Exception as e:  # noqa: BLE001
                reason = f"symm_mem.rendezvous: {describe(e)}"
            reason = agree(reason, self.world)
        if reason:
            for b in SYMM_BACKENDS:
                self.reasons[b] = reason
            self._symm_keep = buf
            return
        self._symm_buf = buf
        try:
            self.info["symm_mem_backend"] = str(symm_mem.get_backend(self.device))
        except Exception as e:  # noqa: BLE001
            self.info["symm_mem_backend"] = f"unknown ({describe(e)})"

    def symm_view(self, dtype, numel):
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * itemsize
        if nbytes > self._symm_buf.numel():
            raise Unavailable(f"{human_bytes(nbytes)} is over the symmetric buffer's "
                              f"{human_bytes(self._symm_buf.numel())}")
        return self._symm_buf[:nbytes].view(dtype)

    # ------------------------------------------------------------------ close
    def close(self):
        """Collective: frees what was set up (never raises)."""
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001
            pass
        if self._window is not None:
            backend, pool, buf, _ = self._window
            self._window = None
            try:
                dist.barrier()
                backend.deregister_mem_pool(pool)
                del buf
                del pool
            except Exception as e:  # noqa: BLE001
                self.log(f"note: deregistering the NCCL window failed: {describe(e)}")
        if self.comm is not None:
            try:
                self.comm.close()
            except Exception as e:  # noqa: BLE001
                self.log(f"note: closing the tpcomm Communicator failed: {describe(e)}")
            self.comm = None


def make_case(backend, op, x0, res):
    """The Case running `op` on input x0 with `backend` (see the module doc)."""
    if backend in res.reasons:
        raise Unavailable(res.reasons[backend])
    numel, dtype, world = x0.numel(), x0.dtype, res.world
    nbytes = numel * x0.element_size()

    if backend in ("nccl", "nccl_nomix"):  # the same calls; the process's NCCL setting differs
        if op == "all_reduce":
            x = torch.empty_like(x0)

            def call():
                dist.all_reduce(x)
                return x
            return Case(call, lambda: x.copy_(x0))
        if op == "reduce_scatter":
            part = torch.empty((numel // world,), dtype=dtype, device=x0.device)

            def call():
                dist.reduce_scatter_tensor(part, x0)
                return part
            return Case(call)
        out = torch.empty((world * numel,), dtype=dtype, device=x0.device)

        def call():
            dist.all_gather_into_tensor(out, x0)
            return out
        return Case(call)

    if backend in ("nccl_window", "nccl_window_nomix"):
        x = res.window_view("in", dtype, numel)
        if op == "all_reduce":
            def call():
                dist.all_reduce(x)
                return x
        elif op == "reduce_scatter":
            part = res.window_view("out", dtype, numel // world)

            def call():
                dist.reduce_scatter_tensor(part, x)
                return part
        else:
            out = res.window_view("out", dtype, world * numel)

            def call():
                dist.all_gather_into_tensor(out, x)
                return out
        return Case(call, lambda: x.copy_(x0))

    if backend in SYMM_BACKENDS:
        if op != "all_reduce":
            raise Unavailable("all_reduce only (the backend measures torch.ops.symm_mem's all-reduces)")
        x = res.symm_view(dtype, numel)
        name = res.symm_group_name
        if backend == "symm_one_shot":
            def call():
                return torch.ops.symm_mem.one_shot_all_reduce(x, "sum", name)
        else:
            def call():
                return torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", name)
        return Case(call, lambda: x.copy_(x0))

    if backend in TPCOMM_BACKENDS:
        from tpcomm import _lib

        comm = res.comm
        x = x0.clone()
        if backend == "tpcomm":
            route = {"all_reduce": comm.route_all_reduce, "all_gather": comm.route_all_gather,
                     "reduce_scatter": comm.route_reduce_scatter}[op](x)
            if route == "nccl":
                raise Unavailable(f"the dispatcher sends {human_bytes(nbytes)} to NCCL (policy cap)")
            run = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather,
                   "reduce_scatter": comm.reduce_scatter}[op]
            return Case(lambda: run(x))
        algo = _lib.ALGO_PACKET if backend == "tpcomm_packet" else _lib.ALGO_BULK
        packet_bytes = nbytes // world if op == "reduce_scatter" else nbytes  # the packet kernel's unit: a part
        if algo == _lib.ALGO_PACKET and packet_bytes > comm.packet_max_bytes:
            raise Unavailable(f"over the packet cap of {human_bytes(comm.packet_max_bytes)}")
        limit = comm.max_bytes // world if op == "all_gather" else comm.max_bytes
        if algo == _lib.ALGO_BULK and nbytes > limit:
            raise Unavailable(f"over the bulk cap of {human_bytes(limit)} per rank")
        if op == "all_reduce":
            return Case(lambda: torch.ops.tpcomm.custom_all_reduce(x, comm.handle, algo))
        if op == "reduce_scatter":
            return Case(lambda: torch.ops.tpcomm.custom_reduce_scatter(x, comm.handle, algo))
        return Case(lambda: torch.ops.tpcomm.custom_all_gather(x, 0, comm.handle, algo))

    raise Unavailable(f"unknown backend {backend!r}")
