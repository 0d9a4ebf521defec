"""tpcomm.integrations.vllm's logic, on a stand-in for vLLM
(tests/data/vllm_stand_in: the module paths, names and signatures the plugin
uses, checked against the pinned release by tests/test_vllm_contract.py) and
gloo groups of 2 ranks: the plugin is inactive unless VLLM_PLUGINS names it,
the platform names tpcomm's communicator, calls tpcomm takes go to it (its
stats) and the rest reach vLLM's CudaCommunicator, and destroy closes it.

On CPU tpcomm's own Communicator turns its custom path off, so the routing
tests give the plugin FakeTpcomm, an object with the Communicator's
kernel-or-None interface whose "kernels" take contiguous fp32 and bf16 calls
of at most FAKE_KERNEL_MAX_BYTES; the real Communicator is used end to end in
test_real_tpcomm_through_vllm_group.
"""
import functools
import importlib
import inspect
import logging
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm.integrations import vllm as plugin
from tpcomm.integrations.vllm_contract import COMMUNICATOR_INIT

from bitexact import exact_values, expected_sum
from multiproc import run_ranks
import source_tree

HERE = os.path.dirname(os.path.abspath(__file__))
STAND_IN = os.path.join(HERE, "data", "vllm_stand_in")
ROOT = os.path.dirname(HERE)
ENTRY_POINT_GROUP = "vllm.platform_plugins"
ENTRY_POINT = "tpcomm.integrations.vllm:register"
FAKE_KERNEL_MAX_BYTES = 1024


# ------------------------------------------------------------ stand-ins

def _forget_vllm():
    """Drops the imported stand-in and the plugin's classes built over it."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    for name in plugin._LAZY:
        plugin.__dict__.pop(name, None)


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-in importable as `vllm` for one test."""
    _forget_vllm()
    monkeypatch.syspath_prepend(STAND_IN)
    import vllm

    assert getattr(vllm, "STAND_IN", False), vllm.__file__
    yield vllm
    _forget_vllm()


def _entry_point_dir(where):
    """A distribution on disk declaring the plugin's entry point, as
    pyproject.toml declares it for the installed package."""
    info = os.path.join(where, "tpcomm_entry_point_probe-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: tpcomm-entry-point-probe\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[{ENTRY_POINT_GROUP}]\ntpcomm = {ENTRY_POINT}\n")
    return str(where)


class FakeTpcomm:
    """tpcomm.Communicator's interface as the plugin uses it. Its "kernels"
    take contiguous fp32/bf16 inputs of 1..FAKE_KERNEL_MAX_BYTES and compute
    with gloo on the group; the custom_* methods return None for the rest,
    as the Communicator's do. `opened` counts constructions."""

    opened = 0
    enabled = True
    disabled_reason = None

    def __init__(self, group, device):
        FakeTpcomm.opened += 1
        self.group, self.device = group, device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.calls = Counter()
        self.closed = False

    def _takes(self, op, x):
        assert not self.closed, f"{op} after close"
        takes = (x.dtype in (torch.float32, torch.bfloat16) and 0 < x.nbytes <= FAKE_KERNEL_MAX_BYTES
                 and x.is_contiguous())
        self.calls[op] += takes
        return takes

    def custom_all_reduce(self, x):
        if not self._takes("all_reduce", x):
            return None
        y = x.clone()
        dist.all_reduce(y, group=self.group)
        return y

    def custom_all_gather(self, x, dim=0):
        if not self._takes("all_gather", x):
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim)

    def custom_reduce_scatter(self, x, dim=0):
        if not self._takes("reduce_scatter", x):
            return None
        y = x.clone()
        dist.all_reduce(y, group=self.group)
        return y.chunk(self.world_size, dim)[self.rank].contiguous()

    def stats(self):
        return {(op, "packet"): {"calls": n} for op, n in self.calls.items() if n}

    def close(self):
        self.closed = True


class FakeTpcommOff(FakeTpcomm):
    enabled = False
    disabled_reason = "off in this test"


