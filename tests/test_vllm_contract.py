"""Everything tpcomm.integrations.vllm uses from vLLM (its CONTRACT, in
tpcomm.integrations.vllm_contract) exists, with those parameters, in the
pinned vLLM release: the wheel's sources are parsed, not imported (vLLM
imports only with its CUDA build and dependencies). The wheel comes from PyPI
(pip download); outside CI a machine without network skips that test. The
stand-in the plugin's logic tests run on (tests/data/vllm_stand_in) is
checked against the same contract, and the reader is shown to see changes."""
import os
import re
import sys

import pytest

from pinned_wheel import read_sources
from tpcomm.integrations import vllm_contract
from tpcomm.integrations.vllm_contract import CONTRACT, PINNED, gaps

STAND_IN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vllm_stand_in")
# The pinned release publishes one manylinux wheel (pure abi3 for CPython >= 3.8);
# naming its platform lets any machine download it.
WHEEL_PLATFORM = "manylinux_2_28_x86_64"


def _read_stand_in(path):
    with open(os.path.join(STAND_IN, path), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def pinned_sources(tmp_path_factory):
    return read_sources(PINNED, CONTRACT, tmp_path_factory.mktemp("vllm"),
                        pip_args=("--only-binary", ":all:", "--platform", WHEEL_PLATFORM))


def test_pin_is_one_release():
    assert re.fullmatch(r"vllm==\d+\.\d+\.\d+", PINNED), PINNED


def test_pinned_release_has_everything_the_plugin_uses(pinned_sources):
    assert gaps(pinned_sources.__getitem__) == []


def test_stand_in_has_the_same_interface():
    assert gaps(_read_stand_in) == []


def _changed(path, old, new):
    """The stand-in's sources with one text change in one file."""
    def read(p):
        text = _read_stand_in(p)
        if p == path:
            assert old in text, (path, old)
            text = text.replace(old, new)
        return text
    return read


COMM = "vllm/distributed/device_communicators/cuda_communicator.py"


@pytest.mark.parametrize("path, old, new, expected", [
    (COMM, "def all_reduce(self, input_)", "def all_reduce(self, tensor)", "CudaCommunicator.all_reduce: takes"),
    (COMM, "def all_gather(self, input_, dim=-1)", "def all_gather(self, input_)", "CudaCommunicator.all_gather"),
    (COMM, "def destroy(self)", "def close(self)", "CudaCommunicator.destroy: not defined"),
    (COMM, "self.use_custom_allreduce = use_custom_allreduce", "pass", "does not set self.use_custom_allreduce"),
    (COMM, "tcp_store_group=None, use_all2all", "tcp_store_group=None, extra=None, use_all2all", "__init__: takes"),
    (COMM, '!= "tp"', '!= "tensor"', "has no string 'tp'"),
    (COMM, ".movedim(0, dim).contiguous()", ".contiguous()", "does not call input_.movedim"),
    ("vllm/distributed/parallel_state.py", "use_all2all=False,", "use_all2all=False, is_tp=True,",
     "calls device_comm_cls with keywords ['is_tp']"),
    ("vllm/distributed/parallel_state.py", "self.device_communicator.all_gather(", "self.device_communicator.gather(",
     "does not call self.device_communicator.all_gather"),
    ("vllm/plugins/__init__.py", '"vllm.platform_plugins"', '"vllm.platforms"', "is 'vllm.platforms'"),
    ("vllm/plugins/__init__.py", "envs.VLLM_PLUGINS", "envs.VLLM_PLUGIN_LIST", "does not read envs.VLLM_PLUGINS"),
    ("vllm/envs.py", '"VLLM_BATCH_INVARIANT":', '"VLLM_DETERMINISTIC":', "has no key 'VLLM_BATCH_INVARIANT'"),
    ("vllm/platforms/cuda.py", "CudaPlatform = NvmlCudaPlatform", "Platform = NvmlCudaPlatform",
     "CudaPlatform: not defined"),
])
def test_reader_sees_a_change(path, old, new, expected):
    found = gaps(_changed(path, old, new))
    assert len(found) == 1 and expected in found[0], found


def test_a_missing_file_is_a_gap():
    def read(path):
        raise FileNotFoundError(path)
    found = gaps(read, {"vllm/nowhere.py": {"f": {}}})
    assert found == ["vllm/nowhere.py: cannot be read (FileNotFoundError: vllm/nowhere.py)"]


def test_installed_reader_needs_vllm_installed(monkeypatch):
    monkeypatch.setattr(vllm_contract.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="vllm is not installed"):
        vllm_contract.installed_reader()


def test_installed_reader_reads_the_package_found(monkeypatch):
    monkeypatch.syspath_prepend(STAND_IN)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    assert gaps(vllm_contract.installed_reader()) == []
