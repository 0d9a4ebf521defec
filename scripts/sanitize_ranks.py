"""One rank of scripts/sanitize.sh: runs every tpcomm kernel (every op, band
and layout variant) through the internal ops with an explicit algorithm, on
ranks that share one GPU, and checks each result.

    python scripts/sanitize_ranks.py --rank R --world W --port P

All ranks use GPU 0 (ranks sharing one GPU: tpcomm._testing.allow_shared_gpu)
and gloo for the host side. sanitize.sh runs rank 0 under compute-sanitizer
and the others plain. Inputs are small integers, so every sum is exact in
every dtype and results are compared bit for bit, except the fused norm's
normed output, held to 1 ulp of tpcomm.reference (its mean of squares is
summed in another order). Every case runs twice, so that the bulk kernels
also run on the other half of their slots and wait for the peers' release
of the first. Exits non-zero, naming the case, on any wrong result or error.
"""
import argparse
import os
import sys
import time

# No NVLink multicast, in this process and whatever it starts: set before
# torch and tpcomm are imported.
for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _value

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tpcomm import _constants as C  # noqa: E402

PACKET, BULK, LINE, TWO_SHOT = C.TPC_ALGO_PACKET, C.TPC_ALGO_BULK, C.TPC_ALGO_LINE, C.TPC_ALGO_TWO_SHOT
QUANT = {"fp8": C.TPC_ALGO_QUANTIZED_FP8, "int8": C.TPC_ALGO_QUANTIZED_INT8, "int4": C.TPC_ALGO_QUANTIZED_INT4}
EPS = 1e-6


