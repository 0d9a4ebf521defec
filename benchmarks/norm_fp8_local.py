"""The FP8 epilogue's cost: the fused all-reduce + add + RMSNorm kernel
(ADD_NORM, bf16) with each epilogue (per-tensor, per-token, per-token-group
of 128) beside the same kernel without it followed by the separate
quantization kernel a torch model runs (tpcomm.fp8.quantize compiled by
inductor into one kernel, dynamic shapes). CUDA graphs of 10 back-to-back
calls, median over 20 replays, slowest rank, µs per call.

    python benchmarks/norm_fp8_local.py [--out results.json]

Needs a GPU a rank: ranks sharing one GPU over gloo replay their graphs
milliseconds apart, and each kernel waits out that skew (2.2 ms a call on
one H100, whatever the epilogue), which hides the kernels' own work; on one
GPU, benchmarks/norm_fp8_probe.py measures it with every rank in one process."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import graph_timing  # noqa: E402 - beside this file; it imports the checkout's tpcomm (the line above)

SHAPES = [(8, 4096), (32, 4096), (256, 4096), (8, 8192), (32, 8192), (256, 8192)]
QUANTS = ("per_tensor", "per_token", "per_token_group")
EPS = 1e-5


def _rank(rank, world, init_method, out):
    import tpcomm
    from tpcomm import fp8
    from tpcomm.topology import force_multicast_off

    force_multicast_off()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    comm = tpcomm.Communicator(packet_max_bytes=4 * 1024 * 1024)  # 256 x 8192 bf16: the fused kernel's packet path
    assert comm.enabled, comm.disabled_reason
    ops, cid = torch.ops._tpcomm, comm.comm_id
    quantize = torch.compile(fp8.quantize_checked, dynamic=True)
    rows = []
    for tokens, hidden in SHAPES:
        torch.manual_seed(rank)
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        torch.manual_seed(100)
        residual = torch.randn_like(x)
        weight = torch.rand(hidden, device="cuda").to(torch.bfloat16) + 0.5
        normed, stream = torch.empty_like(x), torch.empty_like(x)

        def fused():
            ops.all_reduce_norm_out(x, residual, weight, None, EPS, EPS, 0.0, 0, normed, stream, cid)

        row = {"tokens": tokens, "hidden": hidden, "us": {}}
        timed = {"fused": fused}
        for name in QUANTS:
            quant = fp8.parse_quant(name)
            scale = torch.tensor([0.02], device="cuda") if quant == fp8.Quant.PER_TENSOR else None
            floor = fp8.DEFAULT_FLOOR.get(quant, 0.0)
            codes, scales = fp8.empty_outputs(x, quant, scale)

            def with_epilogue(quant=quant, floor=floor, codes=codes, scales=scales):
                ops.all_reduce_norm_quant_out(x, residual, weight, None, EPS, EPS, 0.0, 0, int(quant), floor, None,
                                              stream, codes, scales, cid)

            def then_quant(quant=quant, scale=scale, floor=floor):
                fused()
                quantize(normed, quant, scale, floor if scale is None else None, False)

            timed[f"fused + {name} epilogue"] = with_epilogue
            timed[f"fused, then {name} kernel"] = then_quant
        for name, fn in timed.items():
            row["us"][name] = graph_timing.slowest_rank_us(fn, warmup=3)
        rows.append(row)
        graph_timing.print_row(rank, f"{tokens:4d} x {hidden}", row)
    graph_timing.finish(comm, rank, world, rows, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < args.world:
        print(f"needs {args.world} GPUs ({gpus} visible): see the module's doc")
        return
    graph_timing.spawn("norm_fp8_local", args.world, _rank, args.out, 900)


if __name__ == "__main__":
    main()
