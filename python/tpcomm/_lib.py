"""Loads the compiled extension: registers the torch ops and exposes the C core
API through ctypes. Importing tpcomm never fails because the extension is
missing; `load()` raises ImportError with the reason, and the Communicator
reports it as its disabled_reason."""
import ctypes
import glob
import logging
import os
import re

import torch

from . import _constants as C
from .errors import CollectiveMismatch, CollectiveTimeout, CommunicatorClosed, TpcommError

IPC_HANDLE_BYTES = C.TPC_IPC_HANDLE_BYTES
MAX_RANKS = C.TPC_MAX_RANKS
NORM_MAX_ROW_BYTES = C.TPC_NORM_MAX_ROW_BYTES  # the longest row the fused norm kernel takes
# tpc_result codes
OK, ERR_INVALID_ARG, ERR_RUNTIME, ERR_PEER, ERR_STATE, ERR_TIMEOUT, ERR_MISMATCH, ERR_TOO_LARGE, ERR_CLOSED = (
    C.TPC_OK, C.TPC_ERR_INVALID_ARG, C.TPC_ERR_RUNTIME, C.TPC_ERR_PEER, C.TPC_ERR_STATE, C.TPC_ERR_TIMEOUT,
    C.TPC_ERR_MISMATCH, C.TPC_ERR_TOO_LARGE, C.TPC_ERR_CLOSED)
# tpc_algo: ALGO_PACKET, ALGO_BULK, ALGO_LINE, ALGO_TWO_SHOT, ALGO_QUANTIZED_FP8/INT8/INT4,
# ALGO_BULK_ONE_SHOT: every TPC_ALGO_* of csrc/tpcomm.h, read from _constants (generated from the header)
globals().update({name[len("TPC_"):]: value for name, value in vars(C).items() if name.startswith("TPC_ALGO_")})


class Config(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int),
        ("world_size", ctypes.c_int),
        ("device", ctypes.c_int),
        ("max_bytes", ctypes.c_size_t),
        ("packet_max_bytes", ctypes.c_size_t),
        ("timeout_ns", ctypes.c_uint64),
    ]


class AsyncError(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_int32),
        ("peer", ctypes.c_int32),
        ("epoch", ctypes.c_uint32),
        ("reported", ctypes.c_int32),
        ("peer_bytes", ctypes.c_uint32),
        ("peer_kind", ctypes.c_uint32),
        ("own_bytes", ctypes.c_uint32),
        ("own_kind", ctypes.c_uint32),
    ]


class KernelLimits(ctypes.Structure):
    """tpc_kernel_limits: what one kernel takes for one op (csrc/core/limits.c)."""
    _fields_ = [
        ("refused", ctypes.c_int32),
        ("dtypes", ctypes.c_uint32),
        ("multiple", ctypes.c_uint64),
        ("more_than", ctypes.c_uint64),
        ("packet_cap", ctypes.c_uint64),
        ("chunks", ctypes.c_uint64),
        ("max_bytes", ctypes.c_uint64),
        ("cap", ctypes.c_uint64),
        ("max_row", ctypes.c_uint64),
        ("align", ctypes.c_uint64),
    ]


_P = ctypes.c_void_p
_SIGNATURES = {
    "tpc_comm_create": (ctypes.c_int, [ctypes.POINTER(Config), ctypes.POINTER(_P)]),
    "tpc_comm_export": (ctypes.c_int, [_P, ctypes.c_char_p]),
    "tpc_comm_open_peer": (ctypes.c_int, [_P, ctypes.c_int, ctypes.c_char_p]),
    "tpc_comm_ready": (ctypes.c_int, [_P]),
    "tpc_comm_destroy": (ctypes.c_int, [_P]),
    "tpc_comm_abort": (ctypes.c_int, [_P]),
    "tpc_comm_id": (ctypes.c_uint64, [_P]),
    "tpc_id_async_error": (ctypes.c_int, [ctypes.c_uint64, ctypes.POINTER(AsyncError)]),
    "tpc_comm_debug_set_epoch": (ctypes.c_int, [_P, ctypes.c_uint32]),
    "tpc_comm_probe_write": (ctypes.c_int, [_P]),
    "tpc_comm_probe_read": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_uint32)]),
    "tpc_comm_async_error": (ctypes.c_int, [_P, ctypes.POINTER(AsyncError)]),
    "tpc_result_string": (ctypes.c_char_p, [ctypes.c_int]),
    "tpc_comm_last_error": (ctypes.c_char_p, [_P]),
    "tpc_comm_buffer_bytes": (ctypes.c_size_t, [_P]),
    "tpc_comm_open_peer_count": (ctypes.c_int, [_P]),
    "tpc_kernel_limits_of": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                                            ctypes.c_int, ctypes.POINTER(KernelLimits)]),
    "tpc_kernel_check": (ctypes.c_int, [ctypes.POINTER(KernelLimits), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(_P), ctypes.c_int,
                                        ctypes.c_char_p, ctypes.c_size_t]),
}

