"""The ranks' agreement on a call before it runs on the fallback
(torch.distributed): tpcomm's kernels check on the device that the peers
called the same op, size and algorithm; torch's collectives check nothing
across ranks unless TORCH_DISTRIBUTED_DEBUG=DETAIL, and ranks that disagree
there abort (gloo), hang (NCCL) or get wrong data with no error (gloo's
all_gather of parts of other dtypes).

Before a call runs on the fallback, every rank all-gathers a header of
HEADER_SLOTS int64 on the same group: the public op, the input's dtype and
shape, and the dim (-1 for ops without one). Where any two differ, every
rank raises CollectiveMismatch naming the field, each rank's value and this
rank's differing peers, and the collective does not run: the group stays
usable. The exchange is one extra collective of HEADER_SLOTS * 8 bytes per
rank (on NCCL a host-to-device copy and a synchronising copy back too); it
waits for the peers as the fallback's own collective would (the group's
timeout).

On by default where the fallback runs on gloo (CPU tensors, or a gloo
group), off on NCCL (Config.fallback_check, TPCOMM_FALLBACK_CHECK). Skipped
under torch.compile tracing and CUDA graph capture, where a host-side
exchange cannot run: there the ranks' agreement is what the fallback itself
checks.
"""
import zlib

import torch
import torch.distributed as dist

from .errors import CollectiveMismatch
from .torch_collectives import torch_path

# The public ops whose calls are checked; a header names its op by index here.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_add_rms_norm", "all_reduce_rms_norm_add",
       "all_reduce_rms_norm_add_rms_norm", "all_reduce_add_rms_norm_fp8", "all_reduce_rms_norm_add_fp8",
       "all_reduce_rms_norm_add_rms_norm_fp8", "all_reduce_add_layer_norm", "all_reduce_layer_norm_add",
       "all_reduce_layer_norm_add_layer_norm", "all_reduce_add_layer_norm_fp8", "all_reduce_layer_norm_add_fp8",
       "all_reduce_layer_norm_add_layer_norm_fp8")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
          torch.float8_e5m2)
MAGIC = 0x7470636F6D6D0001  # "tpcomm", format 1: a peer in another collective shows as a differing header
SHAPE_DIMS = 10  # dims held one per slot; a longer shape is compared by a checksum of the rest
HEADER_SLOTS = 6 + SHAPE_DIMS
FIELDS = ("format", "op", "dtype", "dim")  # the slots after these hold the shape


def default_on(fallback, device):
    """Where the check is on unless configured: the fallback (its backend's
    name) runs on gloo."""
    return device.type == "cpu" or fallback == "gloo"


class Agreement:
    """The check for one group; `check(op, x, dim)` before each fallback call."""

    def __init__(self, group, rank, world_size, device, backend):
        self.group, self.rank, self.world_size, self.backend = group, rank, world_size, backend
        self.device = device if device.type == "cuda" and backend != "gloo" else torch.device("cpu")

    def check(self, op, x, dim=-1):
        """Collective: raises CollectiveMismatch on every rank unless every
        rank calls `op` with x of the same dtype and shape and the same dim."""
        if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        headers = self._exchange(header(op, x, dim)).tolist()
        if any(h != headers[0] for h in headers):
            raise CollectiveMismatch(mismatch_message(headers, self.rank, self.backend))

    @torch_path  # the exchange reaches torch's own collectives, also on a group tpcomm.install() routes
    def _exchange(self, mine):
        if self.device.type == "cuda":
            out = torch.empty(self.world_size * HEADER_SLOTS, dtype=torch.int64, device=self.device)
            dist.all_gather_into_tensor(out, mine.to(self.device), group=self.group)
            return out.view(self.world_size, HEADER_SLOTS).cpu()
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.stack(parts)


def for_communicator(comm):
    """The Agreement of a Communicator's fallback, or None where it is off
    (Config.fallback_check; None: default_on) or there is no peer."""
    configured = comm.config.fallback_check
    on = default_on(comm._fallback, comm.device) if configured is None else configured
    return Agreement(comm.group, comm.rank, comm.world_size, comm.device, comm._fallback) \
        if on and comm.world_size > 1 else None


def checked(agreement, op, run, dim=-1):
    """run(x, *args) preceded by agreement.check(op, x, dim) (run itself
    when agreement is None); all_reduce has no dim. reduce_scatter's run
    takes its input with `dim` moved first (Communicator.reduce_scatter):
    the header has it moved back."""
    if agreement is None:
        return run
    dim = -1 if op == "all_reduce" else dim

    def run_checked(x, *args):
        agreement.check(op, x.movedim(0, dim) if op == "reduce_scatter" and dim > 0 else x, dim)
        return run(x, *args)

    return run_checked


def header(op, x, dim):
    shape = tuple(x.shape)
    rest = zlib.crc32(repr(shape[SHAPE_DIMS:]).encode()) if len(shape) > SHAPE_DIMS else 0
    dims = list(shape[:SHAPE_DIMS]) + [-1] * (SHAPE_DIMS - min(len(shape), SHAPE_DIMS))
    return torch.tensor([MAGIC, OPS.index(op), _dtype_code(x.dtype), dim, len(shape), rest] + dims, dtype=torch.int64)


def _dtype_code(dtype):
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES) + zlib.crc32(str(dtype).encode())


def _describe(h, field):
    if h[0] != MAGIC:
        return "not a tpcomm call (another collective at this point)"
    if field == "op":
        return OPS[h[1]] if 0 <= h[1] < len(OPS) else f"op {h[1]}"
    if field == "dtype":
        return str(DTYPES[h[2]]) if 0 <= h[2] < len(DTYPES) else f"dtype code {h[2]}"
    if field == "dim":
        return "none" if h[3] < 0 else str(h[3])
    dims = [d for d in h[6:] if d >= 0]
    return str(tuple(dims)) + (f" and {h[4] - SHAPE_DIMS} more" if h[4] > SHAPE_DIMS else "")


def _field(a, b):
    """The first field in which headers a and b differ."""
    slot = next(i for i in range(HEADER_SLOTS) if a[i] != b[i])
    return FIELDS[slot] if slot < len(FIELDS) else "shape"


def mismatch_message(headers, rank, backend):
    """What every rank raises: the first field that differs, every rank's
    value of it and its call, and this rank's peers that differ from it."""
    first = next(r for r in range(len(headers)) if headers[r] != headers[0])
    field = _field(headers[0], headers[first])
    values = "; ".join(f"rank {r}: {_describe(h, field)}" for r, h in enumerate(headers))
    calls = "; ".join(f"rank {r}: {_call(h)}" for r, h in enumerate(headers))
    peers = [r for r, h in enumerate(headers) if h != headers[rank]]
    return (f"tpcomm: the ranks called different collectives on the fallback ({backend}): {field} differs "
            f"({values}); calls: {calls}. This is rank {rank}; peers that differ from it: {peers}. "
            "Nothing ran: every rank raises this and the group stays usable")


def _call(h):
    if h[0] != MAGIC:
        return _describe(h, "op")
    dim = "" if h[3] < 0 else f", dim {h[3]}"
    return f"{_describe(h, 'op')} {_describe(h, 'dtype')} {_describe(h, 'shape')}{dim}"
