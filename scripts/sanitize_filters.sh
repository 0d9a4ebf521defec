# racecheck's kernel filters, sourced by scripts/sanitize.sh.
#
# A racecheck report's program counters are offsets into the kernel it ran
# in, and the report does not name that kernel (every tpcomm device function
# is inlined: a frame names the inlined function). So each kernel that can
# hold the push counts' handoff, a count release in its SASS, gets a run of
# its own, filtered to it by its complete mangled name (kne: one kernel by
# construction; scripts/sanitize_expect.py rejects a dump that holds a name
# twice) and judged against that kernel's SASS (--kernel). One more run
# checks every other tpcomm kernel, where no report is accepted.

# handoff_kernels SASS: prints the kernels of a `cuobjdump -sass` dump that
# hold a count release, one a line; fails where there is none.
handoff_kernels() {
  local out
  out=$(python3 "$(dirname "${BASH_SOURCE[0]}")/sanitize_expect.py" handoff-kernels "$1") || return 1
  if [ -z "$out" ]; then
    echo "no kernel in $1 holds a count release (MEMBAR.ALL.CTA, then ST.E.STRONG.SM)" >&2
    return 1
  fi
  printf '%s\n' "$out"
}

# kernel_filter NAME: sets the array `filter` to the filter of that kernel alone.
kernel_filter() {
  filter=(--kernel-name "kne=$1")
}

# rest_filter NAME...: sets `filter` to every tpcomm kernel (named tpc_*)
# except those named; each exclusion is an option of its own, so that any
# one of them excludes.
rest_filter() {
  local k
  filter=(--kernel-name kns=tpc_)
  for k in "$@"; do
    filter+=(--kernel-name-exclude "kne=$k")
  done
}
