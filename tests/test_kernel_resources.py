"""The kernels as ptxas builds them for sm_90 (H100/H200), compiled here from
csrc/kernels/launch.cu with the build's nvcc flags, ptxas run as nvcc runs it, with -v.

A launch asks for the registers of its whole block at once: a kernel given
more registers than its largest block allows fails at launch ("too many
resources requested") on the GPU only, where no CPU test would see it. So
every kernel launch.cu starts either carries that largest block as its
__launch_bounds__ (ptxas then keeps the registers within it), or has few
enough registers for it. Spills and stack frames go to local memory, slow on
the hot path: none is allowed but the ones listed below with their reason."""
import os
import re
import subprocess

import pytest

import cuda_toolkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

# The flags setup.py gives nvcc for a CUDA build (torch's BuildExtension adds
# the half/bfloat16 ones and --expt-relaxed-constexpr), for sm_90.
NVCC_FLAGS = ["-O3", "-std=c++17", "-DUSE_CUDA", "--expt-relaxed-constexpr", "-D__CUDA_NO_HALF_OPERATORS__",
              "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-D__CUDA_NO_HALF2_OPERATORS__", "-gencode=arch=compute_90,code=sm_90"]

# Kernels that spill under their register cap, and why. A kernel that stops
# spilling must leave this table (the test says so).
KNOWN_SPILLS = {
    "tpc_all_reduce_norm_kernel":
        "its __launch_bounds__ of TPC_BLOCK_THREADS + a control warp (17 warps) caps it at 96 registers, "
        "and a row's TPC_NORM_UNITS packet units are held in registers (the instantiation for rows wider than "
        "TPC_NORM_FEW_UNITS units a thread; the few-units one does not spill)",
    "tpc_all_gather_bulk_kernel":
        "a 32-byte frame in local memory at 56 registers, so not register pressure (its bound allows far "
        "more): an array the streamed gather step indexes at run time is the candidate (all_gather.cuh)",
}


def _define(path, name):
    """The integer a #define in csrc/<path> gives `name`, read by name."""
    text = open(os.path.join(CSRC, path)).read()
    found = re.search(rf"^#define {name} (\d+)\b", text, re.MULTILINE)
    assert found, f"no '#define {name} <integer>' in csrc/{path}"
    return int(found.group(1))


