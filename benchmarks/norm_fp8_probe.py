"""The FP8 epilogue's local cost on one GPU: the fused
all-reduce + add + RMSNorm kernel with each FP8 epilogue against the same
kernel without it followed by the separate quantization kernel a torch model
runs.

    nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/norm_fp8_probe.cu csrc/core/limits.c -o build/norm_fp8_probe
    nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -shared -Xcompiler -fPIC -DNORM_FP8_PROBE_LIBRARY \
        benchmarks/norm_fp8_probe.cu csrc/core/limits.c -o build/libnorm_fp8_probe.so
    python benchmarks/norm_fp8_probe.py --probe build/norm_fp8_probe --library build/libnorm_fp8_probe.so \
        [--out results.json]

(`bash scripts/device_run.sh fp8_probe` does all three.) First the probe
runs alone (benchmarks/norm_fp8_probe.cu: its doc says what its times hold,
two ranks side by side on the GPU, and what it checks). The quantization
kernel is tpcomm.fp8.quantize_checked compiled by inductor (dynamic shapes),
as benchmarks/norm_fp8_local.py runs it; on a bf16 RMSNorm output of each
shape its codes and scales are compared with eager torch's and it is timed
alone. Then, through the probe's library (the same ranks, kernels and
checks), every path is timed the same way, in one CUDA graph: each rank's
calls on a stream of its own, the streams forked together, CALLS calls a
stream, the median over REPLAYS replays, µs per call:
  fused                   the kernel without an epilogue
  fused + <mode> epilogue the kernel with it
  fused, then <mode>      the kernel without it, then the quantization kernel
                          on its normed output, both in the graph
"""
import argparse
import ctypes
import functools
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


@functools.lru_cache(maxsize=None)
def compiled_quantize():
    """tpcomm.fp8.quantize_checked under inductor, one compiled function for
    every timing: quant_rows compiles it, so no later warm-up compiles while a
    rank's kernel waits for its peer (probe_ranks.h's waits give up after 2 s)."""
    from tpcomm import fp8

    return torch.compile(fp8.quantize_checked, dynamic=True)


def scale_and_floor(quant):
    """(scale, floor) of a mode's quantization: the given scale of per_tensor,
    the default floor of the dynamic modes."""
    from tpcomm import fp8

    if quant == fp8.Quant.PER_TENSOR:
        return torch.tensor([PER_TENSOR_SCALE], device="cuda"), None
    return None, fp8.DEFAULT_FLOOR[quant]


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def quant_rows(shapes, ranks):
    """{(tokens, hidden): row} of the quantization kernel's times and checks."""
    from tpcomm import fp8

    quantize = compiled_quantize()
    out = {}
    for tokens, hidden in shapes:
        xs = [normed(tokens, hidden, seed) for seed in range(ranks)]
        row = {"us": {}, "matches_eager": {}}
        for name in MODES:
            quant = fp8.parse_quant(name)
            scale, floor = scale_and_floor(quant)
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


def open_library(path, ranks):
    """The probe's library with its ranks open; exits where the rules refuse them."""
    lib = ctypes.CDLL(path)
    lib.nfp_open.argtypes = [ctypes.c_int]
    lib.nfp_set.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    lib.nfp_set.restype = None
    lib.nfp_check_shape.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.nfp_check_shape.restype = None
    lib.nfp_launch.argtypes = [ctypes.c_int, ctypes.c_void_p]
    if lib.nfp_open(ranks):
        sys.exit(f"norm_fp8_probe: the fused norm kernel's rules do not take {ranks} ranks")
    return lib


def one_graph_rows(lib, shapes, ranks):
    """{(tokens, hidden): {path: µs}}, every path timed by graph_us over the probe's ranks."""
    from tpcomm import _constants, fp8

    quantize = compiled_quantize()
    quant_of = {"none": _constants.TPC_QUANT_NONE, **{name: int(fp8.parse_quant(name)) for name in MODES}}

    def launch(r):
        err = lib.nfp_launch(r, torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"norm_fp8_probe: rank {r}'s launch failed (cudaError_t {err})")

    out = {}
    for tokens, hidden in shapes:
        lib.nfp_check_shape(tokens, hidden)
        normed_out = [torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(ranks)]
        ptrs = (ctypes.c_void_p * ranks)(*[t.data_ptr() for t in normed_out])
        plain = [lambda r=r: launch(r) for r in range(ranks)]
        lib.nfp_set(tokens, hidden, quant_of["none"], ptrs)
        us = {"fused": graph_us(plain)}
        for name in MODES:
            quant = fp8.parse_quant(name)
            scale, floor = scale_and_floor(quant)
            lib.nfp_set(tokens, hidden, quant_of[name], None)
            us[f"fused + {name} epilogue"] = graph_us(plain)
            lib.nfp_set(tokens, hidden, quant_of["none"], ptrs)
            us[f"fused, then {name} kernel"] = graph_us(
                [lambda r=r: (launch(r), quantize(normed_out[r], quant, scale, floor, False)) for r in range(ranks)])
        torch.cuda.synchronize()
        lib.nfp_check_errors()
        out[(tokens, hidden)] = us
        print(f"{tokens} x {hidden}, one graph: " + ", ".join(f"{k} {v:.2f}" for k, v in us.items()), flush=True)
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
    parser.add_argument("--library", required=True, help="the probe built with -DNORM_FP8_PROBE_LIBRARY")
    parser.add_argument("--ranks", type=int, default=2, help="the probe's ranks (every one on GPU 0 on one GPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("norm_fp8_probe: needs a GPU")
    header, probe = run_probe(args.probe, args.ranks)
    shapes = sorted({(t, h) for t, h, _ in probe})
    alone = quant_rows(shapes, args.ranks)
    graphed = one_graph_rows(open_library(args.library, args.ranks), shapes, args.ranks)
    rows = []
    for tokens, hidden in shapes:
        us = dict(graphed[(tokens, hidden)])
        us.update(alone[(tokens, hidden)]["us"])
        rows.append({"tokens": tokens, "hidden": hidden, "us": us,
                     "probe_us": {name: probe[(tokens, hidden, name)] for name in ("none",) + MODES},
                     "quant_matches_eager": alone[(tokens, hidden)]["matches_eager"]})
    env = graph_timing.environment(
        f"{args.ranks} ranks side by side on GPU 0 (benchmarks/norm_fp8_probe.cu), each rank's calls on its own "
        f"stream in one CUDA graph, {CALLS} calls a stream, median of {REPLAYS} replays; the quantization kernel "
        "is tpcomm.fp8.quantize_checked compiled by inductor",
        cuda=torch.version.cuda, nvcc=nvcc_version(), ranks=args.ranks, gpus=torch.cuda.device_count(), probe=header)
    if args.out:
        graph_timing.write(args.out, rows, env)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
