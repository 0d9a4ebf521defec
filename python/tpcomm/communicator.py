"""Communicator: tpcomm's resources for one torch.distributed group on one GPU,
its construction and its ops. Its bases hold the rest: the route memo and
stats (tpcomm._route_memo), the kernel-or-None calls (tpcomm._kernel_only)
and check, capture, close and abort (tpcomm._lifecycle)."""
import contextlib
import functools
import logging
import os

import torch
import torch.distributed as dist

from . import _constants as C
from . import _agreement, _autograd, _group_setup, _registry, add_rms_norm, norm_fp8, routing, routing_table
from ._kernel_only import KernelOnly
from ._lifecycle import Lifecycle
from ._log import log_once
from ._route_memo import SINGLE_RANK, RouteMemo
from ._shapes import check_int_dim, check_tensor, checked_dim
from .backends import aiter
from .backends.kernels import Kernels
from .backends.nccl import Nccl
from .config import Config


class Communicator(KernelOnly, RouteMemo, Lifecycle):
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

    # The platform this build is for (a tpc_platform, Caps.platform). The C
    # core's limits follow from it: the line kernels rest on NVLink delivering
    # a warp's 128-byte store whole (csrc/kernels/line.cuh), so CUDA only.
    platform = C.TPC_PLATFORM_ROCM if torch.version.hip is not None else C.TPC_PLATFORM_CUDA

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
                self._caps = routing.Caps(self.world_size, self.max_bytes, self.packet_max_bytes, self.platform)
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
    def caps(self) -> "routing.Caps | None":
        """The limits this communicator's calls are routed by (world size,
        buffer sizes, platform), None when the custom path is off."""
        return self._caps

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
        self._count("all_reduce_add_rms_norm", how, x)
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

    def __repr__(self):
        state = ("closed" if self._closed else "custom" if self.enabled else SINGLE_RANK if self.world_size == 1
                 else f"{self._fallback} only ({self.disabled_reason})")
        return (f"tpcomm.Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_bytes={self.max_bytes}, packet_max_bytes={self.packet_max_bytes}, {state})")

    def _check_input(self, x, what):
        # The common case in cheap tests, without making a torch.device.
        if not self._closed and type(x) is torch.Tensor and x.is_cuda and x.get_device() == self._cuda_index:
            return
        check_tensor(x, what)
        self._check_open()
        if x.device != self.device:
            raise ValueError(f"tpcomm: {what} is on {x.device} but the communicator is on {self.device}")
