"""Runs each example's CPU mode and the README's core snippet on gloo many
times and counts the runs that did not exit 0, and among them the aborts at
interpreter exit (`terminate called without an active exception`, SIGABRT):

    python scripts/exit_stress.py --runs 50 --out benchmarks/results/exit_stress_cpu.txt
    python scripts/exit_stress.py --runs 20 --cases readme_core,tp_functional --root /tmp/other-checkout

Each run is a fresh launch as a user types it (torchrun or the example's own
--cpu launcher), in a temporary working directory; --root picks the checkout
whose examples, README and python/ run. docs/testing.md (The exit-time abort)
says why this is not in the test suite and what it showed.
"""
import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABORT = re.compile(r"terminate called|Aborted|SIGABRT|exitcode\s*:\s*-6")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]

# The README's core snippet is written for GPUs; these edits make it the same
# program on gloo. Each must match exactly once, so a README change that moves
# them stops this script instead of running something else.
README_TO_GLOO = [(r"^torch\.cuda\.set_device\(.*\n", ""),
                  (r'dist\.init_process_group\("nccl"\)', 'dist.init_process_group("gloo")'),
                  (r'device="cuda"', 'device="cpu"')]


def readme_core(root):
    """The README's core snippet (the python block after "Its core"), on gloo."""
    with open(os.path.join(root, "README.md")) as f:
        text = f.read()
    found = re.search(r"Its core[^\n]*\n+```python\n(.*?)```", text, re.DOTALL)
    if not found:
        raise SystemExit("exit_stress: no python block after 'Its core' in README.md")
    code = found.group(1)
    for pattern, replacement in README_TO_GLOO:
        code, n = re.subn(pattern, replacement, code, flags=re.MULTILINE)
        if n != 1:
            raise SystemExit(f"exit_stress: README core snippet: {pattern!r} matched {n} times, expected 1")
    return code


def cases(root):
    """{name: (argv, extra environment)}; argv may name files under the run's directory as {tmp}."""
    ex = os.path.join(root, "examples")
    return {
        "quickstart": (TORCHRUN + [os.path.join(ex, "quickstart.py")], {}),
        "readme_core": (TORCHRUN + ["{tmp}/readme_core.py"], {}),
        "tp_functional": ([sys.executable, os.path.join(ex, "tp_functional.py"), "--cpu"], {}),
        "tp_decode": ([sys.executable, os.path.join(ex, "tp_decode.py"), "--tiny", "--cpu", "--batches", "1,3",
                       "--context", "16"], {}),
        "hf_llama_tp": (TORCHRUN + [os.path.join(ex, "hf_llama_tp.py"), "--tiny", "--cpu", "--layers", "2",
                                    "--reps", "2", "--batches", "1,3"], {"OMP_NUM_THREADS": "1"}),
        "quantized_accuracy": ([sys.executable, os.path.join(ex, "quantized_accuracy.py"), "--tiny", "--cpu",
                                "--train-steps", "3", "--batch", "4", "--eval-tokens", "256", "--prompts", "4",
                                "--tp", "2", "--checkpoint", "{tmp}/w.pt", "--out", "{tmp}/acc.json"], {}),
    }


def run_once(argv, extra, root, timeout_s):
    """(exit status, aborted, seconds, what tells why: the lines that name an
    abort or an exit code, and the output's end) of one launch."""
    with tempfile.TemporaryDirectory(prefix="tpcomm-exit-stress-") as tmp:
        with open(os.path.join(tmp, "readme_core.py"), "w") as f:
            f.write(readme_core(root))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TMPDIR=tmp, **extra)
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "python")] + [p for p in
                                            env.get("PYTHONPATH", "").split(os.pathsep) if p])
        begin = time.monotonic()
        try:
            proc = subprocess.run([a.replace("{tmp}", tmp) for a in argv], cwd=tmp, env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code, out = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        telling = [line for line in out.splitlines() if ABORT.search(line) or "exitcode" in line]
        return code, bool(ABORT.search(out)), time.monotonic() - begin, "\n".join(telling[:12] + [out[-800:]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--cases", default=",".join(cases(HERE)), help="comma-separated (default: every case)")
    p.add_argument("--root", default=HERE, help="the checkout to run (default: this one)")
    p.add_argument("--out", help="also append the table to this file")
    p.add_argument("--label", default="", help="said in the table's heading (e.g. what the checkout holds)")
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args(argv)
    table = cases(args.root)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in table]
    if unknown:
        raise SystemExit(f"exit_stress: unknown cases {unknown}; known: {list(table)}")
    rows = []
    for name in chosen:
        failed = aborted = 0
        seconds = []
        for i in range(args.runs):
            code, abort, s, tail = run_once(*table[name], args.root, args.timeout_s)
            seconds.append(s)
            if code != 0:
                failed += 1
                aborted += abort
                print(f"{name} run {i + 1}: exit {code}{' (abort)' if abort else ''}\n{tail}", flush=True)
            else:
                print(f"{name} run {i + 1}: ok ({s:.0f} s)", flush=True)
        rows.append((name, args.runs, failed, aborted, sorted(seconds)[len(seconds) // 2]))
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.root, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=args.root,
                           capture_output=True, text=True).stdout.strip()
    lines = [f"# scripts/exit_stress.py --runs {args.runs}: {datetime.date.today()}, torch {torch.__version__}, "
             f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, commit {commit}{' + changes' if dirty else ''}"
             + (f": {args.label}" if args.label else ""),
             f"{'case':20s} {'runs':>5s} {'non-zero exits':>15s} {'aborts':>7s} {'median s':>9s}"]
    lines += [f"{n:20s} {r:5d} {f:15d} {a:7d} {s:9.1f}" for n, r, f, a, s in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 1 if any(f for _, _, f, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
