"""Shared pytest set-up for tpcomm's tests.

* The tests import tpcomm from this checkout's python/ directory (where
  `pip install --no-build-isolation -e .` puts the built extension), never
  from another installed copy.
* NVLink multicast (NVLS) stays off in this process and every process it
  spawns: these defaults are set in os.environ at import, which children
  inherit.
* Tests marked `gpu` (tests/gpu/ holds them; everything collected there is
  marked automatically) are skipped where fewer than 2 CUDA GPUs are visible,
  unless TPCOMM_SHARE_GPU=1 puts every rank on the one GPU (tests/gpu/harness.py).
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(ROOT, "python")
# TPCOMM_TEST_INSTALLED=1 tests the tpcomm installed in this Python (a
# wheel, .ci/test_wheel.sh), so this checkout's python/ stays off the path.
if os.environ.get("TPCOMM_TEST_INSTALLED") != "1" and PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

from tpcomm.topology import env_flag, force_multicast_off  # noqa: E402 - needs the path above

force_multicast_off()  # forced, never merely defaulted; spawned children inherit it

GPU_SKIP_REASON = "needs 2 CUDA GPUs, or 1 with TPCOMM_SHARE_GPU=1 (run on the device machine: see README)"
GPU_DIR = os.path.join(ROOT, "tests", "gpu") + os.sep


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (run on the device machine)")


def cuda_device_count():
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no usable torch / driver: no GPUs
        return 0


def pytest_collection_modifyitems(config, items):
    gpu_items = []
    for item in items:
        if str(item.fspath).startswith(GPU_DIR) and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") is not None:
            gpu_items.append(item)
    if gpu_items and cuda_device_count() < (1 if env_flag("TPCOMM_SHARE_GPU") else 2):
        skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
        for item in gpu_items:
            item.add_marker(skip)
