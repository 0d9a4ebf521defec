"""What a user gets from installing and importing tpcomm, without a GPU: the
ops registered at import, the console script, the typing marker, the
license, logging said once, and TPCOMM_* variables checked by name."""
import logging
import os
import subprocess
import sys

import pytest

import tpcomm
from tpcomm import _log, config
from multiproc import run_ranks
import source_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_alone_registers_the_ops():
    """A fresh interpreter that only imports tpcomm can name every op: the
    public group-name family torch.ops.tpcomm.* (and no other op in that
    namespace) and the internal torch.ops._tpcomm.*."""
    code = ("import torch, tpcomm\n"
            "for name in ('custom_all_reduce', 'custom_all_gather', 'custom_reduce_scatter', 'custom_all_reduce_add_rms_norm',\n"
            "             'custom_all_reduce_add_rms_norm_fp8'):\n"
            "    print(getattr(torch.ops.tpcomm, name).default._schema)\n"
            "for name in ('all_reduce', 'all_reduce_out', 'all_gather', 'reduce_scatter', 'reduce_scatter_f32',\n"
            "             'all_reduce_norm_out'):\n"
            "    print(getattr(torch.ops._tpcomm, name).default._schema)\n"
            "print('public:', sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith('tpcomm::')))\n")
    env = source_tree.subprocess_env()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("tpcomm::") and "str group_name" in line for line in lines) == 5, out.stdout
    assert sum(line.startswith("_tpcomm::") and "int comm_id" in line for line in lines) == 6, out.stdout
    assert lines[-1] == ("public: ['tpcomm::custom_all_gather', 'tpcomm::custom_all_reduce', "
                         "'tpcomm::custom_all_reduce_add_rms_norm', 'tpcomm::custom_all_reduce_add_rms_norm_fp8', "
                         "'tpcomm::custom_reduce_scatter']"), lines[-1]


def test_inductor_pass_as_the_readme_names_it():
    """`tpcomm.inductor_pass.TpcommPass()` after a plain `import tpcomm`, as the
    README writes it, in a fresh interpreter that had not imported inductor
    before that attribute was named."""
    code = ("import sys, tpcomm\n"
            "print('inductor before:', 'torch._inductor.custom_graph_pass' in sys.modules)\n"
            "p = tpcomm.inductor_pass.TpcommPass()\n"
            "print(type(p).__name__, p.uuid() == tpcomm.inductor_pass.TpcommPass().uuid())\n"
            "try:\n"
            "    tpcomm.no_such_attribute\n"
            "except AttributeError as e:\n"
            "    print('AttributeError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=source_tree.subprocess_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["inductor before: False", "TpcommPass True",
                                       "AttributeError: module 'tpcomm' has no attribute 'no_such_attribute'"], out.stdout


def test_console_script_and_metadata():
    """What pyproject.toml declares (read from the checkout, so the test
    needs no installed copy): one console script (`tpcomm`, whose commands
    include the benchmark), the license, torch as the only run-time
    dependency (setup.py's, by the build's CUDA); and the typing marker."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["scripts"] == {"tpcomm": "tpcomm.cli:main"}
    assert project["license"] == {"text": "Apache-2.0"}
    assert "dependencies" in project["dynamic"] and "dependencies" not in project
    assert os.path.exists(os.path.join(ROOT, "python", "tpcomm", "py.typed"))
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(200)


def test_log_once_says_each_message_once(caplog):
    caplog.set_level(logging.INFO, logger="tpcomm")
    message = "tpcomm: a message for test_log_once_says_each_message_once"
    assert _log.log_once(logging.INFO, message) is True
    assert _log.log_once(logging.INFO, message) is False
    assert [r.getMessage() for r in caplog.records].count(message) == 1


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), (" ON ", True), ("yes", True),
                                            ("", False), ("0", False), ("off", False), ("No", False)])
def test_env_flag_values(monkeypatch, value, expected):
    monkeypatch.setenv("TPCOMM_TEST_FLAG", value)
    assert config.env_flag("TPCOMM_TEST_FLAG") is expected


@pytest.mark.parametrize("value", ["2", "maybe", "enable"])
def test_env_flag_bad_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("TPCOMM_TEST_FLAG", value)
    with pytest.raises(ValueError, match=f"TPCOMM_TEST_FLAG='{value}'"):
        config.env_flag("TPCOMM_TEST_FLAG")


@pytest.mark.parametrize("value,needle", [("abc", "is not a number"), ("0", "must be positive"),
                                          ("-3", "must be positive"), ("nan", "must be positive")])
def test_env_float_bad_value_names_the_variable(monkeypatch, value, needle):
    monkeypatch.setenv("TPCOMM_TEST_SECONDS", value)
    with pytest.raises(ValueError, match=f"TPCOMM_TEST_SECONDS='{value}' {needle}"):
        config.env_positive_float("TPCOMM_TEST_SECONDS", 10.0)


def test_env_float_default_and_value(monkeypatch):
    monkeypatch.delenv("TPCOMM_TEST_SECONDS", raising=False)
    assert config.env_positive_float("TPCOMM_TEST_SECONDS", 10.0) == 10.0
    monkeypatch.setenv("TPCOMM_TEST_SECONDS", "2.5")
    assert config.env_positive_float("TPCOMM_TEST_SECONDS", 10.0) == 2.5


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


def _body_logs_the_reason_once(rank, world_size):
    handler = _Records()
    logging.getLogger("tpcomm").addHandler(handler)
    logging.getLogger("tpcomm").setLevel(logging.DEBUG)
    comms = [tpcomm.Communicator(device="cpu") for _ in range(3)]
    off = [m for level, m in handler.messages if level == logging.WARNING and "custom path off" in m]
    assert len(off) == 1, handler.messages
    assert comms[0].disabled_reason in off[0]
    for comm in comms:
        comm.close()


def test_communicator_logs_why_the_custom_path_is_off_once():
    run_ranks(2, _body_logs_the_reason_once)


def _body_bad_timeout_variable(rank, world_size):
    with pytest.raises(ValueError, match="TPCOMM_TIMEOUT_S='soon' is not a number"):
        tpcomm.Communicator(device="cpu")


def test_bad_timeout_variable_names_it():
    run_ranks(2, _body_bad_timeout_variable, env={"TPCOMM_TIMEOUT_S": "soon"})


def _body_bad_disable_variable(rank, world_size):
    with pytest.raises(ValueError, match="TPCOMM_DISABLE='sometimes'"):
        tpcomm.Communicator(device="cpu")


def test_bad_disable_variable_names_it():
    run_ranks(2, _body_bad_disable_variable, env={"TPCOMM_DISABLE": "sometimes"})
