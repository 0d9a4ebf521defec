"""Facts about where the ranks of a group run, gathered once at init."""
import os
import socket

import torch


# tpcomm's tools (benchmark, tuner, doctor, the ranks they spawn) run with
# NVLink multicast off, a documented default (docs/configuration.md): tpcomm's
# kernels never use it, so NCCL's NVLS, torch SymmetricMemory's and NVSHMEM's
# multicast would only change what tpcomm is compared against, and on hosts
# whose NVSwitch fabric is managed for several tenants (virtual machines) a
# process that sets up multicast objects can take the host's GPUs out of
# service. Set in every process that may start NCCL, torch SymmetricMemory or
# NVSHMEM (spawned children inherit it).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def force_multicast_off():
    os.environ.update(MULTICAST_OFF)


def local_facts(device):
    """What one rank knows about itself; every rank's facts are compared."""
    uuid = None
    if device.type == "cuda":
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
        except Exception:  # older torch without .uuid
            uuid = None
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "gpu_uuid": uuid}


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def nodes(facts):
    return len({(f["host"], f["boot_id"]) for f in facts})


def nvlink_between_all(uuids):
    """True / False when NVML can tell whether every pair of GPUs is joined by
    NVLink, None when it cannot (no pynvml, no NVML). GPUs are looked up by
    UUID, so CUDA_VISIBLE_DEVICES renumbering cannot confuse the answer."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByUUID(u if u.startswith("GPU-") else "GPU-" + u) for u in uuids]
        for i, a in enumerate(handles):
            for b in handles[i + 1:]:
                status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status != pynvml.NVML_P2P_STATUS_OK:
                    return False
        return True
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
