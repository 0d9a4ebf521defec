"""Reads one compute-sanitizer log written by scripts/sanitize.sh and says
whether it holds anything unexpected.

    python scripts/sanitize_expect.py TOOL LOG

memcheck, synccheck and initcheck must report 0 errors. racecheck may report
hazards only on the streamed kernels' push counts (pushed[] in
csrc/kernels/stream.cuh), whose comment there shows why none is a race:
every access a report names must be one of EXPECTED's source lines (found by
their text, so line numbers may move). Anything else, a log without the
tool's summary, or a tool error, exits 1 and is printed verbatim.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "csrc", "kernels")

# (file under csrc/kernels, text of the line, the access). The accessor's
# inlined body and its call site both count: a report names the innermost
# frame it has line information for.
EXPECTED = (
    ("stream.cuh", "tpc_stream_pushed()[threadIdx.x] = 0", "the zeroing of the counts (tpc_stream_reset)"),
    ("stream.cuh", "tpc_store_release_block(&tpc_stream_pushed()[s->warp], done)",
     "a data warp's release of its count (tpc_stream_mark)"),
    ("stream.cuh", "tpc_load_acquire_block(&pushed[w])", "the control warp's acquire of a count"),
    ("portability.cuh", 'asm volatile("st.release.cta.u32', "the release's instruction (tpc_store_release_block)"),
    ("portability.cuh", 'asm volatile("ld.acquire.cta.u32', "the acquire's instruction (tpc_load_acquire_block)"),
)
EXPECTED_FUNCTIONS = ("tpc_stream_reset", "tpc_stream_mark", "tpc_stream_signal_all", "tpc_store_release_block",
                      "tpc_load_acquire_block")

LOCATION = re.compile(r"([\w.+-]+\.(?:cuh|cu|h|hpp|cpp|c)):(\d+)")
FUNCTION = re.compile(r"\bat (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:]*)\(")
REPORT_START = re.compile(r"hazard detected|Race reported|^(Error|Warning):")


def expected_locations():
    """{"stream.cuh:106": what, ...} for every EXPECTED line in the tree."""
    where = {}
    for name, text, what in EXPECTED:
        with open(os.path.join(KERNELS, name)) as f:
            lines = [i + 1 for i, line in enumerate(f) if text in line]
        if len(lines) != 1:
            raise SystemExit(f"sanitize_expect: {text!r} found {len(lines)} times in {name}, not once")
        where[f"{name}:{lines[0]}"] = what
    return where


def reports(log):
    """The log's reports, each a list of lines (the tool's prefix removed)."""
    out, current = [], None
    for raw in log.splitlines():
        line = re.sub(r"^=+ ?", "", raw).rstrip()
        if REPORT_START.search(line) and "SUMMARY" not in line:
            current = [line]
            out.append(current)
        elif current is not None and line.strip():
            current.append(line)
        else:
            current = None
    return out


def access_lines(report):
    """The lines naming an access (hazard mode: "Write Thread (...) at ...";
    analysis mode: "... Write access at ..." / "and Read access at ...")."""
    return [line for line in report if re.search(r"Thread \(|access at", line)]


def is_expected(report, allowed):
    accesses = access_lines(report)
    if not accesses:
        return False
    for line in accesses:
        loc = LOCATION.search(line)
        if loc:
            if f"{os.path.basename(loc.group(1))}:{loc.group(2)}" not in allowed:
                return False
            continue
        fn = FUNCTION.search(line)  # no line information: the function must be one of the counts' accessors
        if not fn or fn.group(1).split("::")[-1] not in EXPECTED_FUNCTIONS:
            return False
    return True


def check(tool, text):
    """(ok, lines to print)."""
    said = []
    summary = re.search(r"(ERROR|RACECHECK) SUMMARY: (\d+) (errors?|hazards?)", text)
    if not summary:
        return False, [f"{tool}: no summary line: the tool did not finish (see the log)"]
    if re.search(r"Internal Sanitizer Error|Sanitizer is unable|LAUNCH_TIMEOUT", text):
        return False, [f"{tool}: the tool itself failed (see the log)"]
    if tool != "racecheck":
        errors = int(re.search(r"ERROR SUMMARY: (\d+)", text).group(1)) if "ERROR SUMMARY" in text else -1
        if errors:
            first = [line for line in text.splitlines() if re.search(r"Invalid|Uninitiali[sz]ed|Barrier|rror", line)]
            return False, [f"{tool}: {errors} errors"] + first[:20]
        return True, [f"{tool}: 0 errors"]
    found = reports(text)
    if int(summary.group(2)) and not found:
        return False, [f"racecheck: {summary.group(0)}, but no report could be read (see the log)"]
    allowed = expected_locations()
    unexpected = [r for r in found if not is_expected(r, allowed)]
    said.append(f"racecheck: {len(found)} reports, {len(found) - len(unexpected)} on the push counts "
                f"(stream.cuh: not races), {len(unexpected)} unexpected; summary: {summary.group(0)}")
    for r in unexpected[:10]:
        said.append("UNEXPECTED:\n  " + "\n  ".join(r))
    return not unexpected, said


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("memcheck", "racecheck", "synccheck", "initcheck"):
        raise SystemExit("usage: sanitize_expect.py {memcheck|racecheck|synccheck|initcheck} LOG")
    tool, path = sys.argv[1:]
    with open(path, errors="replace") as f:
        ok, said = check(tool, f.read())
    print("\n".join(said))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
