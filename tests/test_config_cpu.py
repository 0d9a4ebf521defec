"""Config (caps, timeout, table, forced and forbidden backends) read once at
init from arguments and TPCOMM_* variables, and the ranks' agreement on the
effective routing: 2- and 3-process gloo runs, no GPU."""
import inspect
import json
import logging
import os
import re
import subprocess

import pytest
import torch

import tpcomm
from tpcomm import Config, config as config_module
from multiproc import run_ranks
import source_tree

KiB, MiB = 1024, 1024 * 1024


def test_defaults_and_env(monkeypatch):
    for name in ("TPCOMM_DISABLE", "TPCOMM_TIMEOUT_S", "TPCOMM_MAX_BYTES", "TPCOMM_PACKET_MAX_BYTES",
                 "TPCOMM_TABLE", "TPCOMM_FORCE", "TPCOMM_FORBID", "TPCOMM_AITER"):
        monkeypatch.delenv(name, raising=False)
    assert Config.from_env() == Config() and Config().aiter is True
    monkeypatch.setenv("TPCOMM_MAX_BYTES", "0x400000")
    monkeypatch.setenv("TPCOMM_PACKET_MAX_BYTES", "65536")
    monkeypatch.setenv("TPCOMM_TIMEOUT_S", "2.5")
    monkeypatch.setenv("TPCOMM_FORCE", "all_gather=nccl")
    monkeypatch.setenv("TPCOMM_FORBID", "bulk")
    monkeypatch.setenv("TPCOMM_TABLE", "/some/table.json")
    monkeypatch.setenv("TPCOMM_AITER", "off")
    c = Config.from_env()
    assert c.aiter is False and c.describe()["aiter"] == "False"
    assert (c.max_bytes, c.packet_max_bytes, c.timeout_s) == (4 * MiB, 64 * KiB, 2.5)
    assert c.force == (("all_gather", "nccl"),) and c.forbid == ("bulk",) and c.table == "/some/table.json"
    assert c.replace(max_bytes=MiB, timeout_s=None).max_bytes == MiB  # None leaves a field as it is


@pytest.mark.parametrize("name,value,needle", [
    ("TPCOMM_MAX_BYTES", "lots", "TPCOMM_MAX_BYTES='lots' is not an integer"),
    ("TPCOMM_MAX_BYTES", "100", "max_bytes=100 must be a positive multiple of 16"),
    ("TPCOMM_PACKET_MAX_BYTES", "-16", "packet_max_bytes=-16 must be a positive multiple of 16"),
    ("TPCOMM_FORCE", "all_reduce", "expected op=backend pairs"),
    ("TPCOMM_FORCE", "all_reduce=fast", "force all_reduce=fast"),
    ("TPCOMM_FORCE", "all_to_all=nccl", "force all_to_all=nccl"),
    ("TPCOMM_FORBID", "nccl", "forbid 'nccl'"),
    ("TPCOMM_TIMEOUT_S", "0", "TPCOMM_TIMEOUT_S='0' must be positive"),
    ("TPCOMM_AITER", "maybe", "TPCOMM_AITER='maybe'"),
])
def test_bad_env_values_name_them(monkeypatch, name, value, needle):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Config.from_env()


def test_bad_arguments_are_refused():
    for changes in ({"max_bytes": 10}, {"max_bytes": 0}, {"packet_max_bytes": 24}, {"timeout_s": 0},
                    {"timeout_s": -1.0}, {"max_bytes": True}):
        with pytest.raises(ValueError):
            Config().replace(**changes)


@pytest.mark.parametrize("fields, needle", [
    ({"quantize": "int3"}, r"quantize='int3' must be None or one of \('fp8', 'int8', 'int4'\)"),
    ({"quantize": "INT8"}, "quantize='INT8'"),
    ({"disable": "0"}, "disable='0' must be True or False"),
    ({"aiter": 1}, "aiter=1 must be True or False"),
    ({"fused_kernel": None}, "fused_kernel=None must be True or False"),
    ({"forbid": "bulk"}, "forbid='bulk' must be a tuple of kernel names"),
    ({"forbid": ("nccl",)}, "forbid 'nccl'"),
    ({"force": {"all_reduce": "nccl"}}, "must be a tuple of \\(op, backend\\) pairs"),
    ({"force": ("all_reduce", "nccl")}, "must be a tuple of \\(op, backend\\) pairs"),
    ({"force": (("all_reduce", "fast"),)}, "force all_reduce=fast"),
    ({"table": 3}, "table=3 must be a path or None"),
    ({"timeout_s": True}, "timeout_s=True"),
    ({"timeout_s": float("nan")}, "timeout_s=nan"),
    ({"timeout_s": float("inf")}, "timeout_s=inf"),
    ({"timeout_s": 2e10}, r"timeout_s=20000000000.0 must be positive and at most 1.84e\+10"),
    ({"max_bytes": 1000}, "max_bytes=1000 must be a positive multiple of 16"),
])
def test_every_field_is_checked_when_the_config_is_made(fields, needle):
    """A bad Config raises where it is made, naming the field, not later
    when a Communicator reads it."""
    with pytest.raises(ValueError, match=needle):
        Config(**fields)


