"""A small tensor-parallel decoder whose linears are FP8 e4m3, as FP8
checkpoints serve (Llama-3 / Qwen3 FP8: per-tensor or per-token scales;
DeepSeek-V3 block FP8: groups of 128), run by eager torch and by
torch.compile with tpcomm.compile_backend, with no change to the model:

    torchrun --nproc-per-node 2 examples/tp_fp8.py              # one rank per GPU, NCCL, bf16
    python examples/tp_fp8.py --cpu                              # 2 gloo processes on the CPU, fp32
    python examples/tp_fp8.py --cpu --quant group --inner inductor

Per layer: RMSNorm (Llama's code, tp_functional.LlamaStyleRMSNorm), its
output quantized to FP8 by the model's own torch code (quantize()), a
column-parallel QKV projection, causal attention over this rank's heads (no
rotary embedding: the collectives do not care), a row-parallel output
projection summed by dist.all_reduce in place, the residual add, RMSNorm,
quantize, a column-parallel gate+up projection, SiLU(gate) * up, quantize, a
row-parallel down projection summed by funcol.all_reduce, the residual add.
After the last layer: the final RMSNorm, quantize, and a row-parallel LM head
(each rank its slice of the hidden size) whose partial logits
funcol.all_reduce sums. The embedding is replicated, and the head is tied to
it (as Llama-3.2 1B / 3B and Gemma tie theirs): with random weights that
makes the logits decisive (the input token's logit leads by far more than
bf16's and FP8's rounding moves a logit), so the greedy tokens are a check,
not a coin toss between near-equal logits as with a random untied head.

The quantization (--quant), of every linear's input, in the forms
tpcomm.fusion_fp8 matches after a fused norm:
  static  codes = (x.float() / s).clamp(-448, 448).to(e4m3), s a calibrated
          per-tensor fp32 buffer (here a fixed STATIC_SCALE); weights one scale each
  token   s = (x.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
          (vLLM's dynamic per-token quantization); weights one scale per output row
  group   the same per 128 columns, s = amax.clamp(min=1e-10) / 448 (DeepSeek's
          per_token_group_quant); weights one scale per 128 x 128 block
The matmul (fp8_linear): torch._scaled_mm with per-tensor scales (static,
any device), on CUDA also rowwise for token (scale_a (M, 1), scale_b (1, N),
fp32, bf16 out). torch._scaled_mm on the CPU takes per-tensor scales only,
and nowhere block scales: there (token on the CPU or in fp32; group
everywhere) the codes are dequantized (codes.float() * scales, each scale
broadcast over its row, group or block) and multiplied in fp32: the same
quantization, another matmul.

So every all-reduce of the model is followed by the residual add, an RMSNorm
and a quantization but the head's (its logits are the output):
tpcomm.compile_backend puts each such all-reduce, its add, norm and
quantization into one torch.ops._tpcomm.all_reduce_norm_fp8 call (counted
under "all_reduce_add_rms_norm_fp8"; collectives()), and the first layer's
quantization (of the embedding's norm, no all-reduce before it) and those of
the row-parallel inputs stay the model's.

Ways it runs are tp_functional's (tp_functional.run_modes): torch (eager),
install, compiled (torch.compile(backend=INNER)), compiled_tpcomm
(collectives on tpcomm, the model's arithmetic), compiled_fused (also the
add + RMSNorm + quantization fused). Printed per way: the greedy tokens
(argmax of every position's logits) equal to eager torch's, bit-equal to its
reference as in tp_functional, and tpcomm's calls from Communicator.stats().
"""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import tpcomm
from tpcomm.fp8 import FP8_MAX, GROUP, e4m3

import tp_functional
from tp_functional import LlamaStyleRMSNorm

QUANTS = ("static", "token", "group")
SMALL = dict(layers=2, hidden=256, heads=4, mlp=512, vocab=256, tokens=16, eps=1e-5)
STATIC_SCALE = 8.0 / FP8_MAX  # every static activation scale: |x| up to 8 before saturating


