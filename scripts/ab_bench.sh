#!/usr/bin/env bash
# Interleaved A/B of two versions of tpcomm on a machine with the GPUs: the
# working tree against a baseline, each built in its own copy, benchmarked in
# alternating rounds (base, new, base, new, ...) so that drift of the machine
# hits both alike. Prints, per (op, backend, size), every round's median.
#
#   mkdir -p .ab && git archive <rev> -o .ab/base.tar
#   bash scripts/ab_bench.sh .ab/base.tar [rounds] [tpcomm.bench args...]
# Default bench args: bf16, graph mode, both ops, tpcomm's kernels forced, 64 B .. 4 MiB.
set -u
base_tar=${1:?usage: ab_bench.sh BASE.tar [rounds] [bench args...]}
rounds=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--ops all_reduce,all_gather --dtypes bfloat16 --modes graph
                               --backends tpcomm_packet,tpcomm_bulk --max-bytes 4194304)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
root=$(pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/tpcomm-ab.XXXX")
trap 'rm -rf "$work"' EXIT  # the two copies, their builds and the runs' JSON: the summary below is the output
mkdir -p "$work/base" "$work/new"
tar -xf "$base_tar" -C "$work/base"
tar --exclude=./.ab --exclude=./.venv --exclude=./build -cf - . | tar -xf - -C "$work/new"
for round in $(seq 1 "$rounds"); do
  for v in base new; do
    (cd "$work/$v" && python3 -m pip install --no-build-isolation --no-deps -e . > "$work/build_$v.log" 2>&1) \
      || { tail -20 "$work/build_$v.log"; exit 1; }
    (cd "$work/$v" && timeout 300 python3 -m tpcomm.bench "${args[@]}" --no-plots --no-progress --no-kernel-probe \
      --out "$work/${v}_$round.json" > "$work/bench_${v}_$round.log" 2>&1) || tail -20 "$work/bench_${v}_$round.log"
  done
done
(cd "$root" && python3 -m pip install --no-build-isolation --no-deps -e . > /dev/null 2>&1)
python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for v in ("base", "new"):
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{work}/{v}_{r}.json"))["rows"]:
            key = (row["op"], row["backend"], row["dtype"], row["bytes_per_rank"], row["mode"])
            rows.setdefault(key, {}).setdefault(v, []).append(row["median_us"])
ratios = []
print("op backend dtype bytes mode | base rounds | new rounds | best new / best base")
for k in sorted(rows):
    d = rows[k]
    if len(d.get("base", [])) and len(d.get("new", [])):
        ratio = min(d["new"]) / min(d["base"])
        ratios.append(ratio)
        print(*k, "|", ",".join(f"{x:.2f}" for x in d["base"]), "|", ",".join(f"{x:.2f}" for x in d["new"]),
              f"| {ratio:.3f}")
print(f"median best/best ratio {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
PY