def test_good_configs_are_made():
    import pathlib

    c = Config(force=(("all_reduce", "nccl"),), forbid=("bulk", "line"), table=pathlib.Path("t.json"),
               timeout_s=1e9, quantize="int8", disable=True, aiter=False, fused_kernel=False)
    assert (c.force, c.forbid, c.quantize, c.disable) == ((("all_reduce", "nccl"),), ("bulk", "line"), "int8", True)
    assert c.replace(timeout_s=3).timeout_s == 3


def _tpcomm_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "tpcomm" and r.levelno == logging.WARNING]


def test_unknown_variables_are_warned_of_once_with_the_closest_name(monkeypatch, caplog):
    for name in [n for n in os.environ if n.startswith("TPCOMM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TPCOMM_QUANTIZ", "int8")     # a misspelt TPCOMM_QUANTIZE
    monkeypatch.setenv("TPCOMM_ZZ_NOTHING_LIKE", "1")
    for name in ("TPCOMM_SHARE_GPU", "TPCOMM_TEST_WORLD", "TPCOMM_TEST_ANYTHING", "TPCOMM_CUDA_CLANG"):
        monkeypatch.setenv(name, "1")  # the build's and the tests' own: never warned of
    with caplog.at_level(logging.WARNING, logger="tpcomm"):
        assert Config.from_env() == Config()  # ignored: quantize stays off
        Config.from_env()
    said = _tpcomm_warnings(caplog)
    assert [m for m in said if "TPCOMM_QUANTIZ " in m] == [
        "tpcomm: TPCOMM_QUANTIZ is not a tpcomm variable and is ignored (did you mean TPCOMM_QUANTIZE?)"], said
    nothing_like = [m for m in said if "TPCOMM_ZZ_NOTHING_LIKE" in m]
    assert len(nothing_like) == 1 and "tpcomm reads TPCOMM_DISABLE, " in nothing_like[0], said
    assert len(said) == 2, said


def test_known_variables_are_the_ones_read():
    """VARIABLES is what from_env reads and the module's table lists; every
    TPCOMM_* name the package, the build, scripts, CI, docs and the test
    harness use is one tpcomm knows (VARIABLES, OTHER_VARIABLES) or a
    test's (TPCOMM_TEST_*)."""
    read = set(re.findall(r"TPCOMM_[A-Z0-9_]+", inspect.getsource(Config.from_env)))
    assert read == set(config_module.VARIABLES)
    table = set(re.findall(r"^    (TPCOMM_[A-Z0-9_]+) ", config_module.__doc__, re.MULTILINE))
    assert table == set(config_module.VARIABLES)
    files = subprocess.run(["git", "ls-files"], cwd=source_tree.ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    used, constants = {}, set()
    for path in files:
        if re.match(r"tests/(gpu/)?test_\w+\.py$", path):  # test modules set unknown names on purpose
            continue
        if path.endswith((".py", ".sh", ".md", ".toml", ".yml", ".yaml", ".cfg")) or path.startswith(".ci/"):
            with open(os.path.join(source_tree.ROOT, path), errors="replace") as f:
                text = f.read()
            constants.update(re.findall(r"^(TPCOMM_\w+) = ", text, re.MULTILINE))  # Python names, not variables
            for name in re.findall(r"TPCOMM_[A-Z0-9_]+", text):
                used.setdefault(name, path)
    known = set(config_module.VARIABLES + config_module.OTHER_VARIABLES)
    unknown = {n: p for n, p in used.items()
               if n not in known | constants and not n.startswith(config_module.TEST_PREFIX)}
    assert unknown == {}, unknown
    assert known <= set(used), known - set(used)


def test_caps_within_the_c_cores_limits():
    """The largest caps the kernels take (csrc/tpcomm.h, through the
    generated constants) are accepted; one step past them is refused here,
    before any collective, naming the limit."""
    from tpcomm import _constants as C

    for name, limit in (("max_bytes", C.TPC_MAX_BYTES_LIMIT), ("packet_max_bytes", C.TPC_PACKET_MAX_BYTES_LIMIT)):
        assert getattr(Config().replace(**{name: limit}), name) == limit
        with pytest.raises(ValueError, match=f"{name}={limit + 16} is over the largest the kernels take, {limit}"):
            Config().replace(**{name: limit + 16})


def _body_routing_from_config_and_table(rank, world_size, table_path):
    comm = tpcomm.Communicator(device="cpu", table=table_path, config=Config(forbid=("bulk",)),
                               max_bytes=8 * MiB)
    assert comm.max_bytes == 8 * MiB and comm.config.forbid == ("bulk",)
    assert comm.table["about"] == "a test table"
    assert comm._routes["all_reduce"]["*"] == [(4 * KiB, "packet"), (8 * MiB, "nccl")]
    assert comm._routes["all_reduce"]["bfloat16"] == [(1 * KiB, "packet"), (8 * MiB, "nccl")]
    y = comm.all_reduce(torch.full((4,), float(rank)))  # still a working fallback on CPU
    assert torch.equal(y, torch.full((4,), float(sum(range(world_size)))))
    comm.close()


def test_routing_from_config_and_table_file(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"about": "a test table", "routes": {
        "all_reduce": {"*": {"*": [[4 * KiB, "packet"], [8 * MiB, "bulk"]], "bfloat16": [[1 * KiB, "packet"], [8 * MiB, "bulk"]]}},
        "all_gather": {"*": {"*": [[4 * KiB, "packet"], [8 * MiB, "bulk"]]}}}}))
    run_ranks(2, _body_with_table_env_ignored(str(path)))