# ------------------------------------------------------------------ import

def test_importing_tpcomm_leaves_the_integrations_out():
    code = "import sys, tpcomm; print(sorted(m for m in sys.modules if m.startswith(('tpcomm.integrations', 'vllm'))))"
    env = source_tree.subprocess_env()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_without_vllm_the_module_imports_and_its_classes_say_why_not(monkeypatch):
    _forget_vllm()
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as where it is not installed
    module = importlib.reload(plugin)
    assert module.PLATFORM_QUALNAME == "tpcomm.integrations.vllm.TpcommCudaPlatform"
    for name in ("TpcommCudaPlatform", "TpcommCudaCommunicator"):
        with pytest.raises(ImportError, match="tpcomm.integrations.vllm needs vLLM"):
            getattr(module, name)
    with pytest.raises(ImportError, match="needs vLLM"):
        module.register()
    with pytest.raises(AttributeError):
        module.NoSuchThing


# ---------------------------------------------------------------- register

@pytest.mark.parametrize("value, active", [(None, False), ("", False), ("other", False), ("tpcomm", True),
                                           ("other,tpcomm", True), ("tpcomm2", False)])
def test_register_is_active_only_when_vllm_plugins_names_it(stand_in, monkeypatch, value, active):
    if value is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    assert plugin.register() == (plugin.PLATFORM_QUALNAME if active else None)


def test_register_stays_inactive_without_cuda(stand_in, monkeypatch, caplog):
    import vllm.platforms

    monkeypatch.setenv("VLLM_PLUGINS", "tpcomm")
    monkeypatch.setattr(vllm.platforms, "CUDA_FOUND", False)
    with caplog.at_level(logging.WARNING, logger="tpcomm"):
        assert plugin.register() is None
    assert "no CUDA platform" in caplog.text


