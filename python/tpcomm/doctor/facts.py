"""The doctor's facts about this machine: versions (tpcomm, Python, torch,
CUDA / ROCm, NCCL), the driver, the GPUs and the links between them, the
compiled extension (does it load, which runtime it links), and the
TPCOMM_* variables in force, checked."""
import ctypes
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

# Variables shown besides TPCOMM_*: the ones that change what NCCL, torch's
# symmetric memory or the CUDA runtime do under tpcomm.
OTHER_ENV = ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
             "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG")


def version_facts(report):
    import torch

    import tpcomm

    report.section("versions")
    try:
        installed = importlib.metadata.version("tpcomm")
    except importlib.metadata.PackageNotFoundError:
        installed = "not installed as a package (imported from a source tree)"
    report.line("tpcomm", f"{tpcomm.__version__} from {os.path.dirname(tpcomm.__file__)}")
    report.line("tpcomm distribution", installed)
    report.line("python", f"{platform.python_version()} ({sys.executable})")
    report.line("platform", f"{platform.platform()} on {socket.gethostname()}")
    report.line("torch", torch.__version__)
    report.line("torch CUDA", torch.version.cuda or "none")
    if torch.version.hip:
        report.line("torch ROCm (HIP)", torch.version.hip)
    report.line("NCCL (torch's)", _nccl_version())


def _nccl_version():
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001 - a CPU-only torch has no NCCL
        return f"unavailable ({e})"
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def _driver_version():
    """(driver version string or None, how it was found)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return (version.decode() if isinstance(version, bytes) else version), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml or no NVML: the next way
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.split()[0], "nvidia-smi"
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"supports CUDA {version.value // 1000}.{version.value % 1000 // 10}", "libcuda"
    except (OSError, AttributeError):
        pass
    return None, "no NVIDIA driver found (no NVML, nvidia-smi or libcuda.so.1)"


def gpu_facts(report):
    """Reports the driver, the GPUs and their links; returns the GPU count."""
    import torch

    report.section("driver and GPUs")
    driver, how = _driver_version()
    report.line("driver", f"{driver} ({how})" if driver else how)
    try:
        count = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001
        report.line("GPUs", f"none usable ({e})")
        return 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        report.line("GPUs", "no GPUs visible to torch" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                                           if visible is not None else ""))
        return 0
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        report.line(f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability "
                                f"{p.major}.{p.minor}, uuid {getattr(p, 'uuid', '?')}")
    report.section("GPU links")
    for line in _topology_lines(count):
        report.line(line)
    return count


def _topology_lines(count):
    """NVLink / P2P between the visible GPUs, by the best source available."""
    lines = _nvml_topology(count)
    if lines:
        return lines
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return ["(nvidia-smi topo -m)"] + out.stdout.rstrip().splitlines()
        except (OSError, subprocess.TimeoutExpired):
            pass
    import torch

    lines = ["(torch.cuda.can_device_access_peer; install nvidia-ml-py for NVLink facts)"]
    for a in range(count):
        peers = [str(b) for b in range(count) if b != a and torch.cuda.can_device_access_peer(a, b)]
        lines.append(f"GPU {a} reaches by P2P: {', '.join(peers) or 'none'}")
    return lines


def _nvml_topology(count):
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no pynvml or no NVML
        return None
    try:
        handles = []
        for i in range(count):  # by UUID: CUDA_VISIBLE_DEVICES renumbers GPUs, NVML does not
            uuid = str(torch.cuda.get_device_properties(i).uuid)
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid))
        lines = ["(NVML)"]
        for i, h in enumerate(handles):
            links = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break
            lines.append(f"GPU {i}: {links} NVLinks active")
        for i, a in enumerate(handles):
            for j in range(i + 1, count):
                nvlink = pynvml.nvmlDeviceGetP2PStatus(a, handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                p2p = pynvml.nvmlDeviceGetP2PStatus(a, handles[j], pynvml.NVML_P2P_CAPS_INDEX_READ)
                ok = pynvml.NVML_P2P_STATUS_OK
                lines.append(f"GPU {i} - GPU {j}: NVLink {'yes' if nvlink == ok else 'no'}, "
                             f"P2P read {'yes' if p2p == ok else 'no'}")
        return lines
    except Exception as e:  # noqa: BLE001 - report what NVML could not tell
        return [f"(NVML could not tell: {e})"]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _linked_runtime(path):
    """The GPU runtime the library names (libcudart.so.13, libamdhip64.so.6), read from its bytes."""
    try:
        with open(path, "rb") as f:
            found = re.search(rb"lib(cudart|amdhip64)\.so\.\d+", f.read())
    except OSError:
        return None
    return found.group(0).decode() if found else None


def extension_facts(report):
    import torch

    from .. import _lib

    report.section("extension")
    try:
        path = _lib.library_path()
    except ImportError as e:
        report.problem("tpcomm._C", str(e))
        return False
    report.line("tpcomm._C", path)
    runtime = _linked_runtime(path)
    report.line("links", runtime or "no CUDA or HIP runtime named")
    loaded = True
    try:
        _lib.load()
        report.line("loads", "yes (torch.ops.tpcomm registered)")
    except ImportError as e:
        report.problem("loads", f"no: {e}")
        loaded = False
    if runtime and runtime.startswith("libcudart.so.") and torch.version.cuda:
        built, running = runtime.rsplit(".", 1)[1], torch.version.cuda.split(".")[0]
        if built != running:
            report.problem("CUDA major", f"the extension was built for CUDA {built}, torch runs CUDA "
                                         f"{torch.version.cuda}: install the tpcomm wheel for CUDA {running}")
    if loaded:
        report.line("eager fast path", "bound" if _lib.fastpath() is not None else "not built (eager calls go "
                                                                                   "through the torch op)")
    return loaded


def env_facts(report):
    """Reports the variables in force; returns the checked Config, or None when one is bad."""
    from ..config import Config, unknown_variables

    report.section("environment")
    names = sorted(n for n in os.environ if n.startswith("TPCOMM_")) + [n for n in OTHER_ENV if n in os.environ]
    unknown = {name: f" (not a tpcomm variable: did you mean {closest}?)" if closest else " (not a tpcomm variable)"
               for name, closest in unknown_variables()}
    for name in names:
        report.line(name, repr(os.environ[name]) + unknown.get(name, ""))
    if not names:
        report.line("(no TPCOMM_* variables set)")
    try:
        config = Config.from_env()
        if hasattr(config, "checked"):
            config = config.checked()
    except ValueError as e:
        report.problem("TPCOMM_* variables", str(e))
        return None
    return config