class _body_with_table_env_ignored:
    """Picklable body: an explicit table= path wins over a TPCOMM_TABLE that
    points nowhere (were it read, the constructor would raise)."""

    def __init__(self, path):
        self.path = path

    def __call__(self, rank, world_size):
        import os
        os.environ["TPCOMM_TABLE"] = "/not/a/table.json"
        _body_routing_from_config_and_table(rank, world_size, self.path)


def _body_ranks_that_disagree_are_told(rank, world_size):
    config = Config(forbid=("bulk",)) if rank == 1 else Config()
    with pytest.raises(ValueError, match=r"would route differently.*all_reduce/\*/1: rank 0: 16777216 bulk, "
                                         r"rank 1: 16777216 nccl"):
        tpcomm.Communicator(device="cpu", config=config)
    timeout = 5.0 if rank == 2 else 10.0
    with pytest.raises(ValueError, match=r"timeout_s: rank 0: 10.0, rank 1: 10.0, rank 2: 5.0"):
        tpcomm.Communicator(device="cpu", timeout_s=timeout)
    # agreeing ranks after all of that: a working communicator
    comm = tpcomm.Communicator(device="cpu")
    assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(world_size)))
    comm.close()


def test_ranks_that_would_route_differently_all_raise():
    run_ranks(3, _body_ranks_that_disagree_are_told)


# ------------------------------------------- where the custom path is declined
#
# On CPU every rank has a local reason ("device is cpu") that comes first;
# these bodies take it away (tpcomm._group_setup.local_reason says the rank could
# run the kernels) to reach the checks of the whole group: another node, GPUs
# without NVLink between every pair, NVML unavailable, a shared GPU.

def _gpu_like(opened="the custom path was opened"):
    """Every rank's own checks pass; opening the C communicator only says
    `opened` (it is never reached when the group declines)."""
    from tpcomm import _group_setup

    _group_setup.local_reason = lambda config, world_size, device: (None, None)
    _group_setup.open_custom = lambda *args: (None, opened)


def _facts(host, uuid):
    return lambda device: {"host": host, "boot_id": "b", "gpu_uuid": uuid}


def _body_two_nodes(rank, world_size):
    from tpcomm import topology
    topology.local_facts = _facts(f"node{rank % 2}", f"GPU-{rank}")
    _gpu_like()
    comm = tpcomm.Communicator(device="cpu")
    assert comm.disabled_reason == "the group spans 2 nodes; the custom kernels are intra-node", comm.disabled_reason
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), float(world_size)))  # NCCL path works
    comm.close()


def test_a_group_across_nodes_goes_to_nccl():
    run_ranks(2, _body_two_nodes)


