"""Communicator: tpcomm's resources for one torch.distributed group on one GPU,
and the per-call choice between tpcomm's kernels and NCCL."""
import collections
import contextlib
import ctypes
import itertools
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from . import _fake, _lib, add_rms_norm, ops, policy, topology
from ._log import log_once
from ._shapes import checked_dim
from .backends import aiter
from .backends.kernels import ALGOS as KERNEL_ALGOS, Kernels
from .backends.nccl import Nccl
from .config import Config
from .errors import CollectiveTimeout, CommunicatorClosed

KiB = 1024
MiB = 1024 * KiB
REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ROUTE_MEMO_MAX = 4096  # routes remembered per op before the memo starts over
# Communicators created so far on each group (keyed by the group's name):
# every rank of a group must create them in the same order, whatever other
# groups (TP inside PP, DP replicas) it also belongs to.
_serials = collections.defaultdict(itertools.count)
# Looked up once: the eager all_reduce calls them on every op.
_is_compiling = torch.compiler.is_compiling
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def group_key(group):
    """A name for `group` that every member computes alike."""
    name = getattr(group, "group_name", None)
    return name if name else tuple(dist.get_process_group_ranks(group))


class Communicator:
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
        table: routing table, a path or a parsed dict (see tpcomm.policy).
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
    # (csrc/kernels/line.cuh): CUDA builds only; elsewhere their bands run on
    # the packet kernels.
    line_kernels = torch.version.hip is None

    def __init__(self, group=None, device=None, max_bytes=None, packet_max_bytes=None,
                 timeout_s=None, table=None, config=None):
        if not dist.is_initialized():
            raise RuntimeError("tpcomm.Communicator needs torch.distributed to be initialised")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = _resolve_device(device)
        self._cuda_index = self.device.index if self.device.type == "cuda" else None  # for _check_input
        self.config = (config or Config.from_env()).replace(
            max_bytes=max_bytes, packet_max_bytes=packet_max_bytes, timeout_s=timeout_s,
            table=table if isinstance(table, (str, os.PathLike)) else None)
        self.max_bytes = self.config.max_bytes
        self.packet_max_bytes = min(self.config.packet_max_bytes, self.max_bytes)
        self.timeout_s = float(self.config.timeout_s)
        self.table = policy.load_table(table if isinstance(table, dict) else self.config.table)
        self._routes = policy.effective_routes(self.table, self.world_size, dict(self.config.force),
                                               self.config.forbid)
        self.handle = 0          # the communicator's id, the int the ops take; 0 once closed
        self._id = 0             # the same, kept after close (check() reads its record)
        self._comm = None        # the C communicator, as a ctypes pointer
        self._lib = None
        self._closed = False
        self.disabled_reason = None
        self._nccl = Nccl(self.group)  # the fallback; the custom path adds self._kernels
        self._kernels = None
        self._aiter = None       # AMD AITER's all-reduce, on ROCm where it imports (backends/aiter.py)
        self.aiter_reason = None  # why it is not used, or None
        self._stat_cells = {}    # (op, backend) -> [calls, input bytes per rank]
        # Per op, the route of each (dtype or layout, size) seen, with its stats
        # cell: the eager path looks its route up instead of walking the bands.
        self._memo = {op: {} for op in policy.OPS}
        self._all_reduce_memo = self._memo["all_reduce"]  # read on every all_reduce
        self._group_key = group_key(self.group)
        self.group_name = str(self._group_key)  # what torch.ops.tpcomm.all_reduce(x, group_name) takes
        self.serial = next(_serials[self._group_key])
        with self._on_device():
            self.disabled_reason = self._agree(self._local_reason())
            if self.disabled_reason is None:
                self.disabled_reason = self._open_custom()
            self.aiter_reason = self._open_aiter()
        ops.register(self)
        if self.disabled_reason is not None:
            log_once(logging.WARNING, f"tpcomm: custom path off, every call goes to torch.distributed: "
                                      f"{self.disabled_reason}")
        else:
            log_once(logging.INFO, f"tpcomm: {self.world_size} ranks on {self.device.type}: "
                                   f"{self._routing_summary()}")

    # ---------------------------------------------------------------- set-up
    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _local_reason(self):
        if self.config.disable:
            return "disabled by TPCOMM_DISABLE (or Config.disable)"
        if not 2 <= self.world_size <= _lib.MAX_RANKS:
            return f"world size {self.world_size} is outside 2..{_lib.MAX_RANKS}"
        if self.device.type != "cuda":
            return f"device is {self.device.type}: the custom kernels need CUDA GPUs"
        try:
            self._lib = _lib.load()
        except ImportError as e:
            return str(e)
        return None

    def _gather(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _first_rank_error(self, error):
        """Collective: every rank's error (or None) exchanged; the first one,
        naming its rank, or None when no rank has one."""
        return _first_error([{"rank": i, "error": e} for i, e in enumerate(self._gather(error))])

    def _agree(self, reason):
        """Every rank ends with the same verdict (a rank that cannot use the
        custom path turns it off for all, or peers would wait for it)."""
        routing = {**policy.flatten(self._routes), **self.config.describe()}
        facts = self._gather({"rank": self.rank, "reason": reason, "serial": self.serial, "routing": routing,
                              **topology.local_facts(self.device)})
        for i, f in enumerate(facts):
            if f["rank"] != i:
                return f"group rank {i} answered as rank {f['rank']}: groups out of step"
        _raise_if_routing_differs([f["routing"] for f in facts])
        serials = [f["serial"] for f in facts]
        if len(set(serials)) != 1:
            return ("ranks created their communicators on this group in different orders "
                    f"(creation numbers by rank: {serials})")
        for f in facts:
            if f["reason"]:
                return f"rank {f['rank']}: {f['reason']}"
        n_nodes = topology.nodes(facts)
        if n_nodes > 1:
            return f"the group spans {n_nodes} nodes; the custom kernels are intra-node"
        uuids = [f["gpu_uuid"] for f in facts]
        if None not in uuids and len(set(uuids)) < len(uuids) and not self.config.share_gpu:
            return "two ranks share one GPU"
        distinct = sorted(set(uuids)) if None not in uuids else []
        if self.world_size > 2 and len(distinct) > 1:
            nvlink = topology.nvlink_between_all(distinct)
            if nvlink is False:
                return f"{self.world_size} GPUs without NVLink between every pair"
            if nvlink is None:
                return f"cannot tell whether {self.world_size} GPUs share NVLink (NVML unavailable)"
        return None

    def _open_custom(self):
        lib = self._lib
        cfg = _lib.Config(self.rank, self.world_size, self.device.index, self.max_bytes,
                          self.packet_max_bytes, int(self.timeout_s * 1e9))
        comm = ctypes.c_void_p()
        local_error = None
        code = lib.tpc_comm_create(ctypes.byref(cfg), ctypes.byref(comm))
        handle = ctypes.create_string_buffer(_lib.IPC_HANDLE_BYTES)
        if code != _lib.OK:
            local_error = "create: " + lib.tpc_comm_last_error(None).decode()
        elif lib.tpc_comm_export(comm, handle) != _lib.OK:
            local_error = "export: " + lib.tpc_comm_last_error(comm).decode()
        # Handles are gathered on this group, keyed by rank; _agree already
        # checked that the ranks agree on which communicator of the group this is.
        entries = self._gather({"rank": self.rank, "error": local_error,
                                "handle": handle.raw if local_error is None else None})
        reason = _first_error(entries)
        if reason is None:
            reason = self._open_peers(comm, entries)
        if reason is None:
            self._comm = comm
            self.handle = self._id = int(lib.tpc_comm_id(comm))
            self._kernels = Kernels(self.handle, self._cuda_index)
            _fake.WORLD_SIZES[self.handle] = self.world_size
            return None
        if comm.value:
            lib.tpc_comm_destroy(comm)
        return reason

    def _open_aiter(self):
        """AITER's CustomAllreduce where it can run on every rank (a verdict
        exchange first, so no rank waits in a set-up the others skip).
        Returns why it is not used, or None."""
        # The switches are in the configuration every rank compared in _agree,
        # and every rank runs the same torch build: no exchange is needed to
        # agree that AITER is off for those reasons (it would be start-up work
        # on every CUDA communicator).
        if self.config.disable:
            reason = "off (TPCOMM_DISABLE)"
        elif not self.config.aiter:
            reason = "off (TPCOMM_AITER=0 or Config.aiter=False)"
        elif getattr(torch.version, "hip", None) is None:
            reason = aiter.available()[1]
        else:
            reason = self._first_rank_error(aiter.available()[1])
        if reason is None:
            made, error = None, None
            try:
                made = aiter.AiterAllReduce(self.group, self.device, self.max_bytes)  # collective
            except Exception as e:  # noqa: BLE001 - a reason, never a crash
                error = f"AITER's CustomAllreduce failed: {type(e).__name__}: {e}"
            reason = self._first_rank_error(error)
            if reason is None:
                self._aiter = made
                log_once(logging.INFO, "tpcomm: AMD AITER's custom all-reduce is tried first for all_reduce and "
                                       "all_gather along dim 0 (what it declines: tpcomm's kernels, then RCCL)")
                return None
            if made is not None:
                made.close()
        log_once(logging.INFO, f"tpcomm: AITER backend not used: {reason}")
        return reason

    def _open_peers(self, comm, entries):
        lib = self._lib
        error = None
        for peer, e in enumerate(entries):
            if peer != self.rank and error is None:
                if lib.tpc_comm_open_peer(comm, peer, e["handle"]) != _lib.OK:
                    error = lib.tpc_comm_last_error(comm).decode()
        if error is None and lib.tpc_comm_ready(comm) != _lib.OK:
            error = lib.tpc_comm_last_error(comm).decode()
        if error is None and lib.tpc_comm_probe_write(comm) != _lib.OK:
            error = "P2P probe: " + lib.tpc_comm_last_error(comm).decode()
        # Probe: every rank wrote a token into every peer; after the gather
        # (a host barrier) each checks that all tokens arrived.
        reason = self._first_rank_error(error)
        if reason is not None:
            return reason
        mask = ctypes.c_uint32()
        if lib.tpc_comm_probe_read(comm, ctypes.byref(mask)) != _lib.OK:
            error = "P2P probe: " + lib.tpc_comm_last_error(comm).decode()
        else:
            missing = [p for p in range(self.world_size) if p != self.rank and not mask.value >> p & 1]
            if missing:
                error = f"P2P probe: writes from ranks {missing} did not arrive"
        return self._first_rank_error(error)

    # ------------------------------------------------------------ public API
    @property
    def enabled(self) -> bool:
        return self.handle != 0

    @property
    def kernels(self) -> "Kernels | None":
        """tpcomm's kernels for this communicator, called with the algorithm
        forced ("packet", "line" or "bulk"): what the benchmark and tune measure. None
        when the custom path is off."""
        return self._kernels

    def all_reduce(self, x: torch.Tensor, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """Sum of x over the group. Returns a new tensor, or writes into `out`
        (which may be x itself) and returns it. fp32/fp16/bf16 of a byte size
        that is a multiple of 16, up to max_bytes, run on tpcomm's kernels;
        anything else on NCCL (non-contiguous inputs are made contiguous).
        The route depends only on what every rank shares (dtype, size,
        configuration), never on where the tensor lies in memory."""
        # The common case checked inline (as _check_input does first): every
        # Python call is about 0.3 us of host time on the 2xH200 host.
        if self._closed or type(x) is not torch.Tensor or not x.is_cuda or x.get_device() != self._cuda_index:
            self._check_input(x, "input")
        if out is not None:
            self._check_input(out, "out")
            if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
                raise ValueError("tpcomm: out must be contiguous with the input's shape and dtype")
        if not x.is_contiguous():
            x = x.contiguous()
        nbytes = x.nbytes
        key = (x.dtype, nbytes)
        hit = self._all_reduce_memo.get(key)
        if hit is None:
            backend = "aiter" if self._aiter is not None and self._aiter.can_take(x) else \
                self._route_all_reduce(x, nbytes)
            hit = self._remember("all_reduce", key, backend)
        backend, cell, fast = hit
        cell[0] += 1
        cell[1] += nbytes
        if fast is not None and out is None and not _is_compiling():
            # Kernels.all_reduce's eager fast path, inlined (one call fewer:
            # benchmarks/host_cost.py); misaligned outputs go on to Kernels.
            out = torch.empty_like(x)
            src, dst = x.data_ptr(), out.data_ptr()
            if not (src | dst) & 15:
                call, cid, dtype_code, algo_code = fast
                try:
                    call(cid, src, dst, nbytes, dtype_code, algo_code, _raw_stream(self._cuda_index))
                except RuntimeError as e:
                    raise _lib.translated(e) from None
                return out
        if backend == "aiter":
            y = self._aiter.all_reduce(x)
            if y is not None:
                return y if out is None else out.copy_(y)
            backend = self._route_all_reduce(x, nbytes)  # declined after all (rank-invariant: shape-based)
        if backend == "nccl":
            return self._nccl.all_reduce(x, out)
        return self._kernels.all_reduce(x, backend, out)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenation of every rank's x along `dim` (negative dims count
        from the end), contiguous: what NCCL's all_gather_into_tensor along
        dim 0 followed by a move to `dim` gives. Any dtype; bit-exact."""
        self._check_input(x, "input")
        dim = checked_dim(x, dim, "all_gather")
        nbytes = x.numel() * x.element_size()
        key = (x.shape, dim, x.element_size())
        hit = self._memo["all_gather"].get(key)
        if hit is None:
            hit = self._remember("all_gather", key, self._aiter_all_gather_route(x, dim, nbytes)
                                 or self._route_all_gather(x, dim, nbytes))
        backend, cell, _ = hit
        cell[0] += 1
        cell[1] += nbytes
        if backend == "aiter":
            flat = self._aiter.all_gather(x.contiguous())
            if flat is not None:
                return flat.view((self.world_size * x.shape[0],) + tuple(x.shape[1:]))
            backend = self._route_all_gather(x, dim, nbytes)
        if backend == "nccl":
            return self._nccl.all_gather(x, dim)
        return self._kernels.all_gather(x, dim, backend)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's share of the sum over the group: x is split along `dim`
        into world_size equal parts, and rank r gets the sum of every rank's
        part r (for dim 0, NCCL's reduce_scatter_tensor layout), contiguous.
        fp32/fp16/bf16 whose part is a multiple of 16 bytes run on tpcomm's
        kernels (sums in fp32, in rank order); anything else on NCCL."""
        self._check_input(x, "input")
        dim = checked_dim(x, dim, "reduce_scatter")
        if x.shape[dim] % self.world_size:
            raise ValueError(f"tpcomm: reduce_scatter needs dim {dim} (size {x.shape[dim]}) divisible by "
                             f"the world size {self.world_size}")
        nbytes = x.numel() * x.element_size()
        hit = self._memo["reduce_scatter"].get((x.dtype, nbytes))
        if hit is None:
            hit = self._remember("reduce_scatter", (x.dtype, nbytes), self._route_reduce_scatter(x, nbytes))
        backend, cell, _ = hit
        cell[0] += 1
        cell[1] += nbytes
        parts = x.movedim(dim, 0) if dim else x
        if backend == "nccl":
            y = self._nccl.reduce_scatter(parts.contiguous())
        else:
            y = self._kernels.reduce_scatter(parts, backend)
        return y.movedim(0, dim).contiguous() if dim else y

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
        self._check_input(x, "input")
        self._check_input(residual, "residual")
        self._check_input(weight, "weight")
        add_rms_norm.check_args(x, residual, weight, eps)
        how = add_rms_norm.route(self, x, weight)
        cell = self._stat_cells.setdefault(("all_reduce_add_rms_norm", how), [0, 0])
        cell[0] += 1
        cell[1] += x.numel() * x.element_size()
        return add_rms_norm.run(self, how, x, residual, weight, eps, in_place)

    def route_all_reduce_add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> str:
        """How all_reduce_add_rms_norm(x, residual, weight) runs: "fused" (one
        kernel), "split" (reduce-scatter in fp32, the norm on this rank's rows,
        all-gather) or "unfused" (all_reduce in fp32, then torch)."""
        return add_rms_norm.route(self, x, weight)

    def _aiter_all_gather_route(self, x, dim, nbytes):
        """"aiter" where AITER's flat all-gather is the layout asked for (dim
        0; the input is made contiguous) and its buffer holds the output;
        else None."""
        if (self._aiter is None or dim != 0 or nbytes * self.world_size > self.max_bytes
                or not self._aiter.can_take(x.contiguous())):
            return None
        return "aiter"

    def route_reduce_scatter(self, x: torch.Tensor) -> str:
        """The backend reduce_scatter(x, dim) uses: "packet", "bulk" or "nccl"."""
        return self._route_reduce_scatter(x, x.numel() * x.element_size())

    def _route_reduce_scatter(self, x, nbytes):
        part = nbytes // self.world_size if nbytes % self.world_size == 0 else 0
        return self._route_reducing("reduce_scatter", x, nbytes, part)

    def _route_reducing(self, op, x, nbytes, part):
        """all_reduce (part: the whole input) and reduce_scatter (part: one
        rank's share): bands by input bytes, the packet cap on the part."""
        if (not self.enabled or x.dtype not in REDUCE_DTYPES or part == 0 or part % 16
                or nbytes > self.max_bytes):
            return "nccl"
        by_dtype = self._routes[op]
        backend = policy.choose(by_dtype.get(_DTYPE_NAMES[x.dtype], by_dtype["*"]), nbytes)
        if backend == "line" and not self.line_kernels:
            backend = "packet"
        if backend in ("packet", "line") and part > self.packet_max_bytes:
            backend = "bulk"
        return backend

    def route_all_reduce(self, x: torch.Tensor) -> str:
        """The backend all_reduce(x) uses: "packet", "line", "bulk" or "nccl"."""
        return self._route_all_reduce(x, x.numel() * x.element_size())

    def _route_all_reduce(self, x, nbytes):
        return self._route_reducing("all_reduce", x, nbytes, nbytes)

    def route_all_gather(self, x: torch.Tensor, dim: int = 0) -> str:
        """The backend all_gather(x, dim) uses: "packet", "line", "bulk" or "nccl"."""
        return self._route_all_gather(x, dim, x.numel() * x.element_size())

    def _route_all_gather(self, x, dim, nbytes):
        row = math.prod(x.shape[dim % max(x.dim(), 1):]) * x.element_size() if x.dim() else nbytes
        if not self.enabled or nbytes == 0 or nbytes % 4 or row % 4:
            return "nccl"
        backend = policy.choose(self._routes["all_gather"]["*"], nbytes)
        sixteen = nbytes % 16 == 0 and row % 16 == 0  # what the line and bulk kernels move
        bulk_ok = sixteen and nbytes * self.world_size <= self.max_bytes
        if (backend == "bulk" and not bulk_ok) or (backend == "line" and not (sixteen and self.line_kernels)):
            backend = "packet"
        if backend in ("packet", "line") and nbytes > self.packet_max_bytes:
            backend = "bulk" if bulk_ok else "nccl"
        return backend

    def _routing_summary(self):
        """The dispatch order, as logged at init."""
        parts = []
        for op in policy.OPS:
            bands = ", ".join(f"{backend} up to {limit} B" for limit, backend in self._routes[op]["*"])
            parts.append(f"{op}: {bands}, then nccl (caps: packet {self.packet_max_bytes} B per rank, "
                         f"output {self.max_bytes} B)")
        return "; ".join(parts)

    def _remember(self, op, key, backend):
        """Memoises a route (a few thousand shapes at most: a serving engine
        sees a handful per batch size) with the stats cell it counts into and,
        for an all_reduce on tpcomm's kernels, the fast path's call and codes
        (Kernels.fast_all_reduce)."""
        memo = self._memo[op]
        if len(memo) >= _ROUTE_MEMO_MAX:
            memo.clear()
        cell = self._stat_cells.setdefault((op, backend), [0, 0])
        fast = None
        if op == "all_reduce" and self._kernels is not None and backend in KERNEL_ALGOS:
            fast = self._kernels.fast_all_reduce(key[0], backend)
        memo[key] = (backend, cell, fast)
        return memo[key]

    def stats(self) -> dict:
        """Calls and input bytes per rank so far, per (op, backend):
        {("all_reduce", "packet"): {"calls": 12, "bytes": 49152}, ...}."""
        return {key: {"calls": c[0], "bytes": c[1]} for key, c in self._stat_cells.items() if c[0]}

    def check(self) -> None:
        """Raises the recorded error if an op failed on the device: a peer
        that did not arrive within timeout_s (CollectiveTimeout), peers that
        called different ops (CollectiveMismatch), or, after close(), a CUDA
        graph captured on this communicator that was replayed
        (CommunicatorClosed). Reads host-mapped memory: no synchronisation."""
        if self._comm is not None:
            code = self._lib.tpc_comm_async_error(self._comm, ctypes.byref(_lib.AsyncError()))
            _lib.check(self._lib, self._comm, code, "device error")
        elif self._id:  # closed: the record outlives the communicator
            record = _lib.AsyncError()
            code = self._lib.tpc_id_async_error(self._id, ctypes.byref(record))
            if record.code != _lib.OK:
                _lib.check(self._lib, None, code, "device error")

    @contextlib.contextmanager
    def capture(self):
        """Context for CUDA graph capture of this communicator's ops.

        The kernels read only their input and buffers registered at init, and
        take their sequence number from a counter on the device, so captured
        ops need no registration afterwards and replay correctly in any order
        and interleaved with eager calls. A graph replayed after close() finds
        the communicator closed on the device, writes NaN into its outputs and
        nothing else, and check() reports it. The context only checks, on
        entry, that the communicator is open and no earlier op failed on the
        device (an error found inside a capture would abort it)."""
        self._check_open()
        self.check()
        if self._aiter is None:
            yield self
            return
        with self._aiter.capture():  # AITER registers the graph's buffers when it exits
            yield self

    def close(self, timeout_s: "float | None" = None) -> None:
        """Frees the registered buffers. Collective: every rank calls it. Waits
        at most `timeout_s` (default: this communicator's timeout_s + 5 s) for
        the peers to arrive; if one does not (it died, or never calls close),
        the communicator is aborted instead (see abort()) and
        CollectiveTimeout names the missing ranks."""
        if not self._mark_closed():
            return
        self._close_aiter()
        if self._comm is None:
            return
        timeout_s = self.timeout_s + 5.0 if timeout_s is None else float(timeout_s)
        # Our own kernels end within timeout_s (every wait is bounded).
        torch.cuda.synchronize(self.device)
        missing = self._meet_peers(timeout_s)
        if missing:
            self._release(self._lib.tpc_comm_abort, "abort")
            raise CollectiveTimeout(
                f"tpcomm: close: ranks {missing} did not arrive within {timeout_s:.1f} s; the communicator "
                "was aborted (its GPU memory is released when the process exits)")
        self._release(self._lib.tpc_comm_destroy, "destroy")

    def abort(self) -> None:
        """Stops this communicator now, on this rank only: never blocks, needs
        no peer. Ops queued on the GPU and graph replays exit (outputs NaN),
        peers' waits for this rank end at once with an error, and the id is
        retired. The registered GPU memory stays allocated until the process
        exits, since a kernel may still be running on it. Use it when a peer
        died; close() is the orderly, collective way."""
        if self._mark_closed():
            self._close_aiter()
            if self._comm is not None:
                self._release(self._lib.tpc_comm_abort, "abort")

    def _close_aiter(self):
        aiter_backend, self._aiter = self._aiter, None
        if aiter_backend is not None:
            aiter_backend.close()

    def _mark_closed(self):
        """False when it already was; else closes it to callers and to the
        group-name ops, and returns True."""
        if self._closed:
            return False
        self._closed = True
        ops.unregister(self)
        return True

    def _release(self, fn, what):
        _fake.WORLD_SIZES.pop(self.handle, None)
        comm, self._comm, self.handle = self._comm, None, 0
        _lib.check(self._lib, comm, fn(comm), what)

    def _meet_peers(self, timeout_s):
        """Host-side barrier through the group's store, bounded: the ranks
        that did not arrive within timeout_s (empty when all did). No peer may
        still write into our buffer once every rank has arrived here."""
        try:
            store = dist.distributed_c10d._get_default_store()
            prefix = f"tpcomm/close/{self._group_key}/{self.serial}"
            ranks = dist.get_process_group_ranks(self.group)
            store.set(f"{prefix}/{ranks[self.rank]}", b"1")
            deadline = time.monotonic() + timeout_s
            pause = 1e-4
            while True:
                missing = [i for i, r in enumerate(ranks) if not store.check([f"{prefix}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        except Exception as e:  # noqa: BLE001 - a store whose host died: the peers are gone
            return [f"unknown ({type(e).__name__}: {e})"]

    def __repr__(self):
        state = "closed" if self._closed else ("custom" if self.enabled else f"NCCL only ({self.disabled_reason})")
        return (f"tpcomm.Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_bytes={self.max_bytes}, packet_max_bytes={self.packet_max_bytes}, {state})")

    # -------------------------------------------------------------- helpers
    def _check_open(self):
        if self._closed:
            raise CommunicatorClosed(f"tpcomm: the communicator (id {self._id}) is closed")

    def _check_input(self, x, what):
        # The common case in cheap tests, without making a torch.device.
        if not self._closed and type(x) is torch.Tensor and x.is_cuda and x.get_device() == self._cuda_index:
            return
        self._check_open()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"tpcomm: {what} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"tpcomm: {what} is on {x.device} but the communicator is on {self.device}")


def _resolve_device(device):
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _raise_if_routing_differs(routings):
    """Every rank's effective routing (flattened) must be the same: raises
    ValueError on every rank alike, naming up to 8 differing keys."""
    keys = sorted(set().union(*routings))
    differ = [k for k in keys if len({r.get(k) for r in routings}) > 1]
    if differ:
        shown = "; ".join(f"{k}: " + ", ".join(f"rank {i}: {r.get(k, 'absent')}" for i, r in enumerate(routings))
                          for k in differ[:8])
        raise ValueError(f"tpcomm: the ranks would route differently (and deadlock): {len(differ)} keys differ: "
                         f"{shown}")


def _first_error(entries):
    for e in entries:
        if e.get("error"):
            return f"rank {e['rank']}: {e['error']}"
    return None
