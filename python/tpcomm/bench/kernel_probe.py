"""Which GPU kernels NCCL runs (torch.profiler), to tell its symmetric
kernels (ncclSymk...) from its ring/tree ones: the nccl and nccl_window
cases at a small and a large size."""
import math

import torch

from .cases import Unavailable, agree, describe, make_case
from .inputs import make_input
from .vocabulary import human_bytes


def probe_nccl_kernels(ops, dtypes, backends, size_list, res, rank, world, device):
    """Kernel names of nccl and nccl_window at a small and a large size."""
    dname = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    dtype = getattr(torch, dname)
    small = min(size_list, key=lambda s: abs(math.log2(s) - 16))            # near 64 KiB
    large = max([s for s in size_list if s <= (16 << 20)] or size_list[:1])  # up to 16 MiB
    cases = []
    for op in ops:
        for backend in ("nccl", "nccl_window"):
            if backend not in backends or backend in res.reasons:
                continue
            for req in sorted({small, large}):
                numel = max(1, req // dtype.itemsize)
                x0 = make_input(rank, op, dtype, numel, device)
                try:
                    case = make_case(backend, op, x0, res)
                except Unavailable:
                    case = None
                if agree(None if case else "unavailable", world) is None:
                    cases.append((f"{op} {backend} {dname} {human_bytes(numel * dtype.itemsize)}", case))
    try:
        return probe_kernels(cases, world)
    except Exception as e:  # noqa: BLE001
        return {"error": describe(e)}


def probe_kernels(cases, world):
    """Names of the GPU kernels each case launches (torch.profiler), to tell
    NCCL's symmetric kernels (ncclSymk...) from its ring/tree ones. Collective;
    returns {key: [names] or "error: ..."} (rank 0's view)."""
    out = {}
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:  # noqa: BLE001
        return {"error": describe(e)}
    for key, case in cases:
        prof, err = None, None
        try:
            case.prepare()
            case.call()
            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as e:  # noqa: BLE001
            err = describe(e)
        err = agree(err, world)
        if err:
            out[key] = f"error: {err}"
            continue
        try:
            for _ in range(2):
                case.call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            err = describe(e)
        try:
            prof.__exit__(None, None, None)
            names = sorted({e.name for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA})
            names = [n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()]
            out[key] = [n[:120] for n in names[:8]] or "no GPU kernel recorded"
        except Exception as e:  # noqa: BLE001
            out[key] = f"error: {describe(e)}"
        err = agree(err, world)
        if err:
            out[key] = f"error: {err}"
    return out
