"""The standalone CUDA probes under benchmarks/: latency_probe.cu (the stage
timings behind docs/design.md's "where the time goes") and scale_probe.cu
(the kernels at 2..8 ranks) are compiled against the current kernels (their
device code to PTX: see _compile), so they cannot drift from the code they
measure, and their `list` modes (no GPU needed) must name every row the
device run times;
bandwidth_probe.cu (the NVLink transfer rates behind the bulk kernels'
design) and racecheck_stream_start.cu (compute-sanitizer's reports on the
streamed kernels' start) must compile warning-free; norm_fp8_probe.cu (the
FP8 epilogue's local cost) too, as a probe and as its driver's library.
Timing needs 2 GPUs (norm_fp8_probe: one)."""
import os
import re
import subprocess

import pytest

from cuda_toolkit import NEEDS_NVCC, NVCC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_nvcc = pytest.mark.skipif(NVCC is None, reason=NEEDS_NVCC)

SIZES = (64, 2048, 16384, 65536, 262144, 1048576)
# Every kernel the default run times at each size: the real ones, through
# launch.cu's entry points, and the variants that each leave one stage out.
ROWS_PER_SIZE = (
    "all_reduce packet (tpcomm)",
    "  without the header check",
    "  ... in two loops (push all, then wait)",
    "  ... with a packed bf16 sum",
    "  without PDL",
    "  after an ordinary kernel",
    "all_reduce bulk (tpcomm)",
    "all_gather packet (tpcomm)",
    "  the general kernel (any dim)",
    "  dim 0, header in thread 0's wait",
    "all_gather bulk (tpcomm)",
)
FLOOR_ROWS = ("empty kernel", "empty kernel, PDL", "+ device epoch, header sent", "+ one packet each way",
              "+ its input loaded, output stored", "epoch by atomic add")


# The device code goes to PTX for compute_90 without NVVM's optimiser: the
# front end sees every template the probe instantiates and warns as the -O3
# sm_90 build does, in a sixth of its time (about 25 s a probe on 2 cores, not
# 160). ptxas and the optimiser run where the probes are timed
# (scripts/device_run.sh) and, for the kernels, in tests/test_kernel_resources.py.
DEVICE_FRONT_END_ONLY = ["-gencode=arch=compute_90,code=compute_90", "-Xcicc", "-O0"]


def _compile(probe, exe, *extra):
    """nvcc with scripts/device_run.sh's flags, warnings as errors, the device
    code to unoptimised PTX; extra: more sources and flags."""
    _compile_side_by_side([(probe, exe, *extra)])


