"""scripts/sanitize_expect.py, which judges the compute-sanitizer logs of
scripts/sanitize.sh, on logs in the tool's two racecheck formats: reports of
the push counts' handoff (a count's release against its acquire) pass; any
other report (the zeroing of the counts included), a log whose reports cannot
all be read, a missing summary or an error of the other tools fails."""
import importlib.util
import os

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
RELEASE = f"/src/csrc/kernels/portability.cuh:{line_of('portability.cuh', 'st.release.cta.u32')}"
ELSEWHERE = f"/src/csrc/kernels/all_reduce_norm.cuh:{line_of('all_reduce_norm.cuh', 'sum += half[w]')}"


def hazard(write, read, space="__shared__"):
    return (f"========= Error: Potential RAW hazard detected at {space} 0x4 in block (3,0,0) :\n"
            f"=========     Write Thread (0,0,0) at tpc_kernel_part()+0x1a0 in {write}\n"
            f"=========     Read Thread (256,0,0) at tpc_other_part(const unsigned int *)+0x30 in {read}\n"
            f"=========     Current Value : 3, Incoming Value : 0\n=========\n")


def analysis(write, read, space=None):
    return (f"========= Error: Race reported between Write access at tpc_kernel_part()+0x80 in {write}\n"
            f"=========     and Read access at tpc_other_part()+0x30 in {read} [512 hazards]\n=========\n")


def racecheck_log(*reports):
    n = len(reports)
    return ("========= COMPUTE-SANITIZER\n" + "".join(reports)
            + f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)\n")


@pytest.mark.parametrize("form", [hazard, analysis])
def test_handoff_reports_pass(form):
    ok, said = sanitize_expect.check("racecheck", racecheck_log(form(RELEASE, ACQUIRE), form(ACQUIRE, RELEASE)))
    assert ok, said
    assert "2 on the push counts' handoff" in said[0] and "0 unexpected" in said[0]


@pytest.mark.parametrize("form", [hazard, analysis])
def test_the_zeroing_of_the_counts_fails(form):
    ok, said = sanitize_expect.check("racecheck", racecheck_log(form(RELEASE, ACQUIRE), form(ZEROING, ACQUIRE)))
    assert not ok
    assert "1 unexpected" in said[0] and ZEROING in said[1]


@pytest.mark.parametrize("form", [hazard, analysis])
def test_a_report_elsewhere_fails(form):
    ok, said = sanitize_expect.check("racecheck", racecheck_log(form(RELEASE, ACQUIRE), form(RELEASE, ELSEWHERE)))
    assert not ok
    assert "1 unexpected" in said[0] and ELSEWHERE in said[1]


def test_two_releases_or_global_memory_fail():
    for report in (hazard(RELEASE, RELEASE), hazard(ACQUIRE, ACQUIRE), hazard(RELEASE, ACQUIRE, "__global__")):
        assert not sanitize_expect.check("racecheck", racecheck_log(report))[0], report


def test_a_report_the_reader_misses_fails():
    log = racecheck_log(hazard(RELEASE, ACQUIRE)).replace("1 hazards displayed", "2 hazards displayed")
    ok, said = sanitize_expect.check("racecheck", log)
    assert not ok and "1 reports could be read" in said[0]


def test_reports_that_cannot_be_read_fail():
    log = "========= something new\n========= RACECHECK SUMMARY: 5 hazards displayed (5 errors, 0 warnings)\n"
    assert not sanitize_expect.check("racecheck", log)[0]


def test_no_summary_fails():
    assert not sanitize_expect.check("racecheck", hazard(RELEASE, ACQUIRE))[0]
    assert not sanitize_expect.check("memcheck", "========= COMPUTE-SANITIZER\n")[0]


def test_clean_racecheck_passes():
    assert sanitize_expect.check("racecheck", racecheck_log())[0]


@pytest.mark.parametrize("tool", ["memcheck", "synccheck", "initcheck"])
def test_other_tools_need_zero_errors(tool):
    assert sanitize_expect.check(tool, "========= ERROR SUMMARY: 0 errors\n")[0]
    bad = ("========= Invalid __global__ write of size 16 bytes\n=========     at tpc_store16+0x10 in data_ops.cuh:67\n"
           "========= ERROR SUMMARY: 1 error\n")
    ok, said = sanitize_expect.check(tool, bad)
    assert not ok and "Invalid __global__ write" in "\n".join(said)


# ptxas may tag a count's release store with a neighbour's line: the write's
# program counter, looked up in the build's SASS, still says what it is.
SASS = """
        Function : _Z6kernelv
        /*0100*/                   MEMBAR.ALL.CTA ;
        /*0110*/                   ST.E.STRONG.SM desc[UR8][R12.64], R9 ;
        /*0120*/               @P4 MEMBAR.ALL.CTA ;
        /*0130*/               @P4 ST.E.STRONG.SM desc[UR8][R12.64], R9 ;
        /*0140*/                   ST.E.STRONG.SM desc[UR8][R2.64], RZ ;
        /*0150*/                   STS [R3], RZ ;
"""
MISTAGGED = f"/src/csrc/kernels/stream.cuh:{line_of('stream.cuh', 's.parity = seq & 1u')}"


def hazard_at(pc, write, read):
    return hazard(write, read).replace("tpc_kernel_part()+0x1a0", f"tpc_stream_of(const tpc_kernel_args *)+{pc}")


def test_the_release_instructions_are_found_in_sass():
    assert sanitize_expect.release_pcs(SASS) == {0x110, 0x130}


def test_a_release_tagged_with_another_line_passes_by_its_program_counter():
    log = racecheck_log(hazard_at("0x130", MISTAGGED, ACQUIRE), hazard_at("0x110", MISTAGGED, ACQUIRE))
    ok, said = sanitize_expect.check("racecheck", log, SASS)
    assert ok, said
    assert not sanitize_expect.check("racecheck", log)[0]  # without the SASS: unexpected


def test_another_write_at_that_line_fails_by_its_program_counter():
    for pc in ("0x140", "0x150", "0x1a0"):  # a plain strong store, a shared store, no instruction
        ok, said = sanitize_expect.check("racecheck", racecheck_log(hazard_at(pc, MISTAGGED, ACQUIRE)), SASS)
        assert not ok and "1 unexpected" in said[0], pc
    # a read at a release's program counter is not a release
    report = hazard(ACQUIRE, MISTAGGED).replace("tpc_other_part(const unsigned int *)+0x30", "f()+0x130")
    assert not sanitize_expect.check("racecheck", racecheck_log(report), SASS)[0]