def quantize(x, quant, scale=None):
    """(codes, scales) of activations x as model code quantizes them
    (module doc): codes e4m3 of x's shape; scales `scale` (static), (..., 1)
    (token) or (..., H / 128) (group), fp32."""
    f = x.float()
    if quant == "static":
        return (f / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    if quant == "token":
        s = (f.abs().amax(dim=-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
        return (f / s).clamp(-448, 448).to(torch.float8_e4m3fn), s
    g = f.view(*f.shape[:-1], -1, 128)
    s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448
    return (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(f.shape), s.squeeze(-1)


def quantize_weight(w, quant):
    """(codes, scales) of a full fp32 weight (out, in): one scale (static),
    one per output row, shape (out, 1) (token), one per 128 x 128 block,
    shape (out / 128, in / 128) (group)."""
    if quant == "group":
        blocks = w.unflatten(0, (-1, GROUP)).unflatten(-1, (-1, GROUP))
        s = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        return e4m3(blocks / s[:, None, :, None]).flatten(2).flatten(0, 1), s
    s = w.abs().amax() if quant == "static" else w.abs().amax(dim=1, keepdim=True)
    return e4m3(w / (s / FP8_MAX)), s / FP8_MAX


def dequantize(codes, scales, quant):
    """fp32 values of activation codes (..., K) with their scales."""
    if quant == "group":
        return (codes.float().unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)).flatten(-2)
    return codes.float() * scales


def dequantize_weight(codes, scales, quant):
    """fp32 values of weight codes (out, in) with their scales (quantize_weight's)."""
    if quant == "group":
        blocks = codes.float().unflatten(0, (-1, GROUP)).unflatten(-1, (-1, GROUP))
        return (blocks * scales[:, None, :, None]).flatten(2).flatten(0, 1)
    return codes.float() * scales


def fp8_linear(codes, scales, weight, weight_scales, quant, out_dtype):
    """codes @ weight.T with their scales, out_dtype (module doc: _scaled_mm
    where torch has it for these scales, else dequantized in fp32)."""
    if quant == "static" or (quant == "token" and codes.is_cuda and out_dtype == torch.bfloat16):
        return torch._scaled_mm(codes, weight.t(), scale_a=scales, scale_b=weight_scales.t(), out_dtype=out_dtype)
    a, w = dequantize(codes, scales, quant), dequantize_weight(weight, weight_scales, quant)
    return F.linear(a, w).to(out_dtype)


class Fp8Linear(torch.nn.Module):
    """This rank's part of an FP8 linear: e4m3 weight codes (out, in), their
    scales, and the static activation scale (`input_scale`, as FP8
    checkpoints name it; used by static only)."""

    def __init__(self, codes, scales, quant):
        super().__init__()
        self.quant = quant
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("weight_scale", scales.contiguous())
        self.register_buffer("input_scale", torch.tensor(STATIC_SCALE, device=codes.device))

    def quantize(self, x):
        return quantize(x, self.quant, self.input_scale)

    def forward(self, codes, scales, out_dtype):
        return fp8_linear(codes, scales, self.weight, self.weight_scale, self.quant, out_dtype)


class Layer(torch.nn.Module):
    def __init__(self, parts, group, heads, eps):
        super().__init__()
        self.group, self.heads = group, heads
        self.input_norm = LlamaStyleRMSNorm(parts["input_norm"], eps)
        self.qkv, self.o = parts["qkv"], parts["o"]
        self.post_norm = LlamaStyleRMSNorm(parts["post_norm"], eps)
        self.gate_up, self.down = parts["gate_up"], parts["down"]

    def forward(self, h):
        dtype, tokens = h.dtype, h.shape[0]
        qkv = self.qkv(*self.qkv.quantize(self.input_norm(h)), dtype)
        q, k, v = (t.view(tokens, self.heads, -1).transpose(0, 1) for t in qkv.chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(tokens, -1)
        y = self.o(*self.o.quantize(a), dtype)
        dist.all_reduce(y, group=self.group)  # in place, as transformers' RowwiseParallel
        h = h + y
        gate, up = self.gate_up(*self.gate_up.quantize(self.post_norm(h)), dtype).chunk(2, dim=-1)
        y = self.down(*self.down.quantize(F.silu(gate) * up), dtype)
        return h + funcol.all_reduce(y, "sum", self.group)


class TPFp8Model(torch.nn.Module):
    """Token ids (tokens,) -> logits (tokens, vocab), every rank the same."""

    def __init__(self, parts, group, rank, world, heads, eps):
        super().__init__()
        self.group, self.rank, self.world = group, rank, world
        self.embed = torch.nn.Parameter(parts["embed"], requires_grad=False)
        self.layers = torch.nn.ModuleList(Layer(p, group, heads // world, eps) for p in parts["layers"])
        self.final_norm = LlamaStyleRMSNorm(parts["final_norm"], eps)
        self.head = parts["head"]

    def forward(self, ids):
        h = F.embedding(ids, self.embed)
        for layer in self.layers:
            h = layer(h)
        codes, scales = self.head.quantize(self.final_norm(h))
        if self.head.quant == "group":
            scales = scales.chunk(self.world, -1)[self.rank]  # this rank's groups
        mine = codes.chunk(self.world, -1)[self.rank].contiguous()  # this rank's slice of the hidden size
        return funcol.all_reduce(self.head(mine, scales, h.dtype), "sum", self.group)


def _unit(quant):
    """The columns a rank's slice is a multiple of: the block of the scales; _scaled_mm's 16 on CUDA."""
    return GROUP if quant == "group" else 16


def check_dims(dims, world, quant):
    """Raises ValueError where `dims` do not split among `world` ranks for `quant`."""
    unit = _unit(quant)
    for name in ("hidden", "mlp"):
        if dims[name] % (unit * world):
            raise ValueError(f"{name} {dims[name]} must be a multiple of {unit} * {world} ranks for {quant}")
    if dims["heads"] % world or dims["vocab"] % unit:
        raise ValueError(f"heads {dims['heads']} must divide among {world} ranks, vocab {dims['vocab']} by {unit}")


def dims_for(world, quant, dims=SMALL):
    """`dims` where they split among `world` ranks for `quant` (check_dims),
    else widened to the next sizes that do: hidden and mlp to multiples of
    the unit times the world, heads to a multiple of the world that divides
    hidden. SMALL splits as it is among 2 ranks for every quantization."""
    step = _unit(quant) * world

    def up(n, multiple):
        return -(-n // multiple) * multiple
    hidden, heads = up(dims["hidden"], step), up(dims["heads"], world)
    while hidden % heads:
        hidden += step
    return dict(dims, hidden=hidden, heads=heads, mlp=up(dims["mlp"], step))


def build(rank, world, group, quant, dims=None, dtype=torch.float32, device="cpu", seed=0):
    """The model's part on `rank`: every rank draws the full fp32 weights
    from `seed`, quantizes each whole (quantize_weight) and keeps its rows
    (column-parallel) or columns (row-parallel) with their scales."""
    dims = dims or SMALL
    check_dims(dims, world, quant)
    g = torch.Generator().manual_seed(seed)
    hidden, mlp, vocab = dims["hidden"], dims["mlp"], dims["vocab"]

    def full(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def norm_weight():
        return (1.0 + 0.1 * torch.randn(hidden, generator=g)).to(dtype=dtype, device=device)

    def column(*weights):  # this rank's rows of each, stacked: q, k, v (gate, up) side by side in the output
        codes, scales = quantize_weight(torch.cat(weights), quant)
        rows = [w.shape[0] for w in weights]

        def mine(t, unit):
            return torch.cat([part.chunk(world)[rank] for part in t.split([r // unit for r in rows])])
        scales = scales if quant == "static" else mine(scales, GROUP if quant == "group" else 1)
        return Fp8Linear(mine(codes, 1).to(device), scales.to(device), quant)

    def row(weight):  # this rank's columns
        codes, scales = quantize_weight(weight, quant)
        scales = scales.chunk(world, 1)[rank] if quant == "group" else scales
        return Fp8Linear(codes.chunk(world, 1)[rank].to(device), scales.to(device), quant)

    layers = [dict(input_norm=norm_weight(), qkv=column(*(full(hidden, hidden) for _ in range(3))),
                   o=row(full(hidden, hidden)), post_norm=norm_weight(),
                   gate_up=column(full(mlp, hidden), full(mlp, hidden)), down=row(full(hidden, mlp)))
              for _ in range(dims["layers"])]
    embed = torch.randn(vocab, hidden, generator=g)
    parts = dict(embed=embed.to(dtype=dtype, device=device), layers=layers, final_norm=norm_weight(),
                 head=row(embed))  # tied
    return TPFp8Model(parts, group, rank, world, dims["heads"], dims["eps"]).eval()


def collectives(layers=SMALL["layers"]):
    """What one forward issues, by the compile pass's count keys: per layer
    two all-reduces, each followed by the residual add, an RMSNorm and its
    quantization ("fused_fp8": all fused, with the quantization, into
    all_reduce_norm_fp8, the ADD_NORM pattern), and the head's all-reduce
    (nothing follows it: an all-reduce after any rewrite)."""
    return {"all_reduce": 2 * layers + 1, "fused_fp8": 2 * layers}


def example_input(dims=None, device="cpu", seed=1):
    """Token ids, the same on every rank."""
    dims = dims or SMALL
    return torch.randint(dims["vocab"], (dims["tokens"],), generator=torch.Generator().manual_seed(seed)).to(device)


def tokens(results):
    """{mode: greedy tokens} and whether every mode's equal eager torch's."""
    greedy = {mode: r["out"].argmax(-1) for mode, r in results.items()}
    return greedy, all(torch.equal(t, greedy["torch"]) for t in greedy.values())


def main(rank, world, args):
    device = tp_functional.rank_device(rank, args.cpu)
    dtype, group = getattr(torch, args.dtype), dist.group.WORLD
    comm = tpcomm.Communicator(group, device=device)
    for quant in args.quant:
        dims = dims_for(world, quant)
        x = example_input(dims, device=device)
        model = build(rank, world, group, quant, dims, dtype=dtype, device=device)
        results = tp_functional.run_modes(model, x, comm, group, inner=args.inner)
        rows, (greedy, same) = tp_functional.summary(results), tokens(results)
        if rank == 0:
            print(f"{quant}: {world} ranks on {device.type}, {dtype}, greedy tokens of every way equal eager "
                  f"torch's: {same} ({greedy['torch'].tolist()})")
            for mode, row in rows.items():
                print(f"  {mode:16s} bit_equal={row['bit_equal']!s:5s} max_abs_diff={row['max_abs_diff']:.3g} "
                      f"tpcomm calls={row['calls']}")
    comm.close()


def parse(argv=None):
    p = tp_functional.parser(__doc__.split("\n")[0])
    p.add_argument("--quant", choices=QUANTS, action="append", help=f"repeatable; default all of {QUANTS}")
    args = tp_functional.parsed(p, argv)
    args.quant = args.quant or list(QUANTS)
    return args


if __name__ == "__main__":
    tp_functional.run_cli(main, parse(), "tp_fp8")
