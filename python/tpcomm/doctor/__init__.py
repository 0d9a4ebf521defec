"""`tpcomm doctor` (or `python -m tpcomm.doctor`): what a user runs first and
pastes into a bug report. It reports, in plain lines:

  - tpcomm's version (with the label naming the CUDA it was built for),
    Python, torch, its CUDA / ROCm and NCCL versions;
  - the driver and the GPUs, with the NVLink / P2P links between them (NVML
    through nvidia-ml-py when it imports, else `nvidia-smi topo -m`, else
    torch's can_device_access_peer);
  - whether the compiled extension loads, and why not;
  - the routing table in force and its bands for this world size;
  - every TPCOMM_* variable set (and the NCCL / multicast ones), checked;
  - with 2 or more GPUs (or --share-gpu on one), a short self-test: each
    collective run by tpcomm and by torch.distributed on the same inputs,
    compared bit for bit, with the latency of each.

The inputs of the self-test are small integers, so every sum is exact in any
order and tpcomm's results must equal torch.distributed's bit for bit; the
fused add + RMSNorm is held to 0 ulp on its residual output and 1 ulp on the
normed output (its mean of squares is summed in another order than torch's).

Exit status: 0 when nothing is wrong (a machine without GPUs included), 1
when something is (the extension does not load, a TPCOMM_* variable is bad,
a self-test result differs or fails).

Here main() and its options; the report's parts in facts.py (versions,
driver, GPUs and links, extension, environment), routing_bands.py (the
routing table and the sizes each op takes), self_test.py (the collectives
against torch.distributed over spawned ranks) and report.py (the output)."""
import argparse

from .facts import env_facts, extension_facts, gpu_facts, version_facts
from .report import Report
from .routing_bands import routing_facts
from .self_test import run_self_test


def build_parser():
    parser = argparse.ArgumentParser(prog="tpcomm doctor", description="Checks this machine for tpcomm and "
                                     "prints a report to paste into a bug report.")
    parser.add_argument("--share-gpu", action="store_true",
                        help="run the self-test with every rank on GPU 0 (a check of results on one GPU)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks in the self-test (default: every visible GPU; 2 with --share-gpu)")
    parser.add_argument("--no-self-test", action="store_true", help="report only; run no collective")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per self-test case (default 50)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on the self-test in seconds")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.world_size is not None and not 2 <= args.world_size <= 8:
        build_parser().error("--world-size must be 2..8")
    if args.iters < 1:
        build_parser().error("--iters must be at least 1")
    report = Report()
    print("tpcomm doctor")
    version_facts(report)
    count = gpu_facts(report)
    loaded = extension_facts(report)
    config = env_facts(report)
    world = args.world_size or (2 if args.share_gpu else max(count, 2))
    routing_facts(report, world, config)
    report.section("summary")
    if count == 0:
        report.line("no GPUs", "nothing to self-test on this machine")
    elif args.no_self_test:
        report.line("self-test", "skipped (--no-self-test)")
    elif count < 2 and not args.share_gpu:
        report.line("self-test", "needs 2 GPUs (or --share-gpu to check results on one)")
    elif not args.share_gpu and args.world_size and args.world_size > count:
        report.problem("self-test", f"--world-size {args.world_size} but {count} GPUs visible")
    elif not loaded or config is None:
        report.line("self-test", "skipped: fix the problems above first")
    else:
        run_self_test(report, count, args.share_gpu, args.world_size, args.iters, args.timeout)
        report.section("summary")
    if report.problems:
        report.line(f"{len(report.problems)} problem(s)")
        for p in report.problems:
            report.line(f"  {p}")
        return 1
    report.line("ok", "no problems found")
    return 0


