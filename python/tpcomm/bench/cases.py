"""What tpcomm.bench measures: every case runs through the objects of
tpcomm.backends (the ones the dispatcher runs), set up here once per process.

make_case(backend, op, x0, res) gives a Case: prepare() puts the input x0
where the op reads it (the registered buffers, or a copy for the in-place
ops; not timed), call() runs the op once and returns its result. A backend
that cannot run the case raises Unavailable with the reason.

Resources sets up, collectively and once per process, what the backends
need; a backend whose set-up fails on any rank is off on every rank, with the
reason (every step that could fail on one rank only is followed by an
exchange of verdicts, so that no rank waits in a collective the others
skipped):

* nccl: tpcomm.backends.nccl.Nccl on the world group, all_reduce in place.
* tpcomm (the dispatcher: tpcomm.Communicator), tpcomm_packet, tpcomm_line, tpcomm_two_shot, tpcomm_bulk
  (tpcomm.backends.kernels.Kernels of that communicator, kernel forced),
  tpcomm_fused and tpcomm_past_cap (the fused norm ops' routes, forced:
  bench/norm_cases.py, which makes every norm op's case): one Communicator
  whose max_bytes covers the largest all-gather output.
* nccl_window: tpcomm.bench.nccl_window.NcclWindow (its doc says how the
  window is made); cases run on views of it.
* nccl_nomix, nccl_window_nomix: the same calls as nccl and nccl_window, in
  processes whose NCCL was started with NCCL_GRAPH_MIXING_SUPPORT=0 (NCCL's
  fastest setting under CUDA graphs, read once per process): python -m
  tpcomm.bench runs them in a second set of processes, graph mode only, and
  merges their rows (worker.py, --merge-from). In any other process they
  are off, with that reason.
* symm_one_shot, symm_two_shot: tpcomm.bench.symm_mem.SymmMem on views
  at offset 0 of its buffer, the input placed there before timing. All-reduce
  only. symm_two_shot_copied: the same two-shot timed with the copy of the
  input in and of the result out, what a dispatcher pays for a tensor that
  does not live in the buffer.
"""
import os

import torch
import torch.distributed as dist

from .. import routing
from ..backends import Unavailable
from ..backends.nccl import Nccl
from .nccl_window import NcclWindow
from .norm_cases import NORM_BACKENDS, make_norm_case
from .symm_mem import SymmMem
from .vocabulary import NORM_OPS

# tpcomm's quantized all-reduce, one backend a mode: not exact, so checked
# against the error bound (tpcomm.quantized_reference) instead of bit for bit.
QUANTIZED_BACKENDS = tuple(f"tpcomm_{kernel}" for kernel in routing.QUANTIZED)
TPCOMM_BACKENDS = (("tpcomm", "tpcomm_packet", "tpcomm_line", "tpcomm_two_shot", "tpcomm_bulk") + QUANTIZED_BACKENDS
                   + NORM_BACKENDS)
NOMIX_BACKENDS = ("nccl_nomix", "nccl_window_nomix")
SYMM_BACKENDS = ("symm_one_shot", "symm_two_shot", "symm_two_shot_copied")
WINDOW_BACKENDS = ("nccl_window", "nccl_window_nomix")

__all__ = ["Case", "Resources", "Unavailable", "agree", "describe", "make_case"]


def graph_mixing_off():
    """NCCL in this process was told graphs and eager calls do not mix."""
    return os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0"


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
    def __init__(self, call, prepare=None, route=None, check=None):
        self.call = call
        self._prepare = prepare
        self.route = route  # the dispatcher's: the backend it sent the case to
        self.check = check  # check(result) -> correct; None: bit for bit against the exact reference

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
        self.nccl = Nccl(self.group)
        self.comm = None
        self.window = None  # a registered NcclWindow
        self.symm = None    # a rendezvoused SymmMem
        self._keep = []     # set-ups that half succeeded: kept alive, unused
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

    def _off(self, backends, reason):
        for b in backends:
            self.reasons.setdefault(b, reason)

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
        window = NcclWindow(self.group, self.device, self.max_bytes, self.max_bytes * self.world)
        reason = None
        try:
            window.allocate()
        except Exception as e:  # noqa: BLE001
            reason = f"NCCL window buffer: {describe(e)}"
        reason = agree(reason, self.world)
        if reason:
            return self._off(WINDOW_BACKENDS, reason)
        try:
            window.register()  # collective: ncclCommWindowRegister
        except Exception as e:  # noqa: BLE001
            reason = f"register_mem_pool(pool, symm=True): {describe(e)}"
        local = reason
        reason = agree(reason, self.world)
        if reason:
            if local is None:  # registered here but not everywhere: keep the memory alive, unused
                self._keep.append(window)
            return self._off(WINDOW_BACKENDS, reason)
        self.window = window
        self.info["nccl_window"] = window.describe()

    # ------------------------------------------------------------------- symm
    def _setup_symm(self):
        symm = SymmMem(self.group, self.device, self.max_bytes)
        reason = None
        try:
            symm.allocate()
        except Exception as e:  # noqa: BLE001
            reason = f"symmetric memory buffer: {describe(e)}"
        if symm.note:
            self.info["symm_mem_set_backend"] = symm.note
        reason = agree(reason, self.world)
        if not reason:
            try:
                symm.rendezvous()  # collective
            except Exception as e:  # noqa: BLE001
                reason = f"symm_mem.rendezvous: {describe(e)}"
            reason = agree(reason, self.world)
        if reason:
            self._keep.append(symm)
            return self._off(SYMM_BACKENDS, reason)
        self.symm = symm
        try:
            self.info["symm_mem_backend"] = symm.backend_name()
        except Exception as e:  # noqa: BLE001
            self.info["symm_mem_backend"] = f"unknown ({describe(e)})"

    # ------------------------------------------------------------------ close
    def close(self):
        """Collective: frees what was set up (never raises)."""
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001
            pass
        if self.window is not None:
            try:
                self.window.close()
            except Exception as e:  # noqa: BLE001
                self.log(f"note: deregistering the NCCL window failed: {describe(e)}")
            self.window = None
        if self.comm is not None:
            try:
                self.comm.close()
            except Exception as e:  # noqa: BLE001
                self.log(f"note: closing the tpcomm Communicator failed: {describe(e)}")
            self.comm = None


