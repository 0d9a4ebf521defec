"""scripts/sanitize_expect.py, which judges the compute-sanitizer logs of
scripts/sanitize.sh, and scripts/sanitize_filters.sh, which filters racecheck
to one kernel a run. On logs in racecheck's two formats: a count's release
(by its program counter in the SASS of the kernel the run was filtered to)
written, against its acquire read, passes, RAW or WAR; the same offsets in
another kernel, swapped sides, a WAW, a write that is not a release (the
zeroing of the counts included), a read elsewhere, a report the reader
cannot read and any nonzero summary fail."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("sanitize_expect", os.path.join(ROOT, "scripts", "sanitize_expect.py"))
sanitize_expect = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sanitize_expect)


def line_of(name, text):
    with open(os.path.join(ROOT, "csrc", "kernels", name)) as f:
        return next(i + 1 for i, line in enumerate(f) if text in line)


ZEROING = f"/src/csrc/kernels/stream.cuh:{line_of('stream.cuh', 'tpc_stream_pushed()[lane] = 0')}"
ACQUIRE = f"/src/csrc/kernels/portability.cuh:{line_of('portability.cuh', 'ld.acquire.cta.u32')}"
ACQUIRE_CALL = f"/src/csrc/kernels/stream.cuh:{line_of('stream.cuh', 'tpc_load_acquire_block(&pushed[w])')}"
RELEASE = f"/src/csrc/kernels/portability.cuh:{line_of('portability.cuh', 'st.release.cta.u32')}"
MISTAGGED = f"/src/csrc/kernels/stream.cuh:{line_of('stream.cuh', 's.parity = seq & 1u')}"
ELSEWHERE = f"/src/csrc/kernels/all_reduce_norm.cuh:{line_of('all_reduce_norm.cuh', 'sum += half[w]')}"


def function(name, *code):
    """One function of a `cuobjdump -sass` dump, in its layout."""
    out = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"']
    for pc, instruction in code:
        out.append(f"        /*{pc:04x}*/   {instruction:<60} /* 0x000fe20003800000 */")
        out.append(f"{'':<100}/* 0x000e300000000800 */")
    return "\n".join(out) + "\n"


HEADER = "\nFatbin elf code:\n================\narch = sm_90\n\n\tcode for sm_90\n\t.target\tsm_90\n\n"
KERNEL, OTHER = "_Z7kernelAv", "_Z7kernelBv"
# KERNEL holds the handoff; OTHER holds plain shared stores and loads at the
# offsets of KERNEL's release and acquire.
SASS = HEADER + function(
    KERNEL,
    (0x100, "MEMBAR.ALL.CTA ;"), (0x110, "ST.E.STRONG.SM desc[UR8][R12.64], R9 ;"),  # a release
    (0x120, "@P4 MEMBAR.ALL.CTA ;"), (0x130, "@P4 ST.E.STRONG.SM desc[UR8][R12.64], R9 ;"),  # a release
    (0x140, "ST.E.STRONG.SM desc[UR8][R2.64], RZ ;"),  # a strong store, no fence
    (0x150, "STS [R3], RZ ;"),  # the zeroing
    (0x160, "LD.E.STRONG.SM R5, desc[UR8][R6.64] ;"),  # the acquire
    (0x170, "@P0 MEMBAR.ALL.CTA ;"), (0x180, "@P1 ST.E.STRONG.SM desc[UR8][R2.64], R9 ;"),  # fence and store apart
    (0x190, "LDS R7, [R3] ;"),
) + function(OTHER, (0x100, "STS [R3], RZ ;"), (0x110, "STS [R4], R9 ;"), (0x160, "LDS R5, [R3] ;"))


def frame(pc, where=None, fn="tpc_stream_of(const tpc_kernel_args *)"):
    return f"{fn}+{pc:#x}" + (f" in {where}" if where else "")


W_RELEASE = ("Write", frame(0x110, RELEASE))
R_ACQUIRE = ("Read", frame(0x160, ACQUIRE))


def hazard(first, second, kind="RAW", space="__shared__"):
    """Hazard mode: the first access, then the second (RAW: the write first)."""
    return (f"========= Error: Potential {kind} hazard detected at {space} 0x4 in block (3,0,0) :\n"
            f"=========     {first[0]} Thread (0,0,0) at {first[1]}\n"
            f"=========     {second[0]} Thread (256,0,0) at {second[1]}\n"
            f"=========     Current Value : 3, Incoming Value : 0\n=========\n")


def analysis(first, *paired):
    """Analysis mode: one access, then every access raced with it."""
    return (f"========= Error: Race reported between {first[0]} access at {first[1]}\n"
            + "".join(f"=========     and {a} access at {f} [512 hazards]\n" for a, f in paired) + "=========\n")


def racecheck_log(*reports, counts=None):
    counts = [len(reports)] if counts is None else counts
    return ("========= COMPUTE-SANITIZER\n" + "".join(reports)
            + "".join(f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)\n" for n in counts))


def judge(log, kernel=KERNEL, sass=SASS):
    return sanitize_expect.check("racecheck", log, sass, kernel)


HANDOFFS = {
    "RAW": hazard(W_RELEASE, R_ACQUIRE, "RAW"),
    "WAR": hazard(R_ACQUIRE, W_RELEASE, "WAR"),
    "WAR, the call site's line": hazard(("Read", frame(0x160, ACQUIRE_CALL)), W_RELEASE, "WAR"),
    "RAW, the release tagged with another line": hazard(("Write", frame(0x130, MISTAGGED)), R_ACQUIRE),
    "RAW, the release without line information": hazard(("Write", frame(0x110)), R_ACQUIRE),
    "analysis, the write first": analysis(W_RELEASE, R_ACQUIRE),
    "analysis, the read first": analysis(R_ACQUIRE, W_RELEASE),
    "analysis, the write and two reads": analysis(W_RELEASE, R_ACQUIRE, ("Read", frame(0x160, ACQUIRE_CALL))),
}


@pytest.mark.parametrize("name", list(HANDOFFS))
def test_the_handoff_passes(name):
    ok, said = judge(racecheck_log(HANDOFFS[name], HANDOFFS[name]))
    assert ok, said
    assert "2 on the push counts' handoff" in said[0] and "0 unexpected" in said[0]


def test_the_handoff_kinds_are_counted():
    ok, said = judge(racecheck_log(HANDOFFS["RAW"], HANDOFFS["WAR"], HANDOFFS["analysis, the write first"]))
    assert ok and "RAW 1, WAR 1, race 1" in said[0], said


# Each of these passed the judge that merged every kernel's program counters
# and matched sides by line, whatever their access.
UNEXPECTED = {
    # the offsets of KERNEL's release and acquire, in a run filtered to OTHER
    "another kernel's offsets": (hazard(("Write", frame(0x110, MISTAGGED)), R_ACQUIRE), OTHER),
    "the write on the acquire, the read on the release": (
        hazard(("Write", frame(0x160, ACQUIRE)), ("Read", frame(0x110, RELEASE))), KERNEL),
    "a WAW of the two": (hazard(W_RELEASE, ("Write", frame(0x160, ACQUIRE)), "WAW"), KERNEL),
    "a WAW with a read": (hazard(W_RELEASE, R_ACQUIRE, "WAW"), KERNEL),
    "a write without line information at no release": (
        hazard(("Write", frame(0x150, fn="tpc_store_release_block(unsigned int *, unsigned int)")), R_ACQUIRE), KERNEL),
}


@pytest.mark.parametrize("name", list(UNEXPECTED))
def test_what_is_not_the_handoff_fails(name):
    report, kernel = UNEXPECTED[name]
    ok, said = judge(racecheck_log(report), kernel)
    assert not ok
    assert "1 unexpected" in said[0] and report.splitlines()[1].split("at ", 1)[1] in said[1]


@pytest.mark.parametrize("report", [
    hazard(("Write", frame(0x150, ZEROING)), R_ACQUIRE),  # the zeroing of the counts
    hazard(("Write", frame(0x140, RELEASE)), R_ACQUIRE),  # a strong store with no fence
    hazard(("Write", frame(0x180, RELEASE)), R_ACQUIRE),  # a fence and a store under other guards
    hazard(("Write", frame(0x1a0, RELEASE)), R_ACQUIRE),  # no instruction there
    hazard(W_RELEASE, ("Read", frame(0x160, ELSEWHERE))),  # the acquire's load, tagged elsewhere
    hazard(W_RELEASE, ("Read", frame(0x190, ACQUIRE))),  # a plain shared load on the acquire's line
    hazard(W_RELEASE, ("Read", frame(0x110, RELEASE))),  # a read at the release
    hazard(W_RELEASE, ("Write", frame(0x130, RELEASE))),  # two releases
    hazard(R_ACQUIRE, ("Read", frame(0x160, ACQUIRE))),  # two acquires
    hazard(W_RELEASE, R_ACQUIRE, space="__global__"),
    analysis(W_RELEASE, R_ACQUIRE, W_RELEASE),  # and the release against itself
    analysis(W_RELEASE),  # no second access
])
def test_other_reports_fail(report):
    ok, said = judge(racecheck_log(HANDOFFS["RAW"], report))
    assert not ok and "1 unexpected" in said[0], said


@pytest.mark.parametrize("report", [
    # an access line of another layout (the PC before the file, the function after)
    HANDOFFS["RAW"].replace(f"tpc_stream_of(const tpc_kernel_args *)+0x110 in {RELEASE}",
                            f"0x00000110 in {RELEASE}:tpc_stream_of(void)"),
    HANDOFFS["RAW"].replace("Read Thread", "Atomic Thread"),
    HANDOFFS["RAW"].replace("=========     Current", f"=========     Read Thread (1,0,0) at {frame(0x160, ACQUIRE)}\n"
                            "=========     Current"),  # a third access
    HANDOFFS["RAW"].replace(f"+0x160 in {ACQUIRE}", f"+0x160 in {ACQUIRE}:7"),  # a column
    HANDOFFS["RAW"].replace("Potential RAW hazard", "Potential RAR hazard"),
])
def test_a_report_it_cannot_read_exactly_fails(report):
    assert not judge(racecheck_log(report))[0], report


def test_without_the_kernel_no_report_is_the_handoff():
    log = racecheck_log(HANDOFFS["RAW"])
    assert judge(log)[0]
    for kernel, sass in ((None, SASS), (None, ""), (OTHER, SASS)):
        ok, said = judge(log, kernel, sass)
        assert not ok and "1 unexpected" in said[0], said
    ok, said = judge(log, "_Z7kernelCv")
    assert not ok and "not in the SASS" in said[0]
    assert judge(racecheck_log(), None, "")[0]  # a clean run needs neither


def test_a_kernel_named_twice_in_the_sass_fails():
    twice = SASS + function(KERNEL, (0x110, "STS [R4], R9 ;"))
    ok, said = judge(racecheck_log(HANDOFFS["RAW"]), KERNEL, twice)
    assert not ok and "twice" in said[0]
    with pytest.raises(ValueError, match="twice"):
        sanitize_expect.handoff_kernels(twice)


def test_the_release_and_acquire_instructions_are_found_per_function():
    functions = sanitize_expect.sass_functions(SASS)
    assert sorted(functions) == [KERNEL, OTHER]
    assert sanitize_expect.release_pcs(functions[KERNEL]) == {0x110, 0x130}
    assert sanitize_expect.acquire_pcs(functions[KERNEL]) == {0x160}
    assert sanitize_expect.release_pcs(functions[OTHER]) == set() == sanitize_expect.acquire_pcs(functions[OTHER])


def test_the_handoff_kernels_are_those_with_a_release():
    more = SASS + function("_Z7kernelCv", (0x10, "@P0 MEMBAR.ALL.CTA ;"), (0x20, "@P0 ST.E.STRONG.SM [R2.64], R9 ;"))
    assert sanitize_expect.handoff_kernels(more) == [KERNEL, "_Z7kernelCv"]
    assert sanitize_expect.handoff_kernels(HEADER + function(OTHER, (0x100, "MEMBAR.ALL.CTA ;"))) == []


def test_a_kernel_the_filter_cannot_take_raises():
    with pytest.raises(ValueError, match="filter"):
        sanitize_expect.handoff_kernels(SASS.replace(KERNEL, "_Z7kernel,Av"))


def test_every_summary_counts():
    one = HANDOFFS["RAW"]
    assert judge(racecheck_log(one, counts=[1, 0]))[0] and judge(racecheck_log(one, counts=[0, 1]))[0]  # two processes
    for counts in ([1, 1], [2, 0], [0]):
        ok, said = judge(racecheck_log(one, counts=counts))
        assert not ok and "reports could be read" in said[0], counts
    unreadable = racecheck_log(one) + "========= RACECHECK SUMMARY: many hazards\n"
    assert not judge(unreadable)[0]


@pytest.mark.parametrize("tool", ["memcheck", "synccheck", "initcheck"])
def test_other_tools_need_zero_errors_in_every_summary(tool):
    assert sanitize_expect.check(tool, "========= ERROR SUMMARY: 0 errors\n")[0]
    assert sanitize_expect.check(tool, "========= ERROR SUMMARY: 0 errors\n" * 2)[0]
    bad = ("========= Invalid __global__ write of size 16 bytes\n=========     at tpc_store16+0x10 in data_ops.cuh:67\n"
           "========= ERROR SUMMARY: 1 error\n")
    ok, said = sanitize_expect.check(tool, bad)
    assert not ok and "Invalid __global__ write" in "\n".join(said)
    ok, said = sanitize_expect.check(tool, "========= ERROR SUMMARY: 0 errors\n" + bad)
    assert not ok and "0 + 1 errors" in said[0]
    unreadable = "========= ERROR SUMMARY: 0 errors\n========= ERROR SUMMARY: 2,1 errors\n"
    assert not sanitize_expect.check(tool, unreadable)[0]


def test_no_summary_or_a_report_the_reader_misses_fails():
    assert not judge(HANDOFFS["RAW"])[0]
    assert not sanitize_expect.check("memcheck", "========= COMPUTE-SANITIZER\n")[0]
    ok, said = judge(racecheck_log(HANDOFFS["RAW"], counts=[2]))
    assert not ok and "1 reports could be read" in said[0]
    log = "========= something new\n========= RACECHECK SUMMARY: 5 hazards displayed (5 errors, 0 warnings)\n"
    assert not judge(log)[0]


def test_a_run_of_the_kernel_without_reports_says_so():
    ok, said = judge(racecheck_log())
    assert ok and "no report" in said[0]


def run_cli(tmp_path, *args):
    for name, text in (("log", racecheck_log(HANDOFFS["RAW"])), ("sass", SASS)):
        (tmp_path / name).write_text(text)
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sanitize_expect.py"), *args],
                          cwd=tmp_path, capture_output=True, text=True)


def test_the_command_line(tmp_path):
    assert run_cli(tmp_path, "racecheck", "log", "sass", "--kernel", KERNEL).returncode == 0
    assert run_cli(tmp_path, "racecheck", "log", "sass", "--kernel", OTHER).returncode == 1
    assert run_cli(tmp_path, "racecheck", "log", "sass").returncode == 1
    assert run_cli(tmp_path, "racecheck", "log", "--kernel", KERNEL).returncode == 2  # no SASS
    listed = run_cli(tmp_path, "handoff-kernels", "sass")
    assert listed.returncode == 0 and listed.stdout.split() == [KERNEL]


def sourced(tmp_path, script, sass=SASS):
    """Runs bash with scripts/sanitize_filters.sh sourced and SASS in ./sass."""
    (tmp_path / "sass").write_text(sass)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return subprocess.run(["bash", "-c", f"source {ROOT}/scripts/sanitize_filters.sh; {script}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)


def test_the_filters_sanitize_sh_builds(tmp_path):
    sass = SASS + function("_Z7kernelCv", (0x10, "MEMBAR.ALL.CTA ;"), (0x20, "ST.E.STRONG.SM [R2.64], R9 ;"))
    out = sourced(tmp_path, 'k=$(handoff_kernels sass) || exit 9; mapfile -t handoff <<<"$k"; '
                            'kernel_filter "${handoff[1]}"; printf "%s\\n" "${filter[@]}" ---; '
                            'rest_filter "${handoff[@]}"; printf "%s\\n" "${filter[@]}"', sass)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n") == [
        "--kernel-name", "kne=_Z7kernelCv", "---",
        "--kernel-name", "kns=tpc_",
        "--kernel-name-exclude", f"kne={KERNEL}", "--kernel-name-exclude", "kne=_Z7kernelCv", ""]


def test_sanitize_sh_stops_where_no_kernel_holds_a_release(tmp_path):
    out = sourced(tmp_path, "handoff_kernels sass", HEADER + function(OTHER, (0x100, "STS [R3], RZ ;")))
    assert out.returncode == 1 and "no kernel" in out.stderr
    out = sourced(tmp_path, "handoff_kernels sass", SASS + SASS)
    assert out.returncode == 1 and "twice" in out.stderr


def test_sanitize_sh_parses():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "sanitize.sh")]).returncode == 0