def test_entry_point_selects_the_platform_only_when_asked(stand_in, monkeypatch, tmp_path):
    import vllm.platforms

    monkeypatch.syspath_prepend(_entry_point_dir(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vllm.platforms.resolve_current_platform_cls_qualname() == "vllm.platforms.cuda.CudaPlatform"
    monkeypatch.setenv("VLLM_PLUGINS", "tpcomm")
    assert vllm.platforms.resolve_current_platform_cls_qualname() == plugin.PLATFORM_QUALNAME


def test_pyproject_declares_the_entry_point_tested_here():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project.get("entry-points", {}).get(ENTRY_POINT_GROUP) == {"tpcomm": ENTRY_POINT}, (
        f"pyproject.toml must declare the {ENTRY_POINT_GROUP} entry point vLLM loads tpcomm by")


# ---------------------------------------------------------------- classes

def test_platform_names_tpcomms_communicator(stand_in):
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.platforms import resolve_obj_by_qualname
    from vllm.platforms.cuda import CudaPlatform

    platform_cls = resolve_obj_by_qualname(plugin.PLATFORM_QUALNAME)
    assert platform_cls is plugin.TpcommCudaPlatform and issubclass(platform_cls, CudaPlatform)
    platform = platform_cls()
    assert platform.is_cuda()  # the rest of vLLM's CUDA platform is inherited
    assert CudaPlatform().get_device_communicator_cls() != plugin.COMMUNICATOR_QUALNAME
    comm_cls = resolve_obj_by_qualname(platform.get_device_communicator_cls())
    assert comm_cls is plugin.TpcommCudaCommunicator and issubclass(comm_cls, CudaCommunicator)
    for cls in (platform_cls, comm_cls):
        assert f"{cls.__module__}.{cls.__qualname__}" in (plugin.PLATFORM_QUALNAME, plugin.COMMUNICATOR_QUALNAME)


def test_communicator_takes_what_vllm_passes(stand_in):
    params = list(inspect.signature(plugin.TpcommCudaCommunicator.__init__).parameters)[1:]
    assert params == list(COMMUNICATOR_INIT)


def test_fake_tpcomm_has_the_real_communicators_interface():
    for name in ("custom_all_reduce", "custom_all_gather", "custom_reduce_scatter", "stats", "close"):
        real = list(inspect.signature(getattr(tpcomm.Communicator, name)).parameters)
        fake = list(inspect.signature(getattr(FakeTpcomm, name)).parameters)
        assert real[:len(fake)] == fake, (name, real, fake)
    assert isinstance(inspect.getattr_static(tpcomm.Communicator, "enabled"), property)
    assert "self.disabled_reason" in inspect.getsource(tpcomm.Communicator.__init__)


# ------------------------------------------------------ 2 ranks, routing

def _made(cls, group, name, **kwargs):
    return cls(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name=name, **kwargs)


def _routing_body(rank, world_size):
    sys.path.insert(0, STAND_IN)
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    cls = plugin.communicator_class(CudaCommunicator, open_tpcomm=FakeTpcomm)
    group = dist.new_group(backend="gloo")
    c = _made(cls, group, "tp:0")
    assert isinstance(c.tpcomm, FakeTpcomm) and c.tpcomm_reason is None
    fake = c.tpcomm

    def check(op, expect_tpcomm, result, expected):
        assert result.dtype == expected.dtype and result.shape == expected.shape, (op, result.shape, expected.shape)
        assert torch.equal(result, expected), op
        assert (fake.calls[op], c.calls[op]) == expect_tpcomm, (op, fake.calls, c.calls)

    # all_reduce: fp32/bf16 up to 1 KiB to tpcomm; larger, or int64, to vLLM's.
    cases = [((4, 8), torch.float32, (1, 0)), ((2, 8), torch.bfloat16, (2, 0)), ((64, 8), torch.float32, (2, 1)),
             ((4, 8), torch.int64, (2, 2)), ((4, 8), torch.float32, (3, 2))]
    for seed, (shape, dtype, counts) in enumerate(cases):
        check("all_reduce", counts, c.all_reduce(exact_values(rank, shape, dtype, seed)),
              expected_sum(world_size, shape, dtype, seed))
    # not contiguous: declined (as vLLM's own custom all-reduce declines it), vLLM's path runs
    check("all_reduce", (3, 3), c.all_reduce(exact_values(rank, (8, 4), torch.float32, 5).t()),
          expected_sum(world_size, (8, 4), torch.float32, 5).t())

    # all_gather along any dim (negative ones too) where tpcomm takes the size.
    def gathered(shape, dtype, dim):
        return torch.cat([exact_values(r, shape, dtype, 7) for r in range(world_size)], dim)
    for dim, shape, dtype, counts in [(-1, (2, 4), torch.float32, (1, 0)), (0, (2, 4), torch.float32, (2, 0)),
                                      (1, (3, 2, 4), torch.bfloat16, (3, 0)), (0, (2, 4), torch.int32, (3, 1)),
                                      (-1, (128, 4), torch.float32, (3, 2))]:
        check("all_gather", counts, c.all_gather(exact_values(rank, shape, dtype, 7), dim), gathered(shape, dtype, dim))

    # reduce_scatter: dims 0 and 1 (where vLLM's layout is the parts along
    # dim) to tpcomm; dim 2 and parts that do not divide to vLLM's.
    def scattered(shape, dtype, dim):
        return expected_sum(world_size, shape, dtype, 9).chunk(world_size, dim)[rank].contiguous()
    for dim, shape, counts in [(0, (4, 8), (1, 0)), (-1, (4, 8), (2, 0)), (1, (2, 4, 4), (3, 0))]:
        check("reduce_scatter", counts, c.reduce_scatter(exact_values(rank, shape, torch.float32, 9), dim),
              scattered(shape, torch.float32, dim))
    x = exact_values(rank, (2, 4, 4), torch.float32, 9)
    y = c.reduce_scatter(x, 2)  # vLLM's result for dim 2 of a 3-d input: its own layout, kept
    assert (fake.calls["reduce_scatter"], c.calls["reduce_scatter"]) == (3, 1)
    assert y.shape == (4, 2, 4 // world_size)
    with pytest.raises(AssertionError):  # 3 rows over 2 ranks: vLLM's own check
        c.reduce_scatter(exact_values(rank, (3, 8), torch.float32, 9), 0)
    assert (fake.calls["reduce_scatter"], c.calls["reduce_scatter"]) == (3, 2)

    assert fake.stats()[("all_reduce", "packet")]["calls"] == 3
    c.destroy()
    assert fake.closed and c.destroyed and c.tpcomm is None


def _declines_body(rank, world_size):
    sys.path.insert(0, STAND_IN)
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    cls = plugin.communicator_class(CudaCommunicator, open_tpcomm=FakeTpcomm)
    group = dist.new_group(backend="gloo")
    x = exact_values(rank, (4, 8), torch.float32)

    def declined(c, reason):
        assert c.tpcomm is None and reason in c.tpcomm_reason, c.tpcomm_reason
        assert torch.equal(c.all_reduce(x), expected_sum(world_size, (4, 8), torch.float32))
        assert c.calls["all_reduce"] == 1
        c.destroy()
        assert c.destroyed

    declined(_made(cls, group, "dp:0"), "not a tensor-parallel group")
    declined(_made(cls, group, "tpx:0"), "not a tensor-parallel group")
    declined(_made(cls, group, "tp:1", tcp_store_group=object()), "stateless group")
    parallel_state._ENABLE_CUSTOM_ALL_REDUCE = False
    declined(_made(cls, group, "tp:2"), "custom all-reduce is off")
    parallel_state._ENABLE_CUSTOM_ALL_REDUCE = True
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    declined(_made(cls, group, "tp:3"), "VLLM_BATCH_INVARIANT")
    del os.environ["VLLM_BATCH_INVARIANT"]
    assert FakeTpcomm.opened == 0  # none of these groups opened one

    off = _made(plugin.communicator_class(CudaCommunicator, open_tpcomm=FakeTpcommOff), group, "tp:4")
    assert FakeTpcomm.opened == 1
    declined(off, "off in this test")


def test_tp_calls_tpcomm_takes_go_to_it_the_rest_to_vllm():
    run_ranks(2, _routing_body)


def test_groups_and_settings_where_tpcomm_is_not_used():
    run_ranks(2, _declines_body)


# -------------------------------------------- 2 ranks, the real Communicator

def _real_body(rank, world_size, entry_dir):
    sys.path.insert(0, STAND_IN)
    sys.path.insert(0, entry_dir)
    from vllm.distributed import parallel_state

    group = dist.new_group(backend="gloo")
    coordinator = parallel_state.initialize_model_parallel(group, group, torch.device("cpu"))
    c = coordinator.device_communicator
    assert type(c).__qualname__ == "TpcommCudaCommunicator", type(c)
    # tpcomm's custom path needs CUDA GPUs: its Communicator says so, and
    # the plugin leaves every call to vLLM's communicator.
    assert c.tpcomm is None and "cpu" in c.tpcomm_reason, c.tpcomm_reason
    x = exact_values(rank, (4, 8), torch.float32)
    assert torch.equal(coordinator._all_reduce_out_place(x), expected_sum(world_size, (4, 8), torch.float32))
    gathered = torch.cat([exact_values(r, (4, 8), torch.float32) for r in range(world_size)], 1)
    assert torch.equal(coordinator._all_gather_out_place(x, -1), gathered)
    part = expected_sum(world_size, (4, 8), torch.float32).chunk(world_size)[rank]
    assert torch.equal(coordinator._reduce_scatter_out_place(x, 0), part)
    assert dict(c.calls) == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}
    coordinator.destroy()
    assert c.destroyed


def test_real_tpcomm_through_vllm_group(tmp_path):
    """VLLM_PLUGINS=tpcomm, the entry point, the stand-in's platform choice
    and GroupCoordinator, and tpcomm's own Communicator on CPU."""
    body = functools.partial(_real_body, entry_dir=_entry_point_dir(tmp_path))
    run_ranks(2, body, env={"VLLM_PLUGINS": "tpcomm"})