def _compile_side_by_side(builds):
    """_compile for each (probe, exe, *extra) of builds, all at once (nvcc
    uses one core a build)."""
    procs = [subprocess.Popen([NVCC, "-O3", "-std=c++17", *DEVICE_FRONT_END_ONLY, "-Werror", "all-warnings", "-I",
                               os.path.join(ROOT, "csrc"), os.path.join(ROOT, "benchmarks", probe), *extra,
                               "-o", str(exe)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for probe, exe, *extra in builds]
    try:
        for proc, (probe, exe, *_) in zip(procs, builds):
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{probe} -> {exe.name}:\n{out[-4000:]}"
    finally:  # a failed or timed-out build ends the others
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def latency_probe(tmp_path_factory):
    exe = tmp_path_factory.mktemp("probe") / "latency_probe"
    _compile("latency_probe.cu", exe)
    return exe


def _rows(exe, *args):
    """(name, bytes) of every row `exe list [args]` prints."""
    proc = subprocess.run([str(exe), "list", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = []
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"(.*?)\s+(\d+) B", line)
        assert m, f"not a row: {line!r}"
        rows.append((m.group(1), int(m.group(2))))
    return rows


@needs_nvcc
def test_latency_probe_lists_every_stage(latency_probe):
    rows = _rows(latency_probe)
    names = [name for name, _ in rows]
    for name in FLOOR_ROWS:
        assert (name, 0) in rows, f"{name!r} missing from {names}"
    for size in SIZES:
        at_size = [name for name, n in rows if n == size]
        for name in ROWS_PER_SIZE:
            assert name.strip() in [r.strip() for r in at_size], f"{name!r} at {size} B missing: {at_size}"
    # the straight-line variant exists only where one block of threads holds every unit
    assert [n for name, n in rows if name.strip() == "... and without the sum"] == [64, 2048]


@needs_nvcc
def test_latency_probe_quick_leaves_out_256k(latency_probe):
    full, quick = _rows(latency_probe), _rows(latency_probe, "quick")
    assert quick == [row for row in full if row[1] != 262144]
    assert len(quick) < len(full)


def test_probe_packet_variants_start_as_the_kernels_do():
    """The probe's packet variants begin through the kernels' own prologue
    (tpc_packet_prologue), so a stage they time is the kernels' stage; only
    the floor variants, which time the op's start itself, call tpc_op_begin."""
    src = open(os.path.join(ROOT, "benchmarks", "latency_probe.cu")).read()
    bodies = dict(re.findall(r"__global__ void (\w+)(\(.*?\n}\n)", src, flags=re.S))
    start = src.split("#define PROBE_PACKET_START", 1)[1].split("\n\n", 1)[0]
    assert "tpc_packet_prologue(" in start
    for k in ("probe_packet_no_header", "probe_packets_no_sum", "probe_packets_two_loops", "probe_gather"):
        assert "PROBE_PACKET_START(" in bodies[k], k
    assert {k for k, body in bodies.items() if "tpc_op_begin" in body} == {"probe_epoch", "probe_ping",
                                                                           "probe_ping_load"}


@pytest.fixture(scope="module")
def scale_probe(tmp_path_factory):
    exe = tmp_path_factory.mktemp("probe") / "scale_probe"
    _compile("scale_probe.cu", exe)
    return exe


@needs_nvcc
@pytest.mark.parametrize("world", [2, 3, 8])
def test_scale_probe_lists_every_kernel_at_every_world_size(scale_probe, world):
    """scale_probe.cu times the packet exchange with one peer and with every
    peer, then every op's kernels at each size they take: two_shot only from
    one warp step of lines per rank (more than 448 * (world - 1) bytes)."""
    exe = scale_probe
    rows = _rows(exe, str(world))
    assert rows[:2] == [("one packet, one peer (ring)", 0), ("one packet, every peer", 0)]
    sizes = (64, 2048, 16384, 65536, 262144, 524288)
    for op, kernels in (("all_reduce", ("packet", "line", "two_shot", "bulk")),
                        ("reduce_scatter", ("packet", "line", "bulk")), ("all_gather", ("packet", "line", "bulk"))):
        for kernel in kernels:
            want = [n for n in sizes if kernel != "two_shot" or n > 448 * (world - 1)]
            assert [n for name, n in rows if name == f"{op} {kernel}"] == want, (op, kernel)
    in_turn = [n for name, n in rows if name.strip() == "peers waited in turn"]
    assert in_turn == [n for n in sizes if n <= 65536]  # beside the packet all_reduce's rows
    assert len(rows) == 2 + 10 * len(sizes) - sum(n <= 448 * (world - 1) for n in sizes) + len(in_turn)
    bad = subprocess.run([str(exe), "list", "9"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "2..8" in bad.stderr


@needs_nvcc
def test_bandwidth_probe_compiles_warning_free(tmp_path):
    _compile("bandwidth_probe.cu", tmp_path / "bandwidth_probe")


@needs_nvcc
def test_racecheck_stream_start_builds_from_the_kernels_start(tmp_path):
    """racecheck_stream_start.cu (the racecheck reproduction behind
    scripts/sanitize_expect.py's rules) starts its control-warp variant as
    the streamed kernels do (tpc_stream_op_begin), so it cannot drift from
    them; it compiles warning-free and refuses an unknown mode."""
    src = open(os.path.join(ROOT, "benchmarks", "racecheck_stream_start.cu")).read()
    assert "tpc_stream_op_begin(&a)" in src and "tpc_bulk_acquire(" in src
    exe = tmp_path / "racecheck_stream_start"
    _compile("racecheck_stream_start.cu", exe)
    bad = subprocess.run([str(exe), "neither"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "control|data" in bad.stderr


@needs_nvcc
def test_norm_fp8_probe_lists_what_its_driver_reads_and_asks_the_rules(tmp_path, monkeypatch):
    """norm_fp8_probe.cu (issue 48 item 5) builds warning-free as the probe
    and as the library benchmarks/norm_fp8_probe.py loads; its rows are every
    shape of the issue with no epilogue and each of the driver's modes, in
    the form the driver parses; limits.c, linked in, refuses 1 and 9 ranks
    and the probe a row width that is not whole groups of 128, before any
    GPU call. Its phase build (the kernel's marks defined) builds
    warning-free too and lists the same rows."""
    import ctypes
    import importlib.util

    limits = os.path.join(ROOT, "csrc", "core", "limits.c")
    exe, lib = tmp_path / "norm_fp8_probe", tmp_path / "libnorm_fp8_probe.so"
    phases = tmp_path / "norm_fp8_probe_phases"
    _compile_side_by_side([("norm_fp8_probe.cu", exe, limits),
                           ("norm_fp8_probe.cu", lib, limits, "-shared", "-Xcompiler", "-fPIC",
                            "-DNORM_FP8_PROBE_LIBRARY"),
                           ("norm_fp8_probe.cu", phases, limits, "-DNORM_FP8_PROBE_PHASES")])
    spec = importlib.util.spec_from_file_location("norm_fp8_probe", os.path.join(ROOT, "benchmarks", "norm_fp8_probe.py"))
    driver = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its graph_timing, beside it
    spec.loader.exec_module(driver)
    listed = subprocess.run([str(exe), "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows == [[str(t), str(h), q] for t in (8, 32, 256) for h in (4096, 8192) for q in ("none",) + driver.MODES]
    listed_phases = subprocess.run([str(phases), "list"], capture_output=True, text=True, timeout=60)
    assert listed_phases.returncode == 0 and listed_phases.stdout == listed.stdout, listed_phases.stderr
    for n in ("1", "9"):
        bad = subprocess.run([str(exe), n], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "takes 2..8 ranks (limits.c), not " + n in bad.stderr
    for hidden in ("100", "0"):  # row widths after the ranks: whole FP8 groups
        bad = subprocess.run([str(exe), "2", "4096", hidden], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and f"hidden {hidden} is not a positive multiple of 128" in bad.stderr
    library = ctypes.CDLL(str(lib))
    assert library.nfp_open(1) == 2  # refused by the rules, before any CUDA call
    for name in ("nfp_set", "nfp_check_shape", "nfp_launch", "nfp_check_errors"):
        assert hasattr(library, name), name
