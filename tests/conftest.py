"""Shared pytest set-up for tpcomm's tests.

* The tests import tpcomm from this checkout's python/ directory (where
  `pip install --no-build-isolation -e .` puts the built extension), never
  from another installed copy.
* NVLink multicast (NVLS) stays off in this process and every process it
  spawns (tests/multiproc.py forces it off at import; children inherit it,
  and each spawned rank forces it again).
* Tests marked `gpu` (tests/gpu/ holds them; everything collected there is
  marked automatically) are skipped where the ranks cannot be placed on the
  visible GPUs (multiproc.gpu_skip_reason): fewer than 2 GPUs, unless
  TPCOMM_SHARE_GPU=1 lets the ranks share them; TPCOMM_TEST_WORLD sets how
  many ranks.
"""
import atexit
import os
import shutil
import sys
import tempfile

import pytest

import source_tree

ROOT = source_tree.ROOT
PYTHON_DIR = source_tree.PYTHON_DIR
# TPCOMM_TEST_INSTALLED=1 tests the tpcomm installed in this Python (a
# wheel, .ci/test_wheel.sh), so this checkout's python/ stays off the path
# (sys.path here, PYTHONPATH of every child: tests/source_tree.py).
if source_tree.testing_installed():
    sys.path[:] = [p for p in sys.path if not source_tree._in_tree(p)]
    os.environ.update(source_tree.subprocess_env())
    if not os.environ.get("PYTHONPATH"):
        os.environ.pop("PYTHONPATH", None)
elif PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

# Inductor's cache outlives a checkout, and checkouts on one machine share
# its default directory. tpcomm's fingerprint (version, pass sources, op
# schemas: tpcomm._cache_key) is in a graph's key only under compile_backend
# and TpcommPass; the tests that compile tpcomm's ops with plain inductor
# (test_compile_cpu, test_add_rms_norm_cpu) are keyed by their code alone,
# which reads the same under a checkout whose op schemas differ, so a graph
# another checkout compiled would be replayed (a stale call fails with
# "expected at most 5 argument(s)"). Each pytest session compiles into a cache
# of its own, which every spawned rank inherits through the environment.
# (test_compile_cache_cpu gives each of its ranks a directory of its own.)
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="tpcomm-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, True)

import multiproc  # noqa: E402 - tests/ is on sys.path (pytest puts conftest.py's directory there)

GPU_DIR = os.path.join(ROOT, "tests", "gpu") + os.sep


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (2 or more, or one shared with TPCOMM_SHARE_GPU=1)")


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
    if gpu_items:
        reason = multiproc.gpu_skip_reason(cuda_device_count())
        if reason:
            skip = pytest.mark.skip(reason=reason)
            for item in gpu_items:
                item.add_marker(skip)
