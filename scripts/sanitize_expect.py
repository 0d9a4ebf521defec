"""Reads one compute-sanitizer log written by scripts/sanitize.sh and says
whether it holds anything unexpected; lists the kernels that hold the push
counts' handoff.

    python scripts/sanitize_expect.py TOOL LOG [SASS [--kernel NAME]]
    python scripts/sanitize_expect.py handoff-kernels SASS

SASS is the `cuobjdump -sass` of the build the log ran (one architecture:
a function found twice fails). Every summary line of the log is read (one a
process the tool followed), and a log without one fails: memcheck, synccheck
and initcheck must report 0 errors in each; racecheck's hazard counts must
add up to the reports read, each of which must be expected.

racecheck may report one thing only: the handoff of the streamed kernels'
push counts (pushed[] in csrc/kernels/stream.cuh), a data warp's
st.release.cta of its count (tpc_store_release_block) against the control
warp's ld.acquire.cta of it (tpc_load_acquire_block): strong operations at
block scope, never a data race, which racecheck, not modelling
release/acquire, reports (benchmarks/racecheck_stream_start.cu). A report's
program counters are offsets into the kernel it ran in, which it does not
name (every device function is inlined), so sanitize.sh filters racecheck to
one kernel a run and the judge is told which (--kernel, the mangled name).
A report is the handoff only if all of these hold:
  - a hazard (RAW or WAR, on __shared__) or an analysis-mode race between
    exactly one Write and one Read (in analysis mode, a Write and every
    access paired with it, or the other way round); WAW, RAR or any other
    pairing fails, whatever the order the accesses are printed in;
  - the Write's program counter is a count release in that kernel's SASS:
    MEMBAR.ALL.CTA, then ST.E.STRONG.SM under the same guard (what
    st.release.cta compiles to). Its source line is not read: ptxas may tag
    the store with a neighbouring instruction's line;
  - the Read's program counter is a strong block-scope load in that
    kernel's SASS (LD.E.STRONG.SM: what ld.acquire.cta compiles to), and
    its source line, where the frame has one, is the acquire's.
Without --kernel, or where that kernel has no count release, no report is
the handoff. Anything else, an access or summary line that cannot be read
exactly, or a tool error exits 1 and is printed verbatim.
"""
import argparse
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "csrc", "kernels")

# The acquire's source line: the accessor's inlined body or its call site
# (a report names the innermost frame it has line information for).
ACQUIRE = (("stream.cuh", "tpc_load_acquire_block(&pushed[w])"),
           ("portability.cuh", 'asm volatile("ld.acquire.cta.u32'))

REPORT_START = re.compile(r"hazard detected|Race reported|^(Error|Warning):")
SUMMARY = re.compile(r"\bSUMMARY:")
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)")
MANGLED = re.compile(r"\w+")

# A frame: FUNCTION+0xPC, then " in FILE:LINE" where it has line information.
FRAME = r"(?P<fn>\S.*?)\+0x(?P<pc>[0-9a-fA-F]+)(?: in (?P<file>\S+):(?P<line>\d+))?"
HAZARD = re.compile(r"(?:Error|Warning): Potential (RAW|WAR|WAW) hazard detected at (\S+) ")
HAZARD_ACCESS = re.compile(r"(?P<kind>Write|Read) Thread \(\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\) at " + FRAME)
RACE_FIRST = re.compile(r"(?:Error|Warning): Race reported between (?P<kind>Write|Read) access at " + FRAME)
RACE_PAIRED = re.compile(r"and (?P<kind>Write|Read) access at " + FRAME + r" \[\d+ hazards?\]")
NAMES_ACCESS = re.compile(r"Thread \(| access at ")


def sass_functions(sass):
    """{mangled name: [(pc, guard, opcode), ...]} of `cuobjdump -sass` text.
    A name found twice (the dump of several architectures) raises: its
    offsets would be ambiguous."""
    functions, code = {}, None
    for line in sass.splitlines():
        m = SASS_FUNCTION.match(line)
        if m:
            if m.group(1) in functions:
                raise ValueError(f"{m.group(1)} is in the SASS twice: dump one architecture")
            code = functions[m.group(1)] = []
            continue
        m = SASS_LINE.search(line)
        if m and code is not None:
            code.append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3)))
    return functions


