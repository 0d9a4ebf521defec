"""`tpcomm doctor` on a machine without GPUs: it runs, says there are no GPUs,
reports whether the extension loads and the TPCOMM_* variables in force,
and exits 0, or 1 with the problem named when a variable is bad."""
import os
import subprocess
import sys

import pytest
import torch

import tpcomm
from tpcomm import _lib, cli, doctor
from tpcomm.doctor import facts, self_test
from tpcomm.doctor.report import Report
from tpcomm.doctor.routing_bands import routed_bands

import source_tree


def run_doctor(*args, module="tpcomm.doctor", **env):
    """The doctor in a fresh interpreter, importing the tpcomm these tests import, with no GPU visible."""
    full_env = {k: v for k, v in source_tree.subprocess_env().items() if not k.startswith("TPCOMM_")}
    full_env.update(CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=full_env,
                          timeout=300)


def extension_loads():
    try:
        _lib.load()
        return True
    except ImportError:
        return False


def test_doctor_without_gpus_says_so_and_exits_0():
    out = run_doctor(TPCOMM_TIMEOUT_S="7")
    assert out.returncode == (0 if extension_loads() else 1), out.stdout + out.stderr
    text = out.stdout
    assert "GPUs: no GPUs visible to torch (CUDA_VISIBLE_DEVICES='')" in text
    assert "no GPUs: nothing to self-test on this machine" in text
    assert f"torch: {torch.__version__}" in text
    assert f"tpcomm: {tpcomm.__version__} from {os.path.dirname(tpcomm.__file__)}" in text
    assert "TPCOMM_TIMEOUT_S: '7'" in text
    assert "CUDA_VISIBLE_DEVICES: ''" in text
    if extension_loads():
        assert "loads: yes (torch.ops.tpcomm registered)" in text
        assert "ok: no problems found" in text
    # the routing table in force, for the default world size of 2
    assert "== routing (world size 2)" in text and "(shipped, for " in text
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert f"\n{op} (own row): <= " in text, op


def test_doctor_names_a_bad_variable_and_exits_1():
    out = run_doctor(TPCOMM_DISABLE="maybe")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "PROBLEM" in out.stdout and "TPCOMM_DISABLE='maybe'" in out.stdout
    assert "1 problem(s)" in out.stdout or "problem(s)" in out.stdout


def test_doctor_marks_a_variable_tpcomm_does_not_read():
    out = run_doctor("--no-self-test", TPCOMM_QUANTIZ="int8", TPCOMM_TEST_WORLD="2")
    assert "TPCOMM_QUANTIZ: 'int8' (not a tpcomm variable: did you mean TPCOMM_QUANTIZE?)" in out.stdout, out.stdout
    assert "TPCOMM_TEST_WORLD: '2'\n" in out.stdout, out.stdout  # the tests' own: no mark