def _body_nvlink(rank, world_size):
    from tpcomm import _testing, topology
    topology.local_facts = _facts("one-host", f"GPU-{rank}")
    topology.nvlink_between_all = lambda uuids: False
    _gpu_like()
    comm = tpcomm.Communicator(device="cpu")
    assert comm.disabled_reason == f"{world_size} GPUs without NVLink between every pair", comm.disabled_reason
    comm.close()
    topology.nvlink_between_all = lambda uuids: None
    comm = tpcomm.Communicator(device="cpu")
    assert "NVML unavailable" in comm.disabled_reason, comm.disabled_reason
    comm.close()
    topology.local_facts = _facts("one-host", "GPU-same")
    comm = tpcomm.Communicator(device="cpu")
    assert comm.disabled_reason == "two ranks share one GPU", comm.disabled_reason
    comm.close()
    # tpcomm._testing.allow_shared_gpu (one-GPU kernel tests), on every rank,
    # lets the shared GPU through to the custom path, and the NVLink check is
    # not asked about a GPU and itself; on some ranks only, it does not.
    topology.nvlink_between_all = lambda uuids: pytest.fail(f"NVLink asked about {uuids}")
    _gpu_like(opened="custom path reached")
    _testing.allow_shared_gpu(rank != 1)
    comm = tpcomm.Communicator(device="cpu")
    assert comm.disabled_reason == "two ranks share one GPU", comm.disabled_reason
    comm.close()
    _testing.allow_shared_gpu(True)
    comm = tpcomm.Communicator(device="cpu")
    assert comm.disabled_reason == "custom path reached", comm.disabled_reason
    comm.close()
    _testing.allow_shared_gpu(False)


def test_gpus_without_nvlink_or_shared_go_to_nccl():
    run_ranks(3, _body_nvlink)


def test_shared_gpu_is_no_part_of_the_production_config(monkeypatch):
    """Sharing a GPU is a test hook (tpcomm._testing), not a Config field nor
    a variable Config reads, and not in what the ranks compare."""
    from tpcomm import _testing

    monkeypatch.setenv("TPCOMM_SHARE_GPU", "1")
    assert Config.from_env() == Config()
    assert not hasattr(Config(), "share_gpu") and "share_gpu" not in Config().describe()
    assert _testing.shared_gpu_allowed() is False
    try:
        _testing.allow_shared_gpu(True)
        assert _testing.shared_gpu_allowed() is True
    finally:
        _testing.allow_shared_gpu(False)


def _body_each_rank_names_the_rank_with_the_reason(rank, world_size):
    """A verdict names the rank it comes from: a rank with a reason of its
    own names itself; the others name the first rank that has one."""
    from tpcomm import _group_setup

    local = _group_setup.local_reason
    reasons = {0: None, 1: "no GPU here", 2: "nor here"}
    _group_setup.local_reason = lambda config, world_size, device: (reasons[rank], None)
    comm = tpcomm.Communicator(device="cpu")
    expected = {0: "rank 1: no GPU here", 1: "rank 1: no GPU here", 2: "rank 2: nor here"}[rank]
    assert comm.disabled_reason == expected and not comm.enabled, comm.disabled_reason
    comm.close()
    _group_setup.local_reason = local
    comm = tpcomm.Communicator(device="cpu")  # every rank has its own reason on CPU
    assert comm.disabled_reason == f"rank {rank}: device is cpu: the custom kernels need CUDA GPUs"
    comm.close()


def test_each_rank_names_the_rank_with_the_reason():
    run_ranks(3, _body_each_rank_names_the_rank_with_the_reason)


def _body_stats(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    assert comm.stats() == {}
    comm.all_reduce(torch.ones(8))                 # 32 bytes
    comm.all_reduce(torch.ones(4, dtype=torch.float64))  # 32 bytes
    comm.all_gather(torch.ones(2, 3), dim=1)       # 24 bytes
    assert comm.stats() == {("all_reduce", "gloo"): {"calls": 2, "bytes": 64},
                            ("all_gather", "gloo"): {"calls": 1, "bytes": 24}}, comm.stats()
    # Routes are memoised per (dtype, size) / (shape, dim) with their stats cell;
    # past the memo's bound it starts over and the counts stay right.
    from tpcomm import _route_memo

    _route_memo._ROUTE_MEMO_MAX = 2
    for n in (8, 16, 24, 8, 32, 16):
        comm.all_reduce(torch.ones(n))
    comm.reduce_scatter(torch.ones(4 * world_size))
    assert len(comm._memo["all_reduce"]) <= 2
    assert comm.stats() == {("all_reduce", "gloo"): {"calls": 8, "bytes": 64 + 4 * (8 + 16 + 24 + 8 + 32 + 16)},
                            ("all_gather", "gloo"): {"calls": 1, "bytes": 24},
                            ("reduce_scatter", "gloo"): {"calls": 1, "bytes": 16 * world_size}}, comm.stats()
    comm.close()


def test_stats_count_calls_and_bytes_per_op_and_backend():
    run_ranks(2, _body_stats)