def ints(shape, rank, salt, dtype):
    """Small integers in [-8, 8], different on every rank and case."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, device="cuda", dtype=torch.int64)
    v = (i * 7 + rank * 3 + salt * 5) % 17 - 8
    return v.to(dtype).reshape(shape)


class Cases:
    def __init__(self, comm, rank, world):
        self.comm, self.rank, self.world = comm, rank, world
        self.ops = torch.ops._tpcomm
        self.salt = 0

    def inputs(self, shape, dtype):
        """This rank's input and every rank's (to build the expected result)."""
        self.salt += 1
        return ints(shape, self.rank, self.salt, dtype), [ints(shape, r, self.salt, dtype)
                                                          for r in range(self.world)]

    def all_reduce(self, shape, dtype, algo):
        if algo == BULK and self.world == 2:  # routing's bulk all_reduce at two ranks: the one-shot
            algo = C.TPC_ALGO_BULK_ONE_SHOT
        x, xs = self.inputs(shape, dtype)
        want = sum(t.float() for t in xs).to(dtype)
        got = self.ops.all_reduce(x, self.comm.comm_id, algo)
        same(got, want)
        out = torch.empty_like(x)
        self.ops.all_reduce_out(x, out, self.comm.comm_id, algo)
        same(out, want)

    def quantized(self, numel, dtype, mode):
        """The quantized all-reduce: the bits of tpcomm.quantized_reference
        (not the exact sum: its codes round), in place too."""
        from tpcomm.quantized_reference import emulate

        _, xs = self.inputs((numel,), dtype)
        xs = [t * 0.37 for t in xs]  # not all small integers: groups whose codes round
        x = xs[self.rank].clone()
        want = emulate([t.cpu() for t in xs], mode).cuda()
        same(self.ops.all_reduce(x, self.comm.comm_id, QUANT[mode]), want)
        self.ops.all_reduce_out(x, x, self.comm.comm_id, QUANT[mode])
        same(x, want)

    def all_gather(self, shape, dim, dtype, algo):
        x, xs = self.inputs(shape, dtype)
        same(self.ops.all_gather(x, dim, self.comm.comm_id, algo), torch.cat(xs, dim))

    def reduce_scatter(self, shape, dtype, algo, f32):
        x, xs = self.inputs(shape, dtype)
        total = sum(t.float() for t in xs)
        part = shape[0] // self.world
        want = total[self.rank * part:(self.rank + 1) * part]
        op = self.ops.reduce_scatter_f32 if f32 else self.ops.reduce_scatter
        same(op(x, self.comm.comm_id, algo), want if f32 else want.to(dtype))

    def vectors(self, hidden, dtype, pattern, bias):
        """(weight, next_weight, bias, next_bias) of `pattern`: the second
        norm's where it has one, the biases where `bias` (LayerNorm only)."""
        second = pattern in (C.TPC_PATTERN_NORM_ADD_NORM, C.TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM)
        weight = ints((hidden,), 0, self.salt + 200, dtype)
        next_weight = ints((hidden,), 0, self.salt + 300, dtype) if second else None
        b = ints((hidden,), 0, self.salt + 400, dtype) if bias else None
        next_b = ints((hidden,), 0, self.salt + 500, dtype) if bias and second else None
        return weight, next_weight, b, next_b

    def add_rms_norm(self, rows, hidden, dtype, in_place, pattern=C.TPC_PATTERN_ADD_NORM, offset=0.0, bias=False,
                     scale=1.0):
        """The fused norm family on `pattern` (tpc_norm_pattern), residual
        scale `scale`. The stream output of ADD_NORM and ADD_LAYER_NORM (z) is
        the reference bit for bit; o (the others) takes a norm, so it and
        every normed output are held to 1 ulp (the kernel sums in another
        order)."""
        from tpcomm.reference import reference_all_reduce_norm, ulp_distance

        x, xs = self.inputs((rows, hidden), dtype)
        residual = ints((rows, hidden), 0, self.salt + 100, dtype)  # the same on every rank
        weight, next_weight, b, next_b = self.vectors(hidden, dtype, pattern, bias)
        want_normed, want_stream = reference_all_reduce_norm(xs, residual, weight, EPS, pattern, offset, next_weight,
                                                             EPS / 2, b, next_b, scale)
        if in_place:  # normed into x, the stream output into residual: the kernel without "spread"
            normed, stream = x, residual
        else:
            normed, stream = torch.empty_like(x), torch.empty_like(x)
        self.ops.all_reduce_norm_out(x, residual, weight, next_weight, EPS, EPS / 2, offset, pattern, normed, stream,
                                     self.comm.comm_id, b, next_b, scale)
        if pattern in (C.TPC_PATTERN_ADD_NORM, C.TPC_PATTERN_ADD_LAYER_NORM):
            same(stream, want_stream)
        for got, want, what in ((stream, want_stream, "stream"), (normed, want_normed, "normed")):
            far = int(ulp_distance(got, want).max())
            if far > 1:
                raise AssertionError(f"{what} is {far} ulp from the reference")

    def norm_fp8(self, rows, hidden, dtype, pattern, quant, normed_out, column_major=False, offset=0.0, bias=False,
                 scale_m=1.0):
        """The fused norm family's FP8 epilogue (tpc_norm_quant): the normed
        output (written, or not) as the fused norm holds it, and the codes
        and scales bit for bit tpcomm.fp8.quantize of the kernel's own
        normed output (the epilogue quantizes what it rounded)."""
        from tpcomm import fp8
        from tpcomm.reference import reference_all_reduce_norm, ulp_distance

        x, xs = self.inputs((rows, hidden), dtype)
        residual = ints((rows, hidden), 0, self.salt + 100, dtype)
        weight, next_weight, b, next_b = self.vectors(hidden, dtype, pattern, bias)
        want_normed, _ = reference_all_reduce_norm(xs, residual, weight, EPS, pattern, offset, next_weight, EPS / 2,
                                                   b, next_b, scale_m)
        scale = torch.tensor([0.01], device=x.device) if quant == C.TPC_QUANT_PER_TENSOR else None
        floor = fp8.DEFAULT_FLOOR[quant] if scale is None else 0.0
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        groups = hidden // C.TPC_FP8_GROUP if quant == C.TPC_QUANT_PER_TOKEN_GROUP else 1
        if scale is not None:
            scales = scale
        elif column_major:
            scales = torch.empty(groups, rows, device=x.device).t()
        else:
            scales = torch.empty(rows, groups, device=x.device)
        normed, stream = torch.empty_like(x), torch.empty_like(x)
        self.ops.all_reduce_norm_quant_out(x, residual, weight, next_weight, EPS, EPS / 2, offset, pattern, quant,
                                           floor, normed, stream, codes, scales, self.comm.comm_id, b, next_b, scale_m)
        far = int(ulp_distance(normed, want_normed).max())
        if far > 1:
            raise AssertionError(f"normed is {far} ulp from the reference")
        want_codes, want_scales = fp8.quantize(normed, quant, scale=scale, floor=floor if scale is None else None,
                                               column_major_scales=column_major)
        same_fp8(codes, want_codes)
        if scale is None:
            same(scales.contiguous(), want_scales.contiguous().reshape(scales.shape))
        if not normed_out:  # the same codes without the 16-bit normed output
            codes2 = torch.empty_like(codes)
            self.ops.all_reduce_norm_quant_out(x, residual, weight, next_weight, EPS, EPS / 2, offset, pattern, quant,
                                               floor, None, stream, codes2, scales, self.comm.comm_id, b, next_b,
                                               scale_m)
            same_fp8(codes2, want_codes)

    def all(self):
        """(name, thunk) of every case: each kernel of launch.cu, its bands'
        sizes, and the layout variants that take other code paths."""
        bf16, f32, f16 = torch.bfloat16, torch.float32, torch.float16
        n = self.world
        # Two ranks run the one-shot, where 4 MiB gives a block several steps
        # (the push-ahead path); more run the two-shot, laid over one chunk,
        # where 13 MiB gives a block several steps and its slots outgrow a
        # half of the 16 MiB communicator's region (they take the whole).
        streamed = ([("all_reduce bulk 4 MiB", lambda: self.all_reduce((2 * 1024 * 1024,), bf16, BULK))] if n == 2
                    else [("all_reduce bulk 13 MiB", lambda: self.all_reduce((13 * 512 * 1024,), bf16, BULK))])
        big_part = (min(5 << 20, (16 << 20) // n) - 16) // 2  # a reduce_scatter part's 16-bit elements (below)
        return streamed + [
            # packet: one block (the control lanes check the headers), several
            # blocks (thread 0 checks them in its first wait)
            ("all_reduce packet 64 B", lambda: self.all_reduce((32,), bf16, PACKET)),
            ("all_reduce packet 16 KiB f32", lambda: self.all_reduce((4096,), f32, PACKET)),
            ("all_reduce line 16 KiB", lambda: self.all_reduce((8192,), bf16, LINE)),
            # two_shot: chunks of unequal steps (an odd number of them), and one step a rank
            ("all_reduce two_shot 16 KiB + 16", lambda: self.all_reduce((8200,), bf16, TWO_SHOT)),
            ("all_reduce two_shot a step a rank f32", lambda: self.all_reduce((112 * n,), f32, TWO_SHOT)),
            # the streamed kernels in every dtype: each instantiation is a handoff kernel whose
            # racecheck run must draw reports (sanitize.sh)
            ("all_reduce bulk 64 KiB f16", lambda: self.all_reduce((32768,), f16, BULK)),
            ("all_reduce bulk 64 KiB f32", lambda: self.all_reduce((16384,), f32, BULK)),
            # quantized (the two-shot's schedule): several steps a block at 13 MiB, a chunk
            # that ends inside a group, fewer units than ranks
            ("all_reduce quant int8 13 MiB", lambda: self.quantized(13 * 512 * 1024, bf16, "int8")),
            ("all_reduce quant fp8 64 KiB + 48 f16", lambda: self.quantized(32768 + 24, f16, "fp8")),
            ("all_reduce quant int4 48 B", lambda: self.quantized(24, bf16, "int4")),
            # and the other dtype of each mode: every instantiation a handoff kernel that must draw reports
            ("all_reduce quant int8 64 KiB f16", lambda: self.quantized(32768, f16, "int8")),
            ("all_reduce quant fp8 64 KiB", lambda: self.quantized(32768, bf16, "fp8")),
            ("all_reduce quant int4 64 KiB f16", lambda: self.quantized(32768, f16, "int4")),
            # packet all_gather: the flat kernel (dim 0, 8-byte multiple), the
            # general one with whole 8-byte units and with 4-byte ones
            ("all_gather packet flat 4 KiB", lambda: self.all_gather((2048,), 0, bf16, PACKET)),
            ("all_gather packet dim 1", lambda: self.all_gather((16, 24), 1, bf16, PACKET)),
            ("all_gather packet dim 1, odd words", lambda: self.all_gather((8, 6), 1, bf16, PACKET)),
            ("all_gather line 16 KiB", lambda: self.all_gather((8192,), 0, bf16, LINE)),
            ("all_gather line dim 1", lambda: self.all_gather((64, 64), 1, bf16, LINE)),
            ("all_gather bulk 256 KiB", lambda: self.all_gather((131072,), 0, bf16, BULK)),
            ("all_gather bulk dim 1", lambda: self.all_gather((64, 1024), 1, bf16, BULK)),
            ("reduce_scatter packet", lambda: self.reduce_scatter((n * 1024,), bf16, PACKET, False)),
            ("reduce_scatter packet f32 out", lambda: self.reduce_scatter((n * 1024,), bf16, PACKET, True)),
            ("reduce_scatter line", lambda: self.reduce_scatter((n * 8200,), bf16, LINE, False)),
            ("reduce_scatter line f32 out", lambda: self.reduce_scatter((n * 8200,), bf16, LINE, True)),
            # bulk (streamed over one part at every world size): parts of 5 MiB - 16 (up to three
            # ranks; the cap allows 16 MiB in all) give a block two or three steps of 8 warps (the
            # push-ahead path) and end inside a warp step; 64 KiB parts run 4-warp blocks of one
            # step. fp32 sums of a 16-bit input take 32 bytes a unit, of fp32 input 16.
            ("reduce_scatter bulk 5 MiB parts", lambda: self.reduce_scatter((n * big_part,), bf16, BULK, False)),
            ("reduce_scatter bulk 5 MiB parts f32 out",
             lambda: self.reduce_scatter((n * big_part,), f16, BULK, True)),
            ("reduce_scatter bulk f32 out", lambda: self.reduce_scatter((n * 16384,), f32, BULK, True)),
            ("reduce_scatter bulk 64 KiB parts f32", lambda: self.reduce_scatter((n * 16384,), f32, BULK, False)),
            ("reduce_scatter bulk 64 KiB parts f16", lambda: self.reduce_scatter((n * 32768,), f16, BULK, False)),
            ("reduce_scatter bulk 64 KiB parts bf16 f32 out",
             lambda: self.reduce_scatter((n * 32768,), bf16, BULK, True)),
            # the fused norm family: out of place with few rows ("spread": every
            # block pushes) and in place, each pattern (the second norm's block
            # sum of NORM_ADD_NORM, weight 1 + w); the split route is
            # reduce_scatter f32 out (above), torch's norm and an all_gather
            ("all_reduce_add_rms_norm spread", lambda: self.add_rms_norm(2, 4096, bf16, False)),
            ("all_reduce_add_rms_norm in place", lambda: self.add_rms_norm(8, 2048, f16, True)),
            ("all_reduce_rms_norm_add spread", lambda: self.add_rms_norm(3, 2048, f16, False, C.TPC_PATTERN_NORM_ADD)),
            ("all_reduce_rms_norm_add_rms_norm in place, weight 1 + w",
             lambda: self.add_rms_norm(4, 4096, bf16, True, C.TPC_PATTERN_NORM_ADD_NORM, 1.0)),
            # its FP8 epilogues: each quantization, the normed output written or not, column-major scales
            ("all_reduce_norm fp8 per_token spread",
             lambda: self.norm_fp8(3, 4096, bf16, C.TPC_PATTERN_ADD_NORM, C.TPC_QUANT_PER_TOKEN, True)),
            ("all_reduce_norm fp8 per_token_group column-major, weight 1 + w",
             lambda: self.norm_fp8(5, 2048, f16, C.TPC_PATTERN_NORM_ADD_NORM, C.TPC_QUANT_PER_TOKEN_GROUP, False,
                                   True, 1.0)),
            ("all_reduce_norm fp8 per_tensor",
             lambda: self.norm_fp8(2, 2048, bf16, C.TPC_PATTERN_NORM_ADD, C.TPC_QUANT_PER_TENSOR, False)),
            # the LayerNorm members (two block sums a norm: the mean, then the centred squares)
            # with biases and residual scales, and the scale on an RMS member
            ("all_reduce_add_layer_norm spread, bias, m 0.5",
             lambda: self.add_rms_norm(2, 4096, bf16, False, C.TPC_PATTERN_ADD_LAYER_NORM, 0.0, True, 0.5)),
            ("all_reduce_layer_norm_add in place",
             lambda: self.add_rms_norm(8, 2048, f16, True, C.TPC_PATTERN_LAYER_NORM_ADD)),
            ("all_reduce_layer_norm_add_layer_norm spread, weight 1 + w, bias, m -1.5",
             lambda: self.add_rms_norm(3, 4096, bf16, False, C.TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM, 1.0, True,
                                       -1.5)),
            ("all_reduce_rms_norm_add in place, m 2",
             lambda: self.add_rms_norm(4, 2048, f16, True, C.TPC_PATTERN_NORM_ADD, 0.0, False, 2.0)),
            # rows of 16384 values: the instantiation with 8 units a thread (launch.cu)
            ("all_reduce_add_rms_norm wide rows", lambda: self.add_rms_norm(2, 16384, bf16, False)),
            ("all_reduce_norm fp8 per_token wide rows",
             lambda: self.norm_fp8(2, 16384, f16, C.TPC_PATTERN_NORM_ADD_NORM, C.TPC_QUANT_PER_TOKEN, False)),
            ("all_reduce_norm fp8 per_token_group after a LayerNorm, bias",
             lambda: self.norm_fp8(3, 2048, bf16, C.TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM,
                                   C.TPC_QUANT_PER_TOKEN_GROUP, True, False, 0.0, True, 0.75)),
        ]


def same(got, want):
    """Bit for bit."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    differ = got.contiguous().view(bits) != want.contiguous().view(bits)
    if bool(differ.any()):
        first = differ.nonzero()[0].tolist()
        raise AssertionError(f"{int(differ.sum())} elements differ, the first at {first}: "
                             f"{got[tuple(first)].item()} != {want[tuple(first)].item()}")


def same_fp8(got, want):
    """e4m3 codes bit for bit, but NaN: the kernel writes 0x7f, torch keeps the sign."""
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    nan_g, nan_w = (g & 0x7f) == 0x7f, (w & 0x7f) == 0x7f
    if bool((nan_g != nan_w).any()) or bool(((g != w) & ~nan_g).any()):
        differ = ((g != w) & ~(nan_g & nan_w)).nonzero()
        raise AssertionError(f"{len(differ)} codes differ, the first at {differ[0].tolist()}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--only", action="append", default=[],
                   help="run only the cases whose name contains this text (repeatable)")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="tpcomm's bound on device waits: the rank under the tool runs far slower than its peers")
    args = p.parse_args()

    import tpcomm
    import tpcomm._testing

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    tpcomm._testing.allow_shared_gpu(True)
    comm = tpcomm.Communicator(dist.group.WORLD, device=torch.device("cuda", 0), max_bytes=16 << 20,
                               timeout_s=args.timeout_s)
    if not comm.enabled:
        raise SystemExit(f"rank {args.rank}: tpcomm's custom path is off: {comm.disabled_reason}")
    cases = Cases(comm, args.rank, args.world)
    chosen = [(name, run) for name, run in cases.all() if not args.only or any(o in name for o in args.only)]
    if not chosen:
        raise SystemExit(f"rank {args.rank}: no case matches {args.only}")
    start = time.monotonic()
    for round_ in range(2):
        for name, run in chosen:
            try:
                run()
                torch.cuda.synchronize()
            except BaseException as e:
                print(f"rank {args.rank}: FAILED {name} (round {round_}): {e}", file=sys.stderr, flush=True)
                raise
            if args.rank == 0 and round_ == 0:
                print(f"ok {name}", flush=True)
    comm.check()
    print(f"rank {args.rank}: {2 * len(chosen)} ops checked in {time.monotonic() - start:.1f} s", flush=True)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