def _base(mangled):
    """tpc_x_kernel from _Z..tpc_x_kernelILi0EEv15tpc_kernel_args and the like."""
    found = re.search(r"(tpc_\w+?_kernel)", mangled)
    return found.group(1) if found else None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(ptxas report per function, .maxntid per kernel) of launch.cu for sm_90."""
    ptxas, out = cuda_toolkit.tool("ptxas"), tmp_path_factory.mktemp("kernels")
    if ptxas is None:
        pytest.skip(f"{cuda_toolkit.NEEDS_NVCC}, with its ptxas, to build the kernels")
    src, ptx = os.path.join(CSRC, "kernels", "launch.cu"), out / "launch.ptx"
    # The PTX nvcc gives ptxas for sm_90, then ptxas as nvcc runs it, over the
    # kernels in two halves side by side: ptxas builds each entry on its own.
    flags = [f for f in NVCC_FLAGS if not f.startswith("-gencode")]
    proc = subprocess.run([cuda_toolkit.NVCC, *flags, "-arch=compute_90", "-ptx", src, "-o", str(ptx)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = ptx.read_text()
    entries = re.findall(r"\.entry (\w+)\(", text)
    assert entries, "no kernel in launch.ptx"
    halves = [subprocess.Popen([ptxas, "-arch=sm_90", "-m64", "-v", "-e", ",".join(entries[i::2]), str(ptx),
                                "-o", str(out / f"launch{i}.cubin")], stderr=subprocess.PIPE, text=True)
              for i in range(2)]
    errors = [half.communicate(timeout=600)[1] for half in halves]
    for half, err in zip(halves, errors):
        assert half.returncode == 0, err[-4000:]
    stderr = "".join(errors)
    report = {}  # mangled function -> {"stack", "spill_stores", "spill_loads", "registers"}
    current = None
    for line in stderr.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            current = report.setdefault(m.group(1), {})
        elif current is not None and (m := re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
    missing = set(entries) - set(report)
    assert not missing, f"kernels ptxas did not report: {sorted(missing)}"
    bounds = {}  # kernel -> .maxntid, or None
    for chunk in text.split(".entry ")[1:]:
        head = chunk[:chunk.index("{")]
        found = re.search(r"\.maxntid (\d+), 1, 1", head)
        bounds[_base(head.split("(")[0])] = int(found.group(1)) if found else None
    return report, bounds


def largest_blocks():
    """Kernel -> the most threads launch.cu launches it with: streamed kernels
    (tpc_stream_geometry) TPC_STREAM_WARPS_PER_BLOCK warps, every other kernel
    TPC_BLOCK_THREADS; a control warp on top of both."""
    control = _define("kernels/op.cuh", "TPC_CONTROL_THREADS")
    block = _define("tpcomm.h", "TPC_BLOCK_THREADS") + control
    streamed = (_define("kernels/stream.cuh", "TPC_STREAM_WARPS_PER_BLOCK")
                * _define("kernels/stream.cuh", "TPC_STREAM_LANES") + control)
    launch = open(os.path.join(CSRC, "kernels", "launch.cu")).read()
    blocks = {}
    for call in re.findall(r"tpc_launch\((.*?)\);", launch, re.DOTALL):
        for kernel in re.findall(r"\b(tpc_\w+_kernel)\b", call):
            blocks[kernel] = streamed if "tpc_stream_geometry" in call else block
    return blocks


def max_threads_per_block(registers):
    """The largest block sm_80/sm_90 can hold with `registers` a thread: 65536
    registers an SM in 4 scheduler partitions, allocated per warp in units of
    256 (the CUDA occupancy calculator's model), at most 1024 threads."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    return min(1024, 4 * (16384 // per_warp) * 32)


def test_every_launched_kernel_is_built_and_every_built_kernel_launched(built):
    _, bounds = built
    assert set(bounds) == set(largest_blocks()), (sorted(bounds), sorted(largest_blocks()))
    assert len(bounds) >= 10


def test_launch_bounds_are_the_largest_block(built):
    """A kernel with __launch_bounds__ has exactly the block launch.cu gives it:
    smaller would fail at launch, larger would cap its registers for nothing."""
    _, bounds = built
    blocks = largest_blocks()
    wrong = {k: (b, blocks[k]) for k, b in bounds.items() if b is not None and b != blocks[k]}
    assert not wrong, f"kernel: (.maxntid, largest block launch.cu uses): {wrong}"
    assert any(b is not None for b in bounds.values())


def test_registers_allow_the_largest_block(built):
    report, bounds = built
    blocks = largest_blocks()
    kernels = {_base(name): props for name, props in report.items() if name.startswith("_Z") and
               _base(name) in blocks and "registers" in props}
    assert set(kernels) == set(blocks), sorted(kernels)
    too_big = {k: (p["registers"], blocks[k]) for k, p in kernels.items()
               if max_threads_per_block(p["registers"]) < blocks[k]}
    assert not too_big, f"kernel: (registers, largest block): {too_big}"


def test_no_spills_or_stack_frames_but_the_known_ones(built):
    report, _ = built
    assert report
    spilling = {}
    for name, props in report.items():
        if props.get("stack") or props.get("spill_stores") or props.get("spill_loads"):
            spilling.setdefault(_base(name) or name, props)
    unexplained = {k: v for k, v in spilling.items() if k not in KNOWN_SPILLS}
    assert not unexplained, f"spills or stack frames: {unexplained}"
    gone = set(KNOWN_SPILLS) - set(spilling)
    assert not gone, f"{sorted(gone)} no longer spill: remove them from KNOWN_SPILLS"


def test_the_fused_norm_for_rows_of_few_units_does_not_spill(built):
    """launch.cu picks the TPC_NORM_FEW_UNITS instantiation for rows of up to
    8,192 values: it exists for both 16-bit dtypes, every pattern and every
    epilogue, and holds its units without local memory."""
    report, _ = built
    few = _define("kernels/all_reduce_norm.cuh", "TPC_NORM_FEW_UNITS")
    mine = {name: props for name, props in report.items()
            if _base(name) == "tpc_all_reduce_norm_kernel" and name.endswith(f"ELi{few}EEv15tpc_kernel_args")}
    assert len(mine) == 2 * 6 * 4, sorted(mine)
    spilling = {name: props for name, props in mine.items()
                if props.get("stack") or props.get("spill_stores") or props.get("spill_loads")}
    assert not spilling, spilling