def quantized_check(x0, world, kernel):
    """check(result) for the quantized all-reduce `kernel` ("quantized_<mode>")
    on x0: every value within tpcomm.quantized_reference's bound of the exact
    sum of every rank's input. Collective (an all-gather of the inputs): every
    rank makes the same cases, so every rank calls it."""
    from .. import quantized_reference

    gathered = torch.empty((world * x0.numel(),), dtype=x0.dtype, device=x0.device)
    dist.all_gather_into_tensor(gathered, x0.contiguous())
    limit, exact = quantized_reference.bound(list(gathered.view(world, -1)), kernel[len("quantized_"):])

    def check(y):
        return (isinstance(y, torch.Tensor) and y.numel() == exact.numel()
                and bool(((y.reshape(-1).double() - exact).abs() <= limit).all()))
    return check


def make_case(backend, op, x0, res):
    """The Case running `op` on input x0 with `backend` (see the module doc)."""
    if backend in res.reasons:
        raise Unavailable(res.reasons[backend])
    if op in NORM_OPS:
        return make_norm_case(backend, op, x0, res, Case)
    if backend in NORM_BACKENDS:
        raise Unavailable(f"the fused norm ops only ({', '.join(NORM_OPS)})")
    numel, world = x0.numel(), res.world
    nbytes = numel * x0.element_size()

    if backend in ("nccl", "nccl_nomix"):  # the same calls; the process's NCCL setting differs
        nccl = res.nccl
        if op == "all_reduce":
            x = torch.empty_like(x0)
            return Case(lambda: nccl.all_reduce(x, out=x), lambda: x.copy_(x0))  # in place
        if op == "reduce_scatter":
            return Case(lambda: nccl.reduce_scatter(x0))
        return Case(lambda: nccl.all_gather(x0, 0))

    if backend in WINDOW_BACKENDS:
        window = res.window
        x = window.view("in", x0.dtype, numel)
        if op == "all_reduce":
            return Case(lambda: window.all_reduce(x), lambda: x.copy_(x0))
        if op == "all_gather":
            out = window.view("out", x0.dtype, numel * world)
            return Case(lambda: window.all_gather(x, out), lambda: x.copy_(x0))
        out = window.view("out", x0.dtype, numel // world)
        return Case(lambda: window.reduce_scatter(x, out), lambda: x.copy_(x0))

    if backend in SYMM_BACKENDS:
        if op != "all_reduce":
            raise Unavailable("all_reduce only (the backend measures torch.ops.symm_mem's all-reduces)")
        symm = res.symm
        x = symm.view(x0.dtype, numel)
        if backend == "symm_two_shot_copied":  # the whole price for a tensor outside the buffer
            y = torch.empty_like(x0)

            def copied():
                x.copy_(x0)
                symm.all_reduce(x, "two_shot")
                return y.copy_(x)
            return Case(copied)
        kind = backend[len("symm_"):]
        return Case(lambda: symm.all_reduce(x, kind), lambda: x.copy_(x0))

    if backend in TPCOMM_BACKENDS:
        comm = res.comm
        x = x0.clone()
        if backend == "tpcomm":  # measured whatever it routes to, NCCL included: its row is the dispatcher's
            run = getattr(comm, op)
            route = getattr(comm, f"route_{op}")(x)  # route_all_reduce, ...
            check = quantized_check(x0, world, route) if route in routing.QUANTIZED else None
            return Case(lambda: run(x), route=route, check=check)
        algo = backend[len("tpcomm_"):]
        caps = comm.caps
        if algo in routing.QUANTIZED:
            why = ("the quantized kernel is all_reduce only" if op != "all_reduce"
                   else routing.quantized_refusal(caps, x0.dtype, nbytes))
            if why:
                raise Unavailable(why)
            kernels = comm.kernels
            return Case(lambda: kernels.all_reduce(x, algo), check=quantized_check(x0, world, algo))
        why = routing.refusal(op, algo, caps, x0.dtype, nbytes, nbytes)  # all_gather along dim 0: one row
        if why:
            raise Unavailable(why)
        kernels = comm.kernels
        if op == "all_reduce":
            return Case(lambda: kernels.all_reduce(x, algo))
        if op == "reduce_scatter":
            return Case(lambda: kernels.reduce_scatter(x, algo))
        return Case(lambda: kernels.all_gather(x, 0, algo))

    raise Unavailable(f"unknown backend {backend!r}")
