"""Reads one compute-sanitizer log written by scripts/sanitize.sh and says
whether it holds anything unexpected.

    python scripts/sanitize_expect.py TOOL LOG [SASS]

memcheck, synccheck and initcheck must report 0 errors. racecheck may report
one thing only: the handoff of the streamed kernels' push counts (pushed[] in
csrc/kernels/stream.cuh), a data warp's release of its count against the
control warp's acquire of it. Both are strong operations on one shared word,
never a data race; racecheck does not model release/acquire pairs and
reports them (benchmarks/racecheck_stream_start.cu reproduces it). Every
report must name exactly those two accesses, one release and one acquire of
a count (found by the text of their source lines, so line numbers may move,
or by the accessor's name where a frame has no line information), on shared
memory. ptxas may tag the release's store with a neighbouring instruction's
line (its address and value keep the release's lines): given SASS, the
`cuobjdump -sass` of the build the log ran, a write whose program counter
holds a count release there (MEMBAR.ALL.CTA, then ST.E.STRONG.SM: the
st.release.cta of tpc_store_release_block) is the release whatever its
line. Anything else (the zeroing of the counts included), a log without the
tool's summary, or a tool error, exits 1 and is printed verbatim.
"""
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "csrc", "kernels")

# The two sides of the handoff: (file under csrc/kernels, text of the line).
# The accessor's inlined body and its call site both count: a report names
# the innermost frame it has line information for.
RELEASE = (("stream.cuh", "tpc_store_release_block(&tpc_stream_pushed()[s->warp], done)"),
           ("portability.cuh", 'asm volatile("st.release.cta.u32'))
ACQUIRE = (("stream.cuh", "tpc_load_acquire_block(&pushed[w])"),
           ("portability.cuh", 'asm volatile("ld.acquire.cta.u32'))
RELEASE_FUNCTIONS = ("tpc_stream_mark", "tpc_store_release_block")
ACQUIRE_FUNCTIONS = ("tpc_stream_signal_all", "tpc_load_acquire_block")

LOCATION = re.compile(r"([\w.+-]+\.(?:cuh|cu|h|hpp|cpp|c)):(\d+)")
FUNCTION = re.compile(r"\bat (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:]*)\(")
REPORT_START = re.compile(r"hazard detected|Race reported|^(Error|Warning):")
KIND = re.compile(r"\b(RAW|WAR|WAW)\b")
PC = re.compile(r"\+0x([0-9a-f]+)\b")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)")


def release_pcs(sass):
    """Program counters of a count release in `cuobjdump -sass` text: an
    ST.E.STRONG.SM right after a MEMBAR.ALL.CTA (in any kernel)."""
    pcs, previous = set(), None
    for line in sass.splitlines():
        if "Function :" in line:
            previous = None
        m = SASS_LINE.search(line)
        if not m:
            continue
        op = m.group(2)
        if op.startswith("ST.E.STRONG.SM") and previous == "MEMBAR.ALL.CTA":
            pcs.add(int(m.group(1), 16))
        previous = op
    return frozenset(pcs)


def _lines(sites):
    """{"stream.cuh:106", ...}: where each (file, text) site is in the tree."""
    where = set()
    for name, text in sites:
        with open(os.path.join(KERNELS, name)) as f:
            lines = [i + 1 for i, line in enumerate(f) if text in line]
        if len(lines) != 1:
            raise SystemExit(f"sanitize_expect: {text!r} found {len(lines)} times in {name}, not once")
        where.add(f"{name}:{lines[0]}")
    return where


def handoff_sites():
    """(release locations, acquire locations) in the tree."""
    return _lines(RELEASE), _lines(ACQUIRE)


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


def side(line, sites, pcs=frozenset()):
    """"release", "acquire" or None: which side of the handoff an access is
    (pcs: release_pcs of the build)."""
    releases, acquires = sites
    pc = PC.search(line)
    if "Write" in line and pc and int(pc.group(1), 16) in pcs:
        return "release"
    loc = LOCATION.search(line)
    if loc:
        where = f"{os.path.basename(loc.group(1))}:{loc.group(2)}"
        return "release" if where in releases else "acquire" if where in acquires else None
    fn = FUNCTION.search(line)  # no line information: the accessor's name
    name = fn.group(1).split("::")[-1] if fn else ""
    return "release" if name in RELEASE_FUNCTIONS else "acquire" if name in ACQUIRE_FUNCTIONS else None


def is_handoff(report, sites, pcs=frozenset()):
    """A report of one count's release against its acquire, on shared memory."""
    if "__global__" in report[0] or "__local__" in report[0]:
        return False
    sides = sorted(side(line, sites, pcs) or "" for line in access_lines(report))
    return sides == ["acquire", "release"]


def check(tool, text, sass=""):
    """(ok, lines to print); sass: the build's `cuobjdump -sass`, or ""."""
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
    if int(summary.group(2)) != len(found):
        return False, [f"racecheck: {summary.group(0)}, but {len(found)} reports could be read (see the log)"]
    sites, pcs = handoff_sites(), release_pcs(sass)
    unexpected = [r for r in found if not is_handoff(r, sites, pcs)]
    kinds = collections.Counter((KIND.search(r[0]) or KIND.search(" ".join(r)) or ["race"])[0]
                                for r in found if is_handoff(r, sites, pcs))
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"
    said = [f"racecheck: {len(found)} reports, {len(found) - len(unexpected)} on the push counts' handoff "
            f"(release/acquire: {by_kind}), {len(unexpected)} unexpected; summary: {summary.group(0)}"]
    for r in unexpected[:10]:
        said.append("UNEXPECTED:\n  " + "\n  ".join(r))
    return not unexpected, said


def main():
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in ("memcheck", "racecheck", "synccheck", "initcheck"):
        raise SystemExit("usage: sanitize_expect.py {memcheck|racecheck|synccheck|initcheck} LOG [SASS]")
    tool, path = sys.argv[1:3]
    sass = ""
    if len(sys.argv) == 4:
        with open(sys.argv[3], errors="replace") as f:
            sass = f.read()
    with open(path, errors="replace") as f:
        ok, said = check(tool, f.read(), sass)
    print("\n".join(said))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
