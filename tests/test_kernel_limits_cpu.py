"""The kernels' rules are written once, in csrc/core/limits.c: the check the
C core runs on every op (tpc_kernel_check on tpc_kernel_limits_of's answer)
and routing's refusals agree over a grid of ops, kernels, world sizes,
dtypes, sizes, rows and pointer alignments; routing still takes exactly
the calls it took when it stated the rules itself; and "bulk" runs the
one-shot all_reduce at two ranks, the streamed two-shot from three on."""
import ctypes
import itertools

import pytest
import torch

import tpcomm
from tpcomm import _constants as C
from tpcomm import _dtypes, _lib, routing

KiB, MiB = 1024, 1024 * 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
WORLDS = range(2, 9)
BASE = 1 << 20  # a pointer the check only reads the alignment of


@pytest.fixture(scope="module")
def lib():
    return tpcomm.load()


def _caps(world):
    return (routing.Caps(world, 1 * MiB, 16 * KiB, True), routing.Caps(world, 4 * MiB, 1 * MiB, False))


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
    platform = C.TPC_PLATFORM_CUDA if caps.line_kernels else C.TPC_PLATFORM_ROCM
    limits = _lib.kernel_limits(routing.OP_CODES[op], routing.algo_code(op, kernel, caps), caps.world_size,
                                caps.max_bytes, caps.packet_max_bytes, platform)
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


def _before(op, kernel, caps, dtype, nbytes, row):
    """Whether routing took a call before its rules came from the C core
    (its own statement of them then), for calls whose row divides the input."""
    part = nbytes if op != "reduce_scatter" else (nbytes // caps.world_size if nbytes % caps.world_size == 0 else 0)
    if op == "all_gather":
        if nbytes == 0 or nbytes % 4 or row % 4:
            return False
    elif dtype not in _dtypes.REDUCIBLE or part == 0 or part % 16 or nbytes > caps.max_bytes:
        return False
    sixteen = op != "all_gather" or (nbytes % 16 == 0 and row % 16 == 0)
    if op not in {"packet": routing.OPS, "line": routing.OPS, "two_shot": ("all_reduce",), "bulk": routing.OPS}[kernel]:
        return False
    if kernel in ("line", "two_shot") and not (caps.line_kernels and sixteen):
        return False
    if kernel == "two_shot" and nbytes <= C.TPC_LINE_STEP_BYTES * (caps.world_size - 1):
        return False
    if kernel != "bulk" and part > caps.packet_max_bytes:
        return False
    if kernel == "bulk" and op == "all_gather" and (not sixteen or nbytes * caps.world_size > caps.max_bytes):
        return False
    return True


def test_routing_takes_what_it_took_before(lib):
    for world in WORLDS:
        for caps, op, kernel, dtype in itertools.product(_caps(world), routing.OPS, routing.KERNELS, DTYPES):
            for nbytes in _sizes(caps):
                for row in _rows(op, nbytes):
                    if op == "all_gather" and (row == 0 or nbytes % row):
                        continue  # a tensor's rows always divide it
                    got = routing.refusal(op, kernel, caps, dtype, nbytes, row) is None
                    assert got == _before(op, kernel, caps, dtype, nbytes, row), (op, kernel, caps, dtype, nbytes, row)


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
                before = (caps.line_kernels and dtype in (torch.float16, torch.bfloat16) and nbytes > 0
                          and nbytes % 16 == 0 and nbytes <= caps.max_bytes)
                assert (why is None) == before, (caps, dtype, nbytes, why)
                for kernel in routing.QUANTIZED:
                    code, c_why = _c_check("all_reduce", kernel, caps, dtype, nbytes, 0, 0)
                    assert (why is None) == (code == _lib.OK), (kernel, caps, dtype, nbytes, why, c_why)
                    for op in ("all_gather", "reduce_scatter"):
                        assert routing.limits(caps)[op, kernel].refused == C.TPC_KERNEL_NO_OP