def release_pcs(code):
    """Program counters of the count releases in one function's code (from
    sass_functions): an ST.E.STRONG.SM right after a MEMBAR.ALL.CTA under
    the same guard."""
    return frozenset(pc for (_, guard0, op0), (pc, guard, op) in zip(code, code[1:])
                     if op0 == "MEMBAR.ALL.CTA" and op.startswith("ST.E.STRONG.SM") and guard == guard0)


def acquire_pcs(code):
    """Program counters of the strong block-scope loads in one function's
    code: LD.E.STRONG.SM (ld.acquire.cta and ld.relaxed.cta)."""
    return frozenset(pc for pc, _, op in code if op.startswith("LD.E.STRONG.SM"))


def handoff_kernels(sass):
    """The functions of a SASS dump that hold a count release, sorted: the
    kernels sanitize.sh gives racecheck runs of their own. A name that is
    not a plain mangled name (it goes into the tool's filter) raises."""
    names = sorted(name for name, code in sass_functions(sass).items() if release_pcs(code))
    for name in names:
        if not MANGLED.fullmatch(name):
            raise ValueError(f"{name!r}: not a mangled name racecheck's filter can take")
    return names


def acquire_lines():
    """{"stream.cuh:252", ...}: where the acquire's source lines are."""
    where = set()
    for name, text in ACQUIRE:
        with open(os.path.join(KERNELS, name)) as f:
            lines = [i + 1 for i, line in enumerate(f) if text in line]
        if len(lines) != 1:
            raise SystemExit(f"sanitize_expect: {text!r} found {len(lines)} times in {name}, not once")
        where.add(f"{name}:{lines[0]}")
    return frozenset(where)


def reports(log):
    """The log's reports, each a list of lines (the tool's prefix and
    indentation removed)."""
    out, current = [], None
    for raw in log.splitlines():
        line = re.sub(r"^=+ ?", "", raw).strip()
        if REPORT_START.search(line) and not SUMMARY.search(line):
            current = [line]
            out.append(current)
        elif current is not None and line:
            current.append(line)
        else:
            current = None
    return out


def accesses(report):
    """(kind, [(access, frame match), ...]) of a report, kind RAW/WAR/WAW
    or "race" (analysis mode: the first access, then each paired with it);
    None where a line naming an access, or the report's shape, cannot be
    read exactly. A hazard on another memory than __shared__ is None."""
    hazard = HAZARD.match(report[0])
    rest = [line for line in report[1:] if NAMES_ACCESS.search(line)]
    if hazard:
        if hazard.group(2) != "__shared__" or len(rest) != 2:
            return None
        kind, found = hazard.group(1), [HAZARD_ACCESS.fullmatch(line) for line in rest]
    else:
        kind, found = "race", [RACE_FIRST.fullmatch(report[0])] + [RACE_PAIRED.fullmatch(line) for line in rest]
        if len(found) < 2:
            return None
    if not all(found):
        return None
    return kind, [(m.group("kind"), m) for m in found]


def is_handoff(report, pcs, lines):
    """A report of a count's release against its acquire. pcs: (release_pcs,
    acquire_pcs) of the kernel the run was filtered to, or None (no report
    is); lines: acquire_lines()."""
    read = accesses(report)
    if read is None or pcs is None or read[0] == "WAW":
        return False
    releases, acquires = pcs

    def release(access):
        kind, frame = access
        return kind == "Write" and int(frame.group("pc"), 16) in releases

    def acquire(access):
        kind, frame = access
        where = f"{os.path.basename(frame.group('file'))}:{frame.group('line')}" if frame.group("file") else None
        return kind == "Read" and int(frame.group("pc"), 16) in acquires and where in (None, *lines)

    first, *paired = read[1]
    if read[0] != "race":  # a hazard: one Write, one Read, in either order
        return (release(first) and acquire(paired[0])) or (acquire(first) and release(paired[0]))
    return ((release(first) and all(map(acquire, paired)))
            or (acquire(first) and all(map(release, paired))))


