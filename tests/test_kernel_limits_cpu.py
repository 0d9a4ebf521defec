"""The kernels' rules are written once, in csrc/core/limits.c: the check the
C core runs on every op (tpc_kernel_check on tpc_kernel_limits_of's answer)
and routing's refusals agree over a grid of ops, kernels, world sizes,
dtypes, sizes, rows and pointer alignments (routing asks that check, pointers
aside); the fused norm's route is the same check of its op; and "bulk" runs
the one-shot all_reduce at two ranks, the streamed two-shot from three on."""
import ctypes
import itertools

import pytest
import torch

import tpcomm
from tpcomm import _constants as C
from tpcomm import _dtypes, _lib, routing, routing_table

KiB, MiB = 1024, 1024 * 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
WORLDS = range(2, 9)
BASE = 1 << 20  # a pointer the check only reads the alignment of


@pytest.fixture(scope="module")
def lib():
    return tpcomm.load()


def _caps(world):
    return (routing.Caps(world, 1 * MiB, 16 * KiB, C.TPC_PLATFORM_CUDA), routing.Caps(world, 4 * MiB, 1 * MiB, C.TPC_PLATFORM_ROCM))


def _sizes(caps):
    """Sizes around every rule's edge: unit multiples, the two_shot minimum,
    the packet cap and max_bytes, per rank and for the whole op."""
    w, edges = caps.world_size, set()
    for base in (0, 4, 6, 8, 12, 16, 20, 48, 64, 80, 448 * (w - 1), caps.packet_max_bytes, caps.max_bytes // w,
                 caps.max_bytes):
        for size in (base, base + 4, base + 16, base - 4, base - 16):
            if size >= 0:
                edges.update((size, size * w))
    return sorted(edges)


