"""The FP8 epilogue's local cost on one GPU (issue 48 item 5): the fused
all-reduce + add + RMSNorm kernel with each FP8 epilogue against the same
kernel without it followed by the separate quantization kernel a torch model
runs.

    nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/norm_fp8_probe.cu csrc/core/limits.c -o build/norm_fp8_probe
    python benchmarks/norm_fp8_probe.py --probe build/norm_fp8_probe [--out results.json]

(`bash scripts/device_run.sh fp8_probe` does both.) The kernel's times are
benchmarks/norm_fp8_probe.cu's (its doc says what they hold: two ranks side
by side on the GPU, results checked). The quantization kernel is
tpcomm.fp8.quantize_checked compiled by inductor (dynamic shapes), as
benchmarks/norm_fp8_local.py runs it, on a bf16 RMSNorm output of each shape,
its codes and scales compared with eager torch's; one copy per rank of the
probe, each on its own stream, all in one CUDA graph of CALLS back-to-back
calls a stream, the median over REPLAYS replays, µs per call. The two-kernel
path's time is then the probe's kernel without an epilogue plus that time:
a sum of two measurements, not one graph of both kernels.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import graph_timing  # noqa: E402 - beside this file; it imports the checkout's tpcomm (the line above)

CALLS, REPLAYS, WARMUP = 10, 20, 3
EPS = 1e-5
PER_TENSOR_SCALE = 0.02  # the probe's
MODES = ("per_tensor", "per_token", "per_token_group")


def run_probe(path, ranks):
    """(header lines, {(tokens, hidden, epilogue): µs}) of the probe's run; exits with its error."""
    done = subprocess.run([path, str(ranks)], capture_output=True, text=True, timeout=400)
    sys.stdout.write(done.stdout)
    if done.returncode:
        sys.exit(f"norm_fp8_probe failed (exit {done.returncode}): {done.stderr.strip()}")
    lines = done.stdout.splitlines()
    rows = {}
    for line in lines:
        fields = line.split()
        if len(fields) == 4 and fields[0].isdigit():
            rows[(int(fields[0]), int(fields[1]), fields[2])] = float(fields[3])
    if not rows:
        sys.exit(f"norm_fp8_probe printed no rows:\n{done.stdout}")
    return lines[:2], rows


def normed(tokens, hidden, seed):
    """A bf16 RMSNorm output of the shape (what the quantization kernel reads)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(tokens, hidden, device="cuda", generator=g)
    w = torch.rand(hidden, device="cuda", generator=g) + 0.5
    return (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + EPS) * w).to(torch.bfloat16)


def graph_us(fns):
    """µs per call: one CUDA graph in which each of fns runs CALLS times back
    to back on a stream of its own, the streams forked together; median over
    REPLAYS replays. WARMUP eager calls first (inductor compiles on the first)."""
    from tpcomm import _ranks

    streams = [torch.cuda.Stream() for _ in fns]
    for stream, fn in zip(streams, fns):
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture = torch.cuda.current_stream()
        for stream, fn in zip(streams, fns):
            stream.wait_stream(capture)
            with torch.cuda.stream(stream):
                for _ in range(CALLS):
                    fn()
        for stream in streams:
            capture.wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = [_ranks.seconds_per_call(graph.replay, 1, torch.device("cuda")) * 1e6 / CALLS for _ in range(REPLAYS)]
    return round(statistics.median(times), 3)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def quant_rows(shapes, ranks):
    """{(tokens, hidden): row} of the quantization kernel's times and checks."""
    from tpcomm import fp8

    quantize = torch.compile(fp8.quantize_checked, dynamic=True)
    out = {}
    for tokens, hidden in shapes:
        xs = [normed(tokens, hidden, seed) for seed in range(ranks)]
        row = {"us": {}, "matches_eager": {}}
        for name in MODES:
            quant = fp8.parse_quant(name)
            scale = torch.tensor([PER_TENSOR_SCALE], device="cuda") if quant == fp8.Quant.PER_TENSOR else None
            floor = None if scale is not None else fp8.DEFAULT_FLOOR[quant]
            fns = [lambda x=x: quantize(x, quant, scale, floor, False) for x in xs]
            codes, scales = fns[0]()
            want_codes, want_scales = fp8.quantize_checked(xs[0], quant, scale, floor, False)
            row["matches_eager"][name] = same_bits(codes, want_codes) and same_bits(scales, want_scales)
            if not row["matches_eager"][name]:
                print(f"{tokens} x {hidden} {name}: inductor's codes or scales differ from eager torch's")
            row["us"][f"{name} quant kernel"] = graph_us(fns)
            row["us"][f"{name} quant kernel, one stream"] = graph_us(fns[:1])
        out[(tokens, hidden)] = row
        print(f"{tokens} x {hidden}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["us"].items()), flush=True)
    return out


def nvcc_version():
    try:
        text = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout
        return text.strip().splitlines()[-1]
    except Exception:  # noqa: BLE001 - the compiler's version is a note, not a requirement
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", required=True, help="the built benchmarks/norm_fp8_probe.cu")
    parser.add_argument("--ranks", type=int, default=2, help="the probe's ranks (every one on GPU 0 on one GPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("norm_fp8_probe: needs a GPU")
    header, probe = run_probe(args.probe, args.ranks)
    shapes = sorted({(t, h) for t, h, _ in probe})
    quant = quant_rows(shapes, args.ranks)
    rows = []
    for tokens, hidden in shapes:
        fused = probe[(tokens, hidden, "none")]
        us = {"fused": fused}
        for name in MODES:
            kernel = quant[(tokens, hidden)]["us"][f"{name} quant kernel"]
            us[f"fused + {name} epilogue"] = probe[(tokens, hidden, name)]
            us[f"{name} quant kernel"] = kernel
            us[f"{name} quant kernel, one stream"] = quant[(tokens, hidden)]["us"][f"{name} quant kernel, one stream"]
            us[f"fused, then {name} kernel"] = round(fused + kernel, 3)
        rows.append({"tokens": tokens, "hidden": hidden, "us": us,
                     "quant_matches_eager": quant[(tokens, hidden)]["matches_eager"]})
    env = {"gpu": torch.cuda.get_device_name(), "driver": graph_timing.driver(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "nvcc": nvcc_version(), "ranks": args.ranks,
           "gpus": torch.cuda.device_count(), "date": datetime.date.today().isoformat(), "probe": header,
           "method": f"fused kernel: benchmarks/norm_fp8_probe.cu, {args.ranks} ranks side by side on GPU 0, "
                     "graphs of 50 launches a rank replayed together, median of 40 replays, slowest rank; "
                     "quant kernel: tpcomm.fp8.quantize_checked compiled by inductor, one stream a rank, "
                     f"a graph of {CALLS} calls a stream, median of {REPLAYS} replays; "
                     "'fused, then' = fused + quant kernel (a sum)"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