def summaries(tool, text):
    """(counts, None) of every summary line of the log, or (None, why)."""
    form = RACECHECK_SUMMARY if tool == "racecheck" else ERROR_SUMMARY
    counts = []
    for line in text.splitlines():
        if SUMMARY.search(line):
            m = form.search(line)
            if not m:
                return None, f"{tool}: a summary line it cannot read: {line.strip()}"
            counts.append(int(m.group(1)))
    if not counts:
        return None, f"{tool}: no summary line: the tool did not finish (see the log)"
    return counts, None


def check(tool, text, sass="", kernel=None):
    """(ok, lines to print); sass: the build's `cuobjdump -sass`, or "";
    kernel: the one kernel racecheck ran on (mangled), or None."""
    counts, why = summaries(tool, text)
    if why:
        return False, [why]
    if re.search(r"Internal Sanitizer Error|Sanitizer is unable|LAUNCH_TIMEOUT", text):
        return False, [f"{tool}: the tool itself failed (see the log)"]
    if tool != "racecheck":
        if any(counts):
            first = [line for line in text.splitlines() if re.search(r"Invalid|Uninitiali[sz]ed|Barrier|rror", line)]
            return False, [f"{tool}: {' + '.join(map(str, counts))} errors"] + first[:20]
        return True, [f"{tool}: 0 errors ({len(counts)} summaries)"]
    found = reports(text)
    if sum(counts) != len(found):
        return False, [f"racecheck: the summaries count {sum(counts)} hazards, but {len(found)} reports "
                       "could be read (see the log)"]
    pcs = None
    if kernel is not None:
        try:
            code = sass_functions(sass).get(kernel)
        except ValueError as e:
            return False, [f"racecheck: {e}"]
        if code is None:
            return False, [f"racecheck: --kernel {kernel} is not in the SASS given"]
        pcs = release_pcs(code), acquire_pcs(code)
    lines = acquire_lines()
    handoff, unexpected = [], []
    for r in found:
        (handoff if is_handoff(r, pcs, lines) else unexpected).append(r)
    kinds = collections.Counter(accesses(r)[0] for r in handoff)
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"
    said = [f"racecheck ({kernel or 'no handoff kernel'}): {len(found)} reports, {len(handoff)} on the push counts' "
            f"handoff (release/acquire: {by_kind}), {len(unexpected)} unexpected"]
    if kernel is not None and not found:
        said[0] += ": no report (the kernel did not run, or the filter matched nothing)"
    for r in unexpected[:10]:
        said.append("UNEXPECTED:\n  " + "\n  ".join(r))
    return not unexpected, said


def main():
    if sys.argv[1:2] == ["handoff-kernels"]:
        p = argparse.ArgumentParser(prog="sanitize_expect.py handoff-kernels",
                                    description="the kernels of a SASS dump that hold a count release, one a line")
        p.add_argument("sass")
        args = p.parse_args(sys.argv[2:])
        with open(args.sass, errors="replace") as f:
            try:
                print("\n".join(handoff_kernels(f.read())))
            except ValueError as e:
                raise SystemExit(f"sanitize_expect: {args.sass}: {e}")
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tool", choices=("memcheck", "racecheck", "synccheck", "initcheck"))
    p.add_argument("log")
    p.add_argument("sass", nargs="?")
    p.add_argument("--kernel", help="racecheck: the one kernel the run was filtered to (its mangled name)")
    args = p.parse_args()
    if args.kernel is not None and (args.tool != "racecheck" or args.sass is None):
        p.error("--kernel needs racecheck and the SASS")
    sass = ""
    if args.sass is not None:
        with open(args.sass, errors="replace") as f:
            sass = f.read()
    with open(args.log, errors="replace") as f:
        ok, said = check(args.tool, f.read(), sass, args.kernel)
    print("\n".join(said))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
