"""The README's quick start, run as the README writes it, on a machine
without GPUs: 2 ranks on gloo through tpcomm's fallback. The example checks
every result itself and exits non-zero on any mismatch; here it must exit 0
and print its closing check."""
import os
import re
import shlex
import subprocess
import sys

import source_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_quickstart_command():
    """The torchrun line of the README's quick start, as a list of words."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    lines = re.findall(r"^torchrun .*examples/quickstart\.py.*$", text, re.MULTILINE)
    assert len(lines) == 1, f"expected one torchrun line for the quick start in README.md, found {lines}"
    return shlex.split(lines[0])


def test_quickstart_on_two_gloo_ranks(tmp_path):
    words = readme_quickstart_command()
    assert "--nproc-per-node=2" in words
    # torchrun is `python -m torch.distributed.run`: the same launcher, from this interpreter.
    command = [sys.executable, "-m", "torch.distributed.run"] + words[1:]
    before, tmp = source_tree.git_status(), tmp_path / "tmp"
    tmp.mkdir()
    env = source_tree.subprocess_env(CUDA_VISIBLE_DEVICES="", TMPDIR=str(tmp))
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert source_tree.git_status() == before and source_tree.tpcomm_leftovers(tmp) == []  # writes nothing
    assert "quickstart: all checks passed on 2 ranks" in proc.stdout, output[-4000:]
    assert "custom path: off (" in proc.stdout  # no GPUs: the fallback ran, and said why
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_add_rms_norm"):
        assert re.search(rf"^{op} ", proc.stdout, re.MULTILINE), f"{op} line missing:\n{proc.stdout}"
    # the route printed is what ran, as stats() names it: gloo's fallback, not NCCL
    assert re.search(r"^all_reduce .* -> gloo$", proc.stdout, re.MULTILINE), proc.stdout
    assert "nccl" not in proc.stdout.lower(), proc.stdout
