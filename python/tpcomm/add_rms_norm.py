"""all_reduce_add_rms_norm: the all-reduce after a row-parallel matmul with
the residual add and the RMSNorm that follow it. With z = all_reduce(x) +
residual it gives (rms_norm(z) * weight, z), the norm over the last
dimension, computed in fp32 and rounded once (z is not rounded before the
norm; tpcomm.reference is the definition the tests use).

Three routes, chosen from what every rank shares (shape, dtype, config) by
tpcomm.routing.add_rms_norm:
  "fused"   one launch of tpcomm's fused kernel family
            (csrc/kernels/all_reduce_norm.cuh) on pattern ADD_NORM:
            fp16/bf16, the input within the packet cap and the routing
            table's fused_norm_max_bytes, a row of at most
            TPC_NORM_MAX_ROW_BYTES. The other fusion patterns
            (tpcomm.norm_patterns) run on the same family where this route
            is "fused".
  "split"   larger inputs (prefill), or rows too long for the kernel, whose
            rows divide among the ranks: the reduce-scatter kernels hand each
            rank the fp32 sums of its rows (unrounded), the rank adds its rows
            of the residual and normalises them, and one all-gather of both
            results gives every rank every row. 3/4 of the traffic of an fp32
            all-reduce.
  "unfused" anything else: x all-reduced in fp32 through the dispatcher, the
            rest by torch in fp32.
The first two sum in rank order: z is the reference bit for bit and the
normed output within 1 ulp (its mean of squares is summed in another order).
Unfused gives the reference within 1 ulp (NCCL's order on more than 2 ranks).
Config.fused_kernel=False leaves only "unfused"."""
import torch

from . import _constants as C


def check_args(x, residual, weight, eps):
    """Shapes, dtypes and eps; raises before anything collective happens."""
    if x.dim() < 1 or residual.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"tpcomm: all_reduce_add_rms_norm needs residual of the input's shape {tuple(x.shape)} "
                         f"and weight of its last dimension; got {tuple(residual.shape)} and {tuple(weight.shape)}")
    if not (x.is_floating_point() and residual.dtype == x.dtype and weight.is_floating_point()):
        raise TypeError(f"tpcomm: all_reduce_add_rms_norm needs a floating-point input, residual of its dtype "
                        f"and a floating-point weight; got {x.dtype}, {residual.dtype}, {weight.dtype}")
    if not (isinstance(eps, (int, float)) and 0.0 <= eps <= 1.0):
        raise ValueError(f"tpcomm: eps={eps!r} must be a number in [0, 1]")


def run(comm, how, x, residual, weight, eps, in_place):
    """(normed, z) by route `how`; with in_place written into x and residual."""
    if how == "fused":
        xc, rc = x.contiguous(), residual.contiguous()
        direct = in_place and xc is x and rc is residual
        normed, summed = (x, residual) if direct else (torch.empty_like(xc), torch.empty_like(rc))
        comm.kernels.all_reduce_norm(C.TPC_PATTERN_ADD_NORM, xc, rc, weight.contiguous(), None, eps, 0.0, 0.0, normed,
                                     summed)
    elif how == "split":
        normed, summed = by_rows(comm, x, residual, weight, eps)
    else:
        sums = uncounted(comm, "all_reduce", x.float(), call=("all_reduce_add_rms_norm", x))
        normed, summed = from_sums(sums, residual, weight, eps, x.dtype)
    if not in_place:
        return normed, summed
    if normed is not x:
        x.copy_(normed)
    if summed is not residual:
        residual.copy_(summed)
    return x, residual


def by_rows(comm, x, residual, weight, eps):
    """The "split" route: rank r reduces rows [r*p, (r+1)*p) in fp32 (sums
    unrounded), adds its rows of the residual, normalises them, and one
    all-gather of (normed, z) rounded gives every rank all rows."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    part = rows // comm.world_size
    flat = x.contiguous().view(rows, hidden)
    sums = comm.kernels.reduce_scatter_f32(flat, comm.route_reduce_scatter(flat))
    mine = residual.reshape(rows, hidden)[comm.rank * part:(comm.rank + 1) * part]
    normed, summed = from_sums(sums, mine, weight, eps, x.dtype)
    both = uncounted(comm, "all_gather", torch.stack((normed, summed)), 1)  # (2, rows, hidden), contiguous
    return both[0].view(x.shape), both[1].view(x.shape)


def uncounted(comm, op, x, *args, call=None):
    """comm's all_reduce(x) or all_gather(x, dim) on the route the
    Communicator would take, not counted in stats(): a part of a fused call,
    which counts once, under its own key. `call` (the fused op's name, its
    input): what the ranks agree on first where the route is the fallback
    (tpcomm._agreement)."""
    x = x.contiguous()
    route = comm.route_all_reduce(x) if op == "all_reduce" else comm.route_all_gather(x, *args)
    if call is not None and route == comm._fallback and comm._agreement is not None:
        comm._agreement.check(*call)
    return comm._runner(op, x.dtype, route)(x, *args)


def from_sums(sums, residual, weight, eps, dtype):
    """(normed, z) rounded to dtype from fp32 sums: z = sums + residual, the
    RMSNorm of z over the last dimension times weight, all in fp32."""
    z = sums + residual.float()
    normed = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(dtype), z.to(dtype)