_lib = None
_load_error = None
_fastpath = None


def library_path():
    """Path of the built extension (tpcomm/_C*.so) next to this file."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))
    if not found:
        raise ImportError(
            "tpcomm's compiled extension (tpcomm/_C*.so) was not found: build it with "
            "`pip install --no-build-isolation -e .`")
    return found[0]


def load():
    """Returns the ctypes library, registering the internal ops torch.ops._tpcomm.*
    (and their fake implementations) on first use."""
    global _lib, _load_error
    if _lib is not None:
        return _lib
    if _load_error is not None:
        raise ImportError(_load_error)
    try:
        path = library_path()
        torch.ops.load_library(path)
        lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except Exception as e:  # noqa: BLE001 - every failure must become a reason on every rank
        _load_error = f"tpcomm extension could not be loaded: {e}"
        raise ImportError(_load_error) from e
    from . import _fake

    _fake.register()
    _bind_fastpath(lib)
    _lib = lib
    return lib


def _bind_fastpath(lib):
    """Binds tpcomm._fastpath (csrc/binding/fastpath.c) to this library's C
    core, so that both reach one registry of communicators."""
    global _fastpath
    try:
        from . import _fastpath as module
    except ImportError as e:
        from ._log import log_once
        log_once(logging.WARNING, f"tpcomm: the eager fast path was not built ({e}); eager all_reduce "
                 f"goes through the torch op, which costs more host time per call")
        return
    address = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
               for name in ("tpc_id_all_reduce", "tpc_comm_last_error", "tpc_result_string")]
    module.bind(*address)
    _fastpath = module


def fastpath():
    """tpcomm._fastpath, bound, once load() has run; None where it was not built."""
    return _fastpath


def kernel_limits(op, algo, world, max_bytes, packet_max_bytes, platform):
    """The C core's tpc_kernel_limits of kernel `algo` (a tpc_algo) for `op`
    (a tpc_collective) in a communicator of these sizes on `platform` (a tpc_platform)."""
    limits = KernelLimits()
    code = load().tpc_kernel_limits_of(op, algo, world, max_bytes, packet_max_bytes, platform, ctypes.byref(limits))
    if code != OK:
        raise ValueError(f"tpcomm: no kernel limits for op {op}, algorithm {algo}, world {world}, max_bytes "
                         f"{max_bytes}, packet_max_bytes {packet_max_bytes}, platform {platform}")
    return limits


def kernel_check(limits, op, algo, dtype, chunk, row):
    """The C core's tpc_kernel_check of one call against `limits` (what
    kernel_limits gives), pointers aside: None where the kernel takes it, else
    the core's sentence naming the rule. dtype: a tpc_dtype, -1 for none."""
    why = ctypes.create_string_buffer(256)
    if load().tpc_kernel_check(ctypes.byref(limits), op, algo, dtype, chunk, row, None, 0, why, len(why)) == OK:
        return None
    return why.value.decode()


_CLASS_OF_CODE = {ERR_TIMEOUT: CollectiveTimeout, ERR_MISMATCH: CollectiveMismatch, ERR_CLOSED: CommunicatorClosed}


def error_for(code, message):
    """The tpcomm exception for a tpc_result code."""
    return _CLASS_OF_CODE.get(code, TpcommError)(message, code)


def check(lib, handle, code, what):
    if code != OK:
        reason = lib.tpc_comm_last_error(handle).decode(errors="replace")
        kind = lib.tpc_result_string(code).decode()
        raise error_for(code, f"tpcomm: {what}: {kind}: {reason}")


_RESULT_TAG = re.compile(r"\[tpc_result (\d+)\]")


def translated(exc):
    """The tpcomm exception for a RuntimeError raised by a torch op of the
    extension (its message ends with "[tpc_result N]"); other errors as they are."""
    found = _RESULT_TAG.search(str(exc))
    return error_for(int(found.group(1)), str(exc)) if found else exc
