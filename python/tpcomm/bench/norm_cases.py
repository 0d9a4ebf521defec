"""The fused all-reduce + add + RMSNorm cases of tpcomm.bench: pattern
ADD_NORM (all_reduce_add_rms_norm) and its FP8 epilogues, inputs of shape
(tokens, hidden), each on one of three backends:

* tpcomm: the dispatcher (Communicator.all_reduce_add_rms_norm, ..._fp8),
  whatever route it takes;
* tpcomm_fused: the fused kernel family, on every input it can take,
  whatever the routing table's fused_norm_max_bytes says;
* tpcomm_past_cap: the route the dispatcher takes past that cap
  (routing.add_rms_norm with a cap of 0): "split" where ADD_NORM can, else
  "unfused" (the all-reduce in fp32, the norm in torch, then fp8.quantize).

tpcomm.tune compares the last two to write the cap. Every case is checked
against tpcomm.reference of every rank's input: the stream output bit for
bit, the normed output within NORMED_ULP; with an FP8 epilogue, the call is
made once more with the normed output returned, whose codes and scales must
be those of the timed call and fp8.quantize of that normed output, bit for
bit. The residual, weight and per_tensor scale are the same on every rank."""
import zlib

import torch
import torch.distributed as dist

from .. import _constants as C
from .. import add_rms_norm, fp8, norm_fp8, reference, routing
from ..backends import Unavailable
from ..norm_patterns import Pattern
from ..routing_table import FUSED_NORM_UNLIMITED
from .inputs import bit_equal
from .vocabulary import NORM_OPS

NORM_BACKENDS = ("tpcomm_fused", "tpcomm_past_cap")
EPS = 1e-6
NORMED_ULP = 1  # the normed output's bound on every route (tpcomm.add_rms_norm's doc)
PER_TENSOR_SCALE = 4.0 / 448  # the normed values reach past 4: some codes saturate
QUANT = {op: op[len("all_reduce_add_rms_norm_fp8_"):] or None for op in NORM_OPS}  # None: no epilogue


def norm_inputs(x0):
    """(residual, weight, scale) of a case on x0 (tokens, hidden): random
    values seeded by the shape alone, so every rank holds the same."""
    g = torch.Generator(device=x0.device)
    g.manual_seed(zlib.crc32(f"norm/{x0.dtype}/{tuple(x0.shape)}".encode()))
    residual = torch.randn(x0.shape, generator=g, device=x0.device).to(x0.dtype)
    weight = (1 + 0.25 * torch.randn(x0.shape[-1:], generator=g, device=x0.device)).to(x0.dtype)
    return residual, weight, torch.full((1,), PER_TENSOR_SCALE, dtype=torch.float32, device=x0.device)


def _capped(routes, largest):
    """routes with the fused norm kernel family capped at `largest` bytes."""
    return {**routes, "all_reduce": {**routes["all_reduce"], "fused_norm": [(largest, "fused")]}}


def forced_route(backend, op, comm, caps, x, weight):
    """The route `backend` (NORM_BACKENDS) runs op on x by: "fused" or, past
    the cap, "split" / "unfused"; raises Unavailable where tpcomm_fused's
    kernel cannot take x."""
    nbytes, row = x.numel() * x.element_size(), x.shape[-1] * x.element_size()
    largest = FUSED_NORM_UNLIMITED if backend == "tpcomm_fused" else 0
    how = routing.add_rms_norm(_capped(comm._routes, largest), caps, True, x.dtype, weight.dtype, nbytes, row)
    if QUANT[op]:
        how = routing.norm_fp8(routing.norm_pattern(how, Pattern.ADD_NORM, 0.0, x.dtype), caps.platform)
    if backend == "tpcomm_fused" and how != "fused":
        if QUANT[op] and caps.platform != C.TPC_PLATFORM_CUDA:
            raise Unavailable("no FP8 epilogues in this build (CUDA only)")
        raise Unavailable(routing.norm_refusal(caps, x.dtype, nbytes, row) or f"the fused route declines it ({how})")
    return how


def make_norm_case(backend, op, x0, res, case_type):
    """The Case (case_type: cases.Case) running norm op `op` on x0 with
    `backend`; collective (an all-gather of the inputs, for the check) once
    the backend is known to take it, so every rank calls it alike."""
    if backend not in ("tpcomm",) + NORM_BACKENDS:
        raise Unavailable(f"the fused norm ops run on tpcomm, {', '.join(NORM_BACKENDS)} only")
    if x0.dtype not in (torch.float16, torch.bfloat16):
        raise Unavailable(f"the fused norm ops are benchmarked in float16 and bfloat16, not {x0.dtype}")
    comm, quant = res.comm, QUANT[op]
    x, (residual, weight, scale) = x0.clone(), norm_inputs(x0)
    scale = scale if quant == "per_tensor" else None
    if backend == "tpcomm":
        route = (norm_fp8.route(comm, Pattern.ADD_NORM, x, weight, None, 0.0) if quant
                 else comm.route_all_reduce_add_rms_norm(x, weight))
        if quant:
            def call(return_normed=False):
                return tuple(comm.all_reduce_add_rms_norm_fp8(x, residual, weight, EPS, quant, scale=scale,
                                                              return_normed=return_normed))
        else:
            def call():
                return comm.all_reduce_add_rms_norm(x, residual, weight, EPS)
    else:
        caps = comm.caps
        route = forced_route(backend, op, comm, caps, x, weight)
        if quant:
            q, floor = fp8.check_args(quant, x, scale)

            def call(return_normed=False):  # norm_fp8's body on a route of our choosing
                return norm_fp8._run(comm, route, Pattern.ADD_NORM, q, x, residual, (weight, None, None, None), EPS,
                                     0.0, 0.0, 1.0, scale, floor, False, return_normed)
        else:
            def call():
                return add_rms_norm.run(comm, route, x, residual, weight, EPS, False)
    return case_type(call, route=route, check=_check(x0, residual, weight, res.world, quant, scale, call))


def _check(x0, residual, weight, world, quant, scale, call):
    """check(result) of a case (see the module doc); collective: gathers the
    ranks' inputs now and, with an epilogue, calls the op once more."""
    every = [torch.empty_like(x0) for _ in range(world)]
    dist.all_gather(every, x0.contiguous())  # a list: gloo (ranks sharing a GPU) takes it for CUDA tensors too
    ref_normed, ref_stream = reference.reference_add_rms_norm(every, residual, weight, EPS)

    def close(normed, stream):
        return (bit_equal(stream, ref_stream) and isinstance(normed, torch.Tensor) and normed.shape == ref_normed.shape
                and normed.dtype == ref_normed.dtype
                and int(reference.ulp_distance(normed, ref_normed).max()) <= NORMED_ULP)

    if quant is None:
        return lambda out: close(*out)

    def check(out):
        codes, scales, _, _ = out
        again = call(return_normed=True)  # every rank checks every case: the call is collective
        again_codes, again_scales, stream, normed = again
        if not close(normed, stream):
            return False
        want_codes, want_scales = fp8.quantize(normed, quant, scale)
        return (bit_equal(codes, again_codes) and bit_equal(scales, again_scales)
                and bit_equal(again_codes, want_codes) and bit_equal(again_scales, want_scales))
    return check