def _rows(op, nbytes):
    if op != "all_gather":
        return (0,)
    return tuple({nbytes, nbytes // 2, 4, 8, 16, 24, 0})


def _c_check(op, kernel, caps, dtype, nbytes, row, misalign):
    """tpc_kernel_check's answer for the call routing would make: (code, why)."""
    limits = _lib.kernel_limits(routing.OP_CODES[op], routing.algo_code(op, kernel, caps), caps.world_size,
                                caps.max_bytes, caps.packet_max_bytes, caps.platform)
    chunk = nbytes // caps.world_size if op == "reduce_scatter" else nbytes
    ptrs = (ctypes.c_void_p * 2)(BASE + misalign, BASE + 64 * KiB)
    why = ctypes.create_string_buffer(256)
    code = _lib.load().tpc_kernel_check(ctypes.byref(limits), routing.OP_CODES[op], routing.algo_code(op, kernel, caps),
                                        _dtypes.CODE.get(dtype, 7), chunk, row, ptrs, 2, why, len(why))
    return code, why.value.decode()


def test_the_c_core_takes_exactly_what_routing_takes(lib):
    checked = 0
    for world in WORLDS:
        for caps, op, kernel, dtype in itertools.product(_caps(world), routing.OPS, routing.KERNELS, DTYPES):
            for nbytes in _sizes(caps):
                if op == "reduce_scatter" and nbytes % world:
                    # no such call reaches the core: the parts are not equal
                    assert routing.refusal(op, kernel, caps, dtype, nbytes) is not None
                    continue
                for row in _rows(op, nbytes):
                    why = routing.refusal(op, kernel, caps, dtype, nbytes, row)
                    code, c_why = _c_check(op, kernel, caps, dtype, nbytes, row, 0)
                    assert (why is None) == (code == _lib.OK), (op, kernel, caps, dtype, nbytes, row, why, c_why)
                    if why is None:  # routing never reads a pointer: the core refuses a misaligned one
                        for misalign in (4, 8):
                            code, c_why = _c_check(op, kernel, caps, dtype, nbytes, row, misalign)
                            assert code == _lib.ERR_INVALID_ARG and "16-byte aligned" in c_why, c_why
                    checked += 1
    assert checked > 10000


def test_routing_says_the_cores_sentence(lib):
    """A refusal names the rule in the C core's words; the one rule routing
    adds (a reduce_scatter splits evenly, before any kernel sees it) and a
    dtype with no tpc_dtype say so."""
    caps = _caps(4)[0]
    assert routing.refusal("all_reduce", "packet", caps, torch.bfloat16, 24) == \
        "all_reduce of 24 bytes: a positive multiple of 16 is needed (packet kernel)"
    assert routing.refusal("all_reduce", "packet", caps, torch.bfloat16, 32 * KiB) == \
        "all_reduce of 32768 bytes is over the packet cap of 16384"
    assert routing.refusal("reduce_scatter", "bulk", caps, torch.float32, 66) == \
        "reduce_scatter of 66 bytes does not split into 4 equal parts"
    assert routing.refusal("all_reduce", "two_shot", caps, torch.float16, 448 * 3) == \
        "two_shot all_reduce of 1344 bytes: more than 1344 bytes (a warp step of lines per rank) are needed"
    why = routing.refusal("all_reduce", "bulk", caps, torch.int32, 64)
    assert why.startswith("torch.int32 is not reduced by tpcomm's kernels") and "float32, float16 or bfloat16" in why
    assert routing.refusal("all_reduce", "bulk", caps, torch.float32, 4 * MiB) == \
        "all_reduce of 4194304 bytes is over max_bytes 1048576"
    assert routing.refusal("all_gather", "line", _caps(4)[1], torch.int32, 64, 64) == \
        "all_gather: the line kernel is not in this build (CUDA only)"


NORM_ROW = C.TPC_NORM_MAX_ROW_BYTES


@pytest.mark.parametrize("world", (2, 3, 8))
def test_the_fused_norm_takes_what_the_cores_norm_check_takes(lib, world):
    """all_reduce_add_rms_norm runs fused exactly where the core's check of
    TPC_OP_ALL_REDUCE_NORM passes (and the routes' fused cap allows): 16-bit
    floats, rows of 16-byte multiples up to TPC_NORM_MAX_ROW_BYTES, the input
    within the packet cap; the edges are stated here too."""
    caps = routing.Caps(world, 4 * MiB, 256 * KiB, C.TPC_PLATFORM_CUDA)
    routes = routing_table.effective_routes(routing_table.load_table(), world)
    limits = _lib.kernel_limits(C.TPC_OP_ALL_REDUCE_NORM, C.TPC_ALGO_PACKET, world, caps.max_bytes,
                                caps.packet_max_bytes, C.TPC_PLATFORM_CUDA)
    fused_max = routing.fused_norm_max(routes)
    checked = fused = 0
    for dtype in DTYPES:
        for row in (8, 16, 24, 48, 2048, NORM_ROW - 16, NORM_ROW, NORM_ROW + 16):
            for rows in (1, 2, world, 64, 256):
                nbytes = row * rows
                got = routing.add_rms_norm(routes, caps, True, dtype, dtype, nbytes, row)
                ptrs = (ctypes.c_void_p * 4)(BASE, BASE + 64 * KiB, BASE + 128 * KiB, BASE + 192 * KiB)
                code = lib.tpc_kernel_check(ctypes.byref(limits), C.TPC_OP_ALL_REDUCE_NORM, C.TPC_ALGO_PACKET,
                                            _dtypes.CODE.get(dtype, 7), nbytes, row, ptrs, 4, None, 0)
                core = code == _lib.OK and nbytes <= fused_max
                stated = (dtype in (torch.float16, torch.bfloat16) and row % 16 == 0 and row <= NORM_ROW
                          and nbytes <= min(caps.packet_max_bytes, fused_max))
                assert (got == "fused") == core == stated, (dtype, row, rows, got)
                checked, fused = checked + 1, fused + stated
    assert checked > 100 and 0 < fused < checked
    assert routing.add_rms_norm(routes, caps, True, torch.bfloat16, torch.float32, 64, 64) == "unfused"
    assert routing.add_rms_norm(routes, None, True, torch.bfloat16, torch.bfloat16, 64, 64) == "unfused"


@pytest.mark.parametrize("world", WORLDS)
def test_bulk_all_reduce_is_one_shot_at_two_ranks_only(lib, world):
    for caps in _caps(world):
        want = C.TPC_ALGO_BULK_ONE_SHOT if world == 2 else C.TPC_ALGO_BULK
        assert routing.algo_code("all_reduce", "bulk", caps) == want
        assert routing.algo_code("all_gather", "bulk", caps) == C.TPC_ALGO_BULK
        assert routing.algo_code("reduce_scatter", "bulk", caps) == C.TPC_ALGO_BULK
        for kernel in ("packet", "line", "two_shot"):
            assert routing.algo_code("all_reduce", kernel, caps) == routing.ALGO_CODES[kernel]
        # the other pairings are refused by the core, naming the world size
        other = C.TPC_ALGO_BULK if world == 2 else C.TPC_ALGO_BULK_ONE_SHOT
        limits = _lib.kernel_limits(C.TPC_OP_ALL_REDUCE, other, world, caps.max_bytes, caps.packet_max_bytes,
                                    C.TPC_PLATFORM_CUDA)
        assert limits.refused == C.TPC_KERNEL_NO_WORLD


def test_kernel_ops_are_the_cores(lib):
    """routing.KERNEL_OPS (read where routing tables are checked, without
    the extension) names the ops the core's limits serve."""
    for world, op, kernel in itertools.product(WORLDS, routing.OPS, routing.KERNELS):
        served = routing.limits(_caps(world)[0])[op, kernel].refused != C.TPC_KERNEL_NO_OP
        assert served == (op in routing.KERNEL_OPS[kernel]), (world, op, kernel)


def test_limits_refuse_what_is_not_a_kernel(lib):
    with pytest.raises(ValueError, match="no kernel limits"):
        _lib.kernel_limits(C.TPC_OP_ALL_REDUCE, 0, 2, MiB, KiB, C.TPC_PLATFORM_CUDA)
    with pytest.raises(ValueError, match="no kernel limits"):
        _lib.kernel_limits(C.TPC_OP_ALL_REDUCE, C.TPC_ALGO_PACKET, 9, MiB, KiB, C.TPC_PLATFORM_CUDA)
    with pytest.raises(ValueError, match="no kernel limits"):
        _lib.kernel_limits(9, C.TPC_ALGO_PACKET, 2, MiB, KiB, C.TPC_PLATFORM_CUDA)


def test_the_quantized_all_reduce_takes_what_the_core_takes(lib):
    """Its limits (all_reduce of float16/bfloat16 within max_bytes, CUDA
    only) are the C core's, in every mode; and what it took before."""
    for world in WORLDS:
        for caps, dtype in itertools.product(_caps(world), DTYPES):
            for nbytes in _sizes(caps):
                why = routing.quantized_refusal(caps, dtype, nbytes)
                before = (caps.platform == C.TPC_PLATFORM_CUDA and dtype in (torch.float16, torch.bfloat16) and nbytes > 0
                          and nbytes % 16 == 0 and nbytes <= caps.max_bytes)
                assert (why is None) == before, (caps, dtype, nbytes, why)
                for kernel in routing.QUANTIZED:
                    code, c_why = _c_check("all_reduce", kernel, caps, dtype, nbytes, 0, 0)
                    assert (why is None) == (code == _lib.OK), (kernel, caps, dtype, nbytes, why, c_why)
                    for op in ("all_gather", "reduce_scatter"):
                        assert routing.limits(caps)[op, kernel].refused == C.TPC_KERNEL_NO_OP
