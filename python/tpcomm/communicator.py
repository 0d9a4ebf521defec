"""Communicator: tpcomm's resources for one torch.distributed group on one GPU,
and the per-call choice between tpcomm's kernels and NCCL."""
import contextlib
import ctypes
import functools
import logging
import os

import torch
import torch.distributed as dist

from . import _agreement, _autograd, _group_setup, _lib, _registry, add_rms_norm, norm_fp8, routing, routing_table
from ._kernel_only import KernelOnly
from ._log import log_once
from ._shapes import check_int_dim, check_tensor, checked_dim
from . import _one_rank
from .backends import aiter
from .backends.kernels import Kernels
from .backends.nccl import Nccl
from .config import Config
from .errors import CollectiveTimeout, CommunicatorClosed

_ROUTE_MEMO_MAX = 4096  # routes remembered per op before the memo starts over
SINGLE_RANK = "single rank"  # disabled_reason, and the backend (route, stats) of a group of one
_KERNEL_ROUTES = frozenset(routing.KERNELS + routing.QUANTIZED)  # what the kernel-or-None methods run


class Communicator(KernelOnly):
    """tpcomm collectives for the ranks of `group` (default: the world group).

    Every rank of the group constructs it, in the same order relative to other
    communicators (construction is collective). The custom kernels are used
    when the group is on one node, on CUDA GPUs that can write into each
    other's memory; otherwise `disabled_reason` says why and every call goes to
    torch.distributed on the same group.

    Args:
        group: a torch.distributed process group.
        device: the CUDA device of this rank (default: the current one when CUDA
            is available, else CPU, which always falls back).
        max_bytes: cap on the output bytes of one op on the custom path; larger
            ops go to NCCL. Registers about 2 * max_bytes of GPU memory per rank.
        packet_max_bytes: cap on the input bytes per rank of the packet kernels;
            registers 4 * world_size * packet_max_bytes per rank.
        timeout_s: bound on every device-side wait for a peer.
        table: routing table, a path or a parsed dict (see tpcomm.routing_table).
        config: a tpcomm.Config; default: Config.from_env(), the TPCOMM_*
            variables. The arguments above, when given, override it.

    Every rank must end with the same effective routing (table and config):
    the ranks compare it at init and raise ValueError naming the keys that
    differ, since ranks that route differently deadlock.

    Ops of one communicator must be issued from one thread at a time, in the
    same order on every rank; an op from a second thread while another runs
    raises. After a device-side failure every later op raises (its output is
    NaN); see tpcomm.errors for the exception classes.
    """

    # The line kernels rest on NVLink delivering a warp's 128-byte store whole
    # (csrc/kernels/line.cuh): CUDA builds only.
    line_kernels = torch.version.hip is None

    def __init__(self, group=None, device=None, max_bytes=None, packet_max_bytes=None,
                 timeout_s=None, table=None, config=None):
        if not dist.is_initialized():
            raise RuntimeError("tpcomm.Communicator needs torch.distributed to be initialised")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = _group_setup.resolve_device(device)
        self._cuda_index = self.device.index if self.device.type == "cuda" else None  # for _check_input
        self.config = (config or Config.from_env()).replace(
            max_bytes=max_bytes, packet_max_bytes=packet_max_bytes, timeout_s=timeout_s,
            table=table if isinstance(table, (str, os.PathLike)) else None)
        self.max_bytes = self.config.max_bytes
        self.packet_max_bytes = min(self.config.packet_max_bytes, self.max_bytes)
        self.timeout_s = float(self.config.timeout_s)
        self.table = routing_table.load_table(
            _group_setup.table_source(table if isinstance(table, dict) else self.config.table, self.device))
        self._routes = routing_table.effective_routes(self.table, self.world_size, dict(self.config.force),
                                                      self.config.forbid, self.config.quantize)
        # the id the internal ops take (0: off or closed); _last_comm_id outlives close
        self.comm_id = self._last_comm_id = 0
        self._comm = self._lib = self._kernels = self._aiter = self._caps = None
        self._closed = False
        self._nccl = Nccl(self.group, self.device)  # the fallback (None once closed: it holds the group)
        self._fallback = self._nccl.backend  # its name, as routes and stats() say it: "nccl", "gloo"
        self._agreement = _agreement.for_communicator(self)  # None where the ranks' agreement is not checked
        self._stat_cells = {}  # (op, backend) -> [calls, input bytes per rank]
        # Per op, (dtype, size) or (shape, dim, element size) -> (stats cell,
        # run, whether run is tpcomm's kernel): the route of each call seen, as
        # the callable that runs it (routing is not walked again).
        self._memo = {op: {} for op in routing.OPS}
        self._all_reduce_memo = self._memo["all_reduce"]  # read on every all_reduce
        self._group_key = _group_setup.group_key(self.group)
        self.group_name = str(self._group_key)  # what the group-name ops torch.ops.tpcomm.* take
        self.serial = next(_group_setup.serials[self._group_key])  # this group's communicators before it
        if self.world_size == 1:  # every op is a local copy: no buffers, no collective, nothing to warn of
            self.disabled_reason = self.aiter_reason = SINGLE_RANK
        else:
            self._open()
        _registry.register(self)

    def _open(self):
        """Collective: the C communicator (or the group's verdict why not) and
        AITER; logs what the group's calls will take."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self._lib, self._comm, self.disabled_reason = _group_setup.open_group(  # collective
                self.group, self.rank, self.world_size, self.device, self.serial, self.config, self._routes,
                self.max_bytes, self.packet_max_bytes)
            if self._comm is not None:
                self.comm_id = self._last_comm_id = int(self._lib.tpc_comm_id(self._comm))
                self._caps = routing.Caps(self.world_size, self.max_bytes, self.packet_max_bytes, self.line_kernels)
                self._kernels = Kernels(self.comm_id, self._cuda_index, self._caps)
            self._aiter, self.aiter_reason = aiter.open_for(
                self.group, self.device, self.max_bytes, self.config,
                functools.partial(_group_setup.agreed_error, self.group, self.rank, self.world_size))
        if self.disabled_reason is not None:
            log_once(logging.WARNING, f"tpcomm: custom path off, every call goes to torch.distributed: "
                                      f"{self.disabled_reason}")
        else:
            log_once(logging.INFO, f"tpcomm: {self.world_size} ranks on {self.device.type}: "
                                   f"{routing.summary(self._routes, self._caps)}")

    @property
    def enabled(self) -> bool:
        return self.comm_id != 0

    @property
    def kernels(self) -> "Kernels | None":
        """tpcomm's kernels for this communicator, called with the algorithm
        forced (a name of tpcomm.routing.KERNELS): what the benchmark and tune
        measure. None when the custom path is off."""
        return self._kernels

    # ------------------------------------------------------------------ ops
    def all_reduce(self, x: torch.Tensor, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """Sum of x over the group. Returns a new tensor, or writes into `out`
        (which may be x itself) and returns it. fp32/fp16/bf16 of a byte size
        that is a multiple of 16, up to max_bytes, run on tpcomm's kernels;
        anything else on NCCL (non-contiguous inputs are made contiguous).
        The route depends only on what every rank shares (dtype, size,
        configuration), never on where the tensor lies in memory."""
        # The common case checked inline (as _check_input does first): this is
        # the eager hot path, where every Python call level costs host time.
        if self._closed or type(x) is not torch.Tensor or not x.is_cuda or x.get_device() != self._cuda_index:
            self._check_input(x, "input")
        if out is not None:
            self._check_input(out, "out")
            if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
                raise ValueError("tpcomm: out must be contiguous with the input's shape and dtype")
        if not x.is_contiguous():
            x = x.contiguous()
        nbytes = x.nbytes
        hit = self._all_reduce_memo.get((x.dtype, nbytes))  # _entry's lookup, inline
        if hit is None:
            hit = self._remember("all_reduce", (x.dtype, nbytes), x, nbytes)
        cell, run, _ = hit
        if x.requires_grad and _autograd.needs_grad(x):
            y = _autograd.all_reduce_without_backward(run, x, out)
        else:
            y = run(x, out)
        cell[0] += 1  # counted once it ran (the fallback's agreement check may stop it)
        cell[1] += nbytes
        return y

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenation of every rank's x along `dim` (negative dims count
        from the end), contiguous: what NCCL's all_gather_into_tensor along
        dim 0 followed by a move to `dim` gives. Any dtype; bit-exact."""
        check_int_dim(dim, "all_gather")
        self._check_input(x, "input")
        dim = checked_dim(x, dim, "all_gather")
        return self._run("all_gather", x, dim, False, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's share of the sum over the group: x is split along `dim`
        into world_size equal parts, and rank r gets the sum of every rank's
        part r (for dim 0, NCCL's reduce_scatter_tensor layout), contiguous.
        fp32/fp16/bf16 whose part is a multiple of 16 bytes run on tpcomm's
        kernels (sums in fp32, in rank order); anything else on NCCL."""
        check_int_dim(dim, "reduce_scatter")
        self._check_input(x, "input")
        return self._scatter(x, checked_dim(x, dim, "reduce_scatter"), False)

    def _scatter(self, x, dim, kernel_only):
        """reduce_scatter of x along a checked dim (see _run for kernel_only:
        a call no kernel takes is None before its dim is checked)."""
        entry = self._entry("reduce_scatter", x, dim)  # keyed by dim too: the fallback's agreement compares it
        if kernel_only and not entry[2]:
            return None
        if x.shape[dim] % self.world_size:
            raise ValueError(f"tpcomm: reduce_scatter needs dim {dim} (size {x.shape[dim]}) divisible by "
                             f"the world size {self.world_size}")
        y = self._run("reduce_scatter", x.movedim(dim, 0) if dim else x, dim, kernel_only, entry=entry)
        return y.movedim(0, dim).contiguous() if dim and y is not None else y

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float = 1e-6, *, in_place: bool = False) -> "tuple[torch.Tensor, torch.Tensor]":
        """What a transformer layer does after its row-parallel matmul, in one
        call: with z = all_reduce(x) + residual, returns
        (rms_norm(z) * weight, z), the norm over the last dimension. Computed
        in fp32 and rounded once: z is not rounded before the norm. With
        in_place=True the normed result is written into x and z into
        residual, and (x, residual) are returned, as serving engines' fused
        add-norm kernels do. Routes ("fused": one kernel; "split": for prefill
        sizes; "unfused") and their numerics: tpcomm.add_rms_norm."""
        for tensor, what in ((x, "input"), (residual, "residual"), (weight, "weight")):
            self._check_input(tensor, what)
        add_rms_norm.check_args(x, residual, weight, eps)
        how = self.route_all_reduce_add_rms_norm(x, weight)
        if (x.requires_grad or residual.requires_grad or weight.requires_grad) and \
                _autograd.needs_grad(x, residual, weight):
            out = _autograd.add_rms_norm_without_backward(add_rms_norm.run, self, how, x, residual, weight, eps,
                                                          in_place)
        else:
            out = add_rms_norm.run(self, how, x, residual, weight, eps, in_place)
        cell = self._cell("all_reduce_add_rms_norm", how)
        cell[0] += 1  # as in all_reduce
        cell[1] += x.numel() * x.element_size()
        return out

    def all_reduce_add_rms_norm_fp8(self, x, residual, weight, eps, quant, *, scale=None, scale_floor=None,
                                    column_major_scales=False, return_normed=False) -> "norm_fp8.Fp8Norm":
        """all_reduce_add_rms_norm with its normed output quantized to FP8
        e4m3 (quant "per_tensor" with an fp32 `scale`, "per_token",
        "per_token_group"): Fp8Norm(codes, scales, summed, normed), normed
        None unless return_normed. Math, floors, layouts: tpcomm.fp8; routes:
        tpcomm.norm_fp8."""
        return norm_fp8.run(self, norm_fp8.Pattern.ADD_NORM, quant, x, residual, weight, None, eps, 0.0, 0.0, scale,
                            scale_floor, column_major_scales, return_normed)

    # -------------------------------------------------------------- routing
    # The fallback is named as stats() counts it: by the group's backend
    # ("nccl" on GPUs, "gloo" on CPU), tpcomm.routing's "nccl" translated in _route.
    def route_all_reduce(self, x: torch.Tensor) -> str:
        """The backend all_reduce(x) uses: "packet", "line", "two_shot", "bulk", the fallback
        ("nccl", "gloo"), or "quantized_<mode>" where Config.quantize is on (tpcomm.routing.quantized)."""
        return self._route_of("all_reduce", x)

    def route_all_gather(self, x: torch.Tensor, dim: int = 0) -> str:
        """The backend all_gather(x, dim) uses: "packet", "line", "bulk" or the fallback."""
        check_tensor(x, "input")
        return self._route_of("all_gather", x, checked_dim(x, dim, "route_all_gather"))

    def route_reduce_scatter(self, x: torch.Tensor) -> str:
        """The backend reduce_scatter(x, dim) uses: "packet", "line", "bulk" or the fallback."""
        return self._route_of("reduce_scatter", x)

    def _route_of(self, op, x, dim=0):
        """The route of `op` of x along a checked dim (the route_* methods' answer)."""
        row = routing.row_bytes(x.shape, dim, x.element_size()) if op == "all_gather" else 0
        return self._route(routing.route, op, x.dtype, x.numel() * x.element_size(), row)

    def route_all_reduce_add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> str:
        """How all_reduce_add_rms_norm(x, residual, weight) runs: "fused" (one
        kernel), "split" (reduce-scatter in fp32, the norm on this rank's rows,
        all-gather) or "unfused" (all_reduce in fp32, then torch)."""
        return self._route(routing.add_rms_norm, self.config.fused_kernel, x.dtype, weight.dtype,
                           x.numel() * x.element_size(), x.shape[-1] * x.element_size() if x.dim() else 0)

    def _route(self, how, *args):
        """routing's answer `how(routes, caps, *args)`; a group of one has one
        route for every call (add_rms_norm.run takes it the unfused way, whose
        all_reduce is a copy)."""
        if self.world_size == 1:
            return SINGLE_RANK
        got = how(self._routes, self._caps, *args)
        return self._fallback if got == "nccl" else got

    def _run(self, op, x, dim, kernel_only, *args, entry=None):
        """op on the memoised route of a call like x (`entry`, where looked up
        already), counted in stats(), with run's arguments `args`; None
        instead where kernel_only and the route is not one of tpcomm's kernels."""
        cell, run, kernel = entry or self._entry(op, x, dim)
        if kernel_only and not kernel:
            return None
        y = _autograd.without_backward(run, op, x, *args) if x.requires_grad and _autograd.needs_grad(x) \
            else run(x, *args)
        cell[0] += 1  # as in all_reduce
        cell[1] += x.numel() * x.element_size()
        return y

    def _entry(self, op, x, dim=0):
        """The memo's (stats cell, run, kernel) for a call of op like x: one
        lookup; routing is walked (_remember) only on a miss."""
        nbytes = x.numel() * x.element_size()
        key = ((x.shape, dim, x.element_size()) if op == "all_gather" else (x.dtype, nbytes, dim)
               if op == "reduce_scatter" else (x.dtype, nbytes))
        return self._memo[op].get(key) or self._remember(op, key, x, nbytes, dim)

    def _remember(self, op, key, x, nbytes, dim=0):
        """Routes a call like x and memoises it (a few thousand shapes at
        most: a serving engine sees a handful per batch size) as (stats cell,
        run, whether the route is tpcomm's kernel). AITER, where it is open,
        routing offers it the call and it takes it, is tried first; what it
        declines runs on the route and is counted there."""
        memo = self._memo[op]
        if len(memo) >= _ROUTE_MEMO_MAX:
            memo.clear()
        backend = self._route_of(op, x, dim)
        cell, run = self._cell(op, backend), self._runner(op, x.dtype, backend)
        run = _agreement.checked(self._agreement, op, run, dim) if backend == self._fallback else run
        if (self._aiter is not None
                and routing.aiter_first(op, self.world_size, self.max_bytes, x.numel() * x.element_size(), dim)
                and self._aiter.takes(op, x)):
            aiter_cell = self._cell(op, "aiter")
            cell, run = aiter_cell, aiter.or_else(getattr(self._aiter, op), run, aiter_cell, cell, nbytes)
        entry = memo[key] = (cell, run, backend in _KERNEL_ROUTES)
        return entry

    def _runner(self, op, dtype, backend):
        """The callable that runs `op` on `backend`, with the op's arguments:
        all_reduce(x, out), all_gather(x, dim), reduce_scatter(parts)."""
        if backend == self._fallback:
            return getattr(self._nccl, op)
        if backend == SINGLE_RANK:
            return getattr(_one_rank, op)
        if op == "all_reduce":
            return self._kernels.all_reduce_runner(dtype, backend)
        return functools.partial(getattr(self._kernels, op), algo=backend)

    def _cell(self, op, backend):
        return self._stat_cells.setdefault((op, backend), [0, 0])

    def stats(self) -> dict:
        """Calls and input bytes per rank so far, per (op, backend) that ran them:
        {("all_reduce", "packet"): {"calls": 12, "bytes": 49152}, ...}. The
        fallback is named by the group's torch.distributed backend ("nccl",
        "gloo"); a group of one counts under "single rank"."""
        return {key: {"calls": c[0], "bytes": c[1]} for key, c in self._stat_cells.items() if c[0]}

    # ------------------------------------------------------------ life cycle
    def check(self) -> None:
        """Raises the recorded error if an op failed on the device: a peer that did not arrive within
        timeout_s (CollectiveTimeout), peers that called different ops (CollectiveMismatch), or, after
        close(), a CUDA graph captured on this communicator that was replayed (CommunicatorClosed).
        Reads host-mapped memory: no synchronisation."""
        if self._comm is not None:
            code = self._lib.tpc_comm_async_error(self._comm, ctypes.byref(_lib.AsyncError()))
            _lib.check(self._lib, self._comm, code, "device error")
        elif self._last_comm_id:  # closed: the record outlives the communicator
            record = _lib.AsyncError()
            code = self._lib.tpc_id_async_error(self._last_comm_id, ctypes.byref(record))
            if record.code != _lib.OK:
                _lib.check(self._lib, None, code, "device error")

    @contextlib.contextmanager
    def capture(self):
        """Context for CUDA graph capture of this communicator's ops.

        The kernels read only their input and buffers registered at init, and take their sequence number
        from a counter on the device, so captured ops need no registration afterwards and replay
        correctly in any order and interleaved with eager calls. A graph replayed after close() finds
        the communicator closed on the device, writes NaN into its outputs and nothing else, and check()
        reports it. The context only checks, on entry, that the communicator is open and no earlier op
        failed on the device (an error found inside a capture would abort it)."""
        self._check_open()
        self.check()
        with self._aiter.capture() if self._aiter is not None else contextlib.nullcontext():
            yield self  # AITER registers the graph's buffers when its context exits

    def close(self, timeout_s: "float | None" = None) -> None:
        """Frees the registered buffers and lets go of the group (so that dist.destroy_process_group()
        ends it). Collective: every rank calls it. Waits at most `timeout_s` (default: this
        communicator's timeout_s + 5 s) for the peers to arrive; if one does not (it died, or never
        calls close), the communicator is aborted instead (see abort()) and CollectiveTimeout names the
        missing ranks."""
        if (group := self._mark_closed()) is None or self._comm is None:
            return
        timeout_s = self.timeout_s + 5.0 if timeout_s is None else float(timeout_s)
        torch.cuda.synchronize(self.device)  # our own kernels end within timeout_s: every wait is bounded
        missing = _group_setup.meet_peers(group, self.rank, f"tpcomm/close/{self._group_key}/{self.serial}",
                                          timeout_s)
        if missing:
            self._release(self._lib.tpc_comm_abort, "abort")
            raise CollectiveTimeout(
                f"tpcomm: close: ranks {missing} did not arrive within {timeout_s:.1f} s; the communicator "
                "was aborted (its GPU memory is released when the process exits)")
        self._release(self._lib.tpc_comm_destroy, "destroy")

    def abort(self) -> None:
        """Stops this communicator now, on this rank only: never blocks, needs no peer. Ops queued on
        the GPU and graph replays exit (outputs NaN), peers' waits for this rank end at once with an
        error, and the id is retired. The registered GPU memory stays allocated until the process exits
        (a kernel may still run on it). Use it when a peer died; close() is the orderly, collective way."""
        if self._mark_closed() is not None and self._comm is not None:
            self._release(self._lib.tpc_comm_abort, "abort")

    def _mark_closed(self):
        """None when it already was; else closes it to callers, to the group-name ops and to AITER, and
        lets go of the process group (docs/design.md, Teardown), which it returns."""
        if self._closed:
            return None
        self._closed = True
        _registry.unregister(self)
        group, self.group, self._nccl, self._agreement = self.group, None, None, None
        for memo in self._memo.values():  # its runs are bound to the fallback, which holds the group
            memo.clear()
        aiter_backend, self._aiter = self._aiter, None
        if aiter_backend is not None:
            aiter_backend.close()
        return group

    def _release(self, fn, what):
        comm, self._comm, self.comm_id, self._caps = self._comm, None, 0, None
        _lib.check(self._lib, comm, fn(comm), what)

    def __repr__(self):
        state = ("closed" if self._closed else "custom" if self.enabled else SINGLE_RANK if self.world_size == 1
                 else f"{self._fallback} only ({self.disabled_reason})")
        return (f"tpcomm.Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_bytes={self.max_bytes}, packet_max_bytes={self.packet_max_bytes}, {state})")

    def _check_open(self):
        if self._closed:
            raise CommunicatorClosed(f"tpcomm: the communicator (comm_id {self._last_comm_id}) is closed")

    def _check_input(self, x, what):
        # The common case in cheap tests, without making a torch.device.
        if not self._closed and type(x) is torch.Tensor and x.is_cuda and x.get_device() == self._cuda_index:
            return
        check_tensor(x, what)
        self._check_open()
        if x.device != self.device:
            raise ValueError(f"tpcomm: {what} is on {x.device} but the communicator is on {self.device}")
