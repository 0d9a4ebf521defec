"""The environment a results file records: date, host, GPU, driver, torch,
CUDA, NCCL, Python, and NVLink multicast off."""
import datetime
import os
import platform
import subprocess

import torch

from .. import topology


def environment(world):
    env = {"date": datetime.date.today().isoformat(), "world_size": world, "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": platform.node(), "python": platform.python_version()}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - report, do not fail
        env["nccl"] = f"unknown ({e})"
    try:
        if torch.cuda.is_available() and torch.cuda.device_count():
            env["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        env["gpu_error"] = str(e)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
    except Exception as e:  # noqa: BLE001
        env["driver"] = f"unknown ({e})"
    env["multicast"] = "off (" + ", ".join(f"{k}={os.environ.get(k)}" for k in topology.MULTICAST_OFF) + ")"
    return env


def format_env(env):
    lines = []
    for k, v in env.items():
        if isinstance(v, dict):
            lines.append(f"{k:>16}:")
            lines.extend(f"{'':>18}{kk}: {vv}" for kk, vv in v.items())
        else:
            lines.append(f"{k:>16}: {v}")
    return "\n".join(lines)


def environment_text(world):
    return format_env(environment(world))