def test_doctor_reports_a_table_that_cannot_be_read(tmp_path):
    out = run_doctor(TPCOMM_TABLE=str(tmp_path / "missing.json"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "table: PROBLEM: routing table" in out.stdout and "missing.json" in out.stdout


def test_doctor_table_rows_follow_the_world_size():
    out = run_doctor("--world-size", "8", "--no-self-test")
    assert "== routing (world size 8)" in out.stdout
    assert "all_reduce ('*' row)" in out.stdout  # the shipped table has no row of its own for 8
    # the shipped table measured no cap on the fused norm kernel: the cost model's, 1.5 MiB * 8 / (7 * 5)
    assert ("fused norm: fused kernel family up to 359511 B per rank, larger: split or unfused "
            "(cost-model default, not measured)") in out.stdout, out.stdout


def _routing_lines(text):
    return {line.split(" (")[0]: line.split(": ", 1)[1] for line in text.splitlines()
            if line.startswith(("all_reduce (", "all_gather (", "reduce_scatter ("))}


def test_doctor_routing_lines_apply_the_caps():
    default = _routing_lines(run_doctor("--world-size", "2", "--no-self-test").stdout)
    # the shipped h200 table sends all_reduce to bulk up to 64 MiB; the default max_bytes (16 MiB) sends the rest to NCCL
    assert default["all_reduce"].endswith("<= 16 MiB bulk, larger: nccl"), default
    assert default["all_gather"].endswith("<= 8 MiB bulk, larger: nccl"), default  # 2 ranks' output within 16 MiB
    raised = _routing_lines(run_doctor("--world-size", "2", "--no-self-test", TPCOMM_MAX_BYTES=str(64 << 20)).stdout)
    assert raised["all_reduce"].endswith("<= 64 MiB bulk, larger: nccl"), raised
    small = _routing_lines(run_doctor("--world-size", "2", "--no-self-test",
                                      TPCOMM_PACKET_MAX_BYTES=str(64 << 10)).stdout)
    assert small["all_reduce"] == "<= 64 KiB packet, <= 16 MiB bulk, larger: nccl", small  # no line band past the cap
    assert small["reduce_scatter"].startswith("<= 128 KiB packet, "), small  # the cap is per part: 2 parts


def test_routed_bands_follow_routing_route():
    from tpcomm import _constants as C, routing

    routes = {"all_reduce": {"*": [(1 << 10, "packet"), (1 << 30, "bulk")]}}
    caps = routing.Caps(4, 1 << 20, 512, C.TPC_PLATFORM_CUDA)
    assert routed_bands(routes, caps, "all_reduce", torch.float32) == [(512, "packet"), (1 << 20, "bulk")]
    assert routed_bands(routes, caps, "all_reduce", torch.int32) == []  # no kernel reduces int32
    for limit, backend in routed_bands(routes, caps, "all_reduce", torch.float32):
        assert routing.route(routes, caps, "all_reduce", torch.float32, limit) == backend


@pytest.mark.parametrize("args,needle", [(["--world-size", "1"], "--world-size must be 2..8"),
                                         (["--iters", "0"], "--iters must be at least 1"),
                                         (["--bogus"], "unrecognized arguments: --bogus")])
def test_doctor_refuses_bad_arguments(args, needle):
    out = run_doctor(*args)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_console_script_runs_the_doctor_and_tells_its_version():
    out = run_doctor("doctor", "--no-self-test", module="tpcomm.cli")
    assert "== versions" in out.stdout and "no GPUs" in out.stdout, out.stdout + out.stderr
    version = run_doctor("--version", module="tpcomm.cli")
    assert version.returncode == 0 and version.stdout.startswith(f"tpcomm {tpcomm.__version__}"), version
    unknown = run_doctor("frobnicate", module="tpcomm.cli")
    assert unknown.returncode == 2 and "invalid choice: 'frobnicate'" in unknown.stderr


def test_cli_main_dispatches_to_the_doctor(monkeypatch):
    seen = []
    monkeypatch.setattr(doctor, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["doctor", "--share-gpu"]) == 0
    assert seen == [["--share-gpu"]]


@pytest.mark.parametrize("command,module", [("bench", "tpcomm.bench.__main__"), ("tune", "tpcomm.tune")])
def test_cli_main_dispatches_bench_and_tune_with_their_options(monkeypatch, command, module):
    import importlib

    seen = []
    monkeypatch.setattr(importlib.import_module(module), "main", lambda argv: seen.append(argv) or 3)
    assert cli.main([command, "--dtypes", "float32"]) == 3
    assert seen == [["--dtypes", "float32"]]


@pytest.mark.parametrize("command,option", [("bench", "--max-bytes"), ("tune", "--from"), ("doctor", "--share-gpu")])
def test_each_command_prints_its_own_help(command, option):
    out = run_doctor(command, "--help", module="tpcomm.cli")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"usage: tpcomm {command}") and option in out.stdout, out.stdout


def test_cli_help_lists_every_command():
    out = run_doctor("--help", module="tpcomm.cli")
    assert out.returncode == 0
    for command in ("doctor", "bench", "tune"):
        assert f"    {command}" in out.stdout, out.stdout


def test_linked_runtime_is_read_from_the_library(tmp_path):
    lib = tmp_path / "fake.so"
    lib.write_bytes(b"\x7fELF...\0libc10.so\0libcudart.so.12\0libc.so.6\0")
    assert facts._linked_runtime(str(lib)) == "libcudart.so.12"
    lib.write_bytes(b"\x7fELF\0libamdhip64.so.6\0")
    assert facts._linked_runtime(str(lib)) == "libamdhip64.so.6"
    lib.write_bytes(b"\x7fELF\0libc.so.6\0")
    assert facts._linked_runtime(str(lib)) is None
    assert facts._linked_runtime(str(tmp_path / "absent.so")) is None


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("nbytes", self_test.SELF_TEST_BYTES)
def test_self_test_inputs_have_exact_sums(world, nbytes):
    """The self-test's bit-for-bit comparison rests on this: small integers,
    whose bf16 sums over 8 ranks are exact in any order, in a length every
    kernel and reduce_scatter's split by rank take, the same on every run."""
    x = self_test._rank_inputs(1, "all_reduce", nbytes, torch.bfloat16, world)
    assert x.dtype == torch.bfloat16 and x.numel() % (8 * world) == 0
    assert x.numel() * 2 <= nbytes and x.numel() * 2 > nbytes - 16 * world
    assert torch.equal(x, x.round()) and int(x.abs().max()) <= 8
    assert torch.equal(x, self_test._rank_inputs(1, "all_reduce", nbytes, torch.bfloat16, world))
    assert not torch.equal(x, self_test._rank_inputs(2, "all_reduce", nbytes, torch.bfloat16, world))
    total = sum(self_test._rank_inputs(r, "all_reduce", nbytes, torch.bfloat16, world).float() for r in range(8))
    assert torch.equal(total.to(torch.bfloat16).float(), total)  # |sum| <= 64: exact in bf16


def test_a_failed_self_test_row_is_a_problem():
    report = Report(out=open(os.devnull, "w"))
    self_test._report_row(report, {"op": "all_reduce", "bytes": 8192, "route": "packet", "ok": True,
                                "tpcomm_s": 5e-6, "torch_s": 2e-5})
    assert report.problems == []
    self_test._report_row(report, {"op": "all_gather", "bytes": 8192, "route": "packet", "ok": False})
    assert report.problems == ["all_gather 8 KiB/rank: via packet, DIFFERS from torch.distributed"]


def test_self_test_runs_every_collective_over_spawned_ranks(capsys):
    """The self-test's machinery (spawned ranks, the comparison agreed on by
    every rank, per-rank results, the report) on the CPU over gloo, where the
    Communicator falls back to torch.distributed: every op matches, and the
    custom path being off is reported as the problem it would be on GPUs."""
    report = Report()
    self_test.run_self_test(report, 0, False, 2, 1, 240, on_cpu=True, sizes=(8 * 1024,))
    text = capsys.readouterr().out
    assert "== self-test (2 ranks on cpu, tpcomm against torch.distributed/gloo)" in text
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert f"\n{op} 8 KiB/rank: via gloo (custom path off), bit-exact, tpcomm " in text, op  # what ran
    assert "all_reduce_add_rms_norm 128 KiB/rank: via unfused (custom path off), residual_out 0 ulp, normed 0 ulp" in text
    assert len(report.problems) == 1 and report.problems[0].startswith("communicator: custom path off"), \
        report.problems
