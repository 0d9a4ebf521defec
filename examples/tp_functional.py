"""A small tensor-parallel model written the way torch-native TP code is
written, run with and without tpcomm, with no change to the model:

    torchrun --nproc-per-node 2 examples/tp_functional.py     # one rank per GPU, NCCL
    python examples/tp_functional.py --cpu                     # 2 gloo processes on the CPU (spawned here)
    python examples/tp_functional.py --cpu --all-reduce-only   # every collective an all-reduce

The model issues its collectives as such code does: per block, a
row-parallel output summed with dist.all_reduce(y, group=...) in place (as
Hugging Face transformers' RowwiseParallel does at inference) and one with
the functional funcol.all_reduce (torchtitan, DTensor's Partial); then, by
default, a sequence-parallel tail MLP (dist.reduce_scatter_tensor over the
tokens, the residual added to this rank's part, dist.all_gather_into_tensor
back) and a vocabulary-parallel LM head whose slices funcol.all_gather_tensor
stacks (dim 0) and torch.cat puts side by side. With --all-reduce-only
(build(..., all_reduce_only=True)) every collective is an all-reduce: the
tail's sum one more dist.all_reduce in place, as the blocks', and the LM head
row-parallel (each rank its slice of the hidden size) with its partial
logits summed by funcol.all_reduce. Each RMSNorm after an all-reduce is
written either as torch.nn.RMSNorm or as Llama's model code writes it.

The all-reduce-only form is the one to run where ranks share one GPU over
gloo: gloo's all-gather into one tensor, which functional collectives use,
copies CUDA memory as host memory and crashes the process (pytorch#152645).

Ways it runs (every rank builds the same weights from one seed and keeps
its part):
  torch           eager, torch.distributed only: the reference
  install         eager inside tpcomm.install(group): the dist.* calls go
                  through tpcomm's Communicator (funcol's are C++ and stay torch's)
  compiled        torch.compile(model, backend=INNER)
  compiled_tpcomm torch.compile(model, backend=tpcomm.compile_backend(INNER, fuse=False)):
                  every collective on tpcomm, the model's arithmetic unchanged
  compiled_fused  tpcomm.compile_backend(INNER): also the add + RMSNorm after
                  each all-reduce in one tpcomm op (computed in fp32, rounded once)
Printed per way: bit-equal to its reference (install to torch, the compiled
ones to compiled), the largest difference, and tpcomm's calls by (op,
backend) from Communicator.stats(): on GPUs its kernels (packet, line,
bulk, fused), on the CPU its torch.distributed fallback ("gloo").
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import tpcomm

SMALL = dict(layers=2, hidden=128, mlp=256, vocab=192, tokens_per_rank=4, eps=1e-5)


def small(world):
    """SMALL with hidden, mlp and vocab rounded up to multiples of 8 * world:
    every rank's slice a whole number of 16-byte bf16 units at any world
    size (SMALL itself at 2, 4 and 8 ranks)."""
    unit = 8 * world
    return dict(SMALL, **{k: -(-SMALL[k] // unit) * unit for k in ("hidden", "mlp", "vocab")})


MODES = ("torch", "install", "compiled", "compiled_tpcomm", "compiled_fused")


class LlamaStyleRMSNorm(torch.nn.Module):
    """RMSNorm as Llama's model code writes it (Hugging Face's LlamaRMSNorm)."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.eps = eps

    def forward(self, h):
        dtype = h.dtype
        h32 = h.to(torch.float32)
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h32.to(dtype)


def _rms_norm(weight, eps):
    norm = torch.nn.RMSNorm(weight.shape[0], eps=eps, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


class _Parallel(torch.nn.Module):
    """Column-parallel in (this rank's columns), row-parallel out (its rows):
    the partial sum of the MLP, to be reduced over the group."""

    def __init__(self, w_in, w_out):
        super().__init__()
        self.w_in = torch.nn.Parameter(w_in)
        self.w_out = torch.nn.Parameter(w_out)

    def forward(self, h):
        return F.linear(F.silu(F.linear(h, self.w_in)), self.w_out)


class Block(torch.nn.Module):
    def __init__(self, parts, group, eps):
        super().__init__()
        self.group = group
        self.norm1 = _rms_norm(parts["norm1"], eps)
        self.mlp1 = _Parallel(parts["in1"], parts["out1"])
        self.norm2 = LlamaStyleRMSNorm(parts["norm2"], eps)
        self.mlp2 = _Parallel(parts["in2"], parts["out2"])

    def forward(self, h):
        y = self.mlp1(self.norm1(h))
        dist.all_reduce(y, group=self.group)  # in place, as transformers' RowwiseParallel
        h = h + y
        y = self.mlp2(self.norm2(h))
        return h + funcol.all_reduce(y, "sum", self.group)


class TPModel(torch.nn.Module):
    def __init__(self, parts, group, rank, world, eps, all_reduce_only=False):
        super().__init__()
        self.group, self.rank, self.world = group, rank, world
        self.all_reduce_only = all_reduce_only
        self.blocks = torch.nn.ModuleList(Block(p, group, eps) for p in parts["blocks"])
        self.tail_norm = _rms_norm(parts["tail_norm"], eps)
        self.tail = _Parallel(parts["tail_in"], parts["tail_out"])
        self.final_norm = _rms_norm(parts["final_norm"], eps)
        self.head = torch.nn.Parameter(parts["head"])

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        y = self.tail(self.tail_norm(h))
        if self.all_reduce_only:
            dist.all_reduce(y, group=self.group)  # in place, as the blocks' first sum
            mine = self.final_norm(h + y).chunk(self.world, -1)[self.rank]  # this rank's slice of the hidden size
            return funcol.all_reduce(F.linear(mine, self.head), "sum", self.group)
        part = torch.empty((h.shape[0] // self.world,) + tuple(h.shape[1:]), dtype=h.dtype, device=h.device)
        dist.reduce_scatter_tensor(part, y, group=self.group)  # this rank's tokens
        part = part + h.chunk(self.world)[self.rank]
        h = torch.empty_like(h)
        dist.all_gather_into_tensor(h, part, group=self.group)
        local = F.linear(self.final_norm(h), self.head)        # this rank's slice of the vocabulary
        stacked = funcol.all_gather_tensor(local, 0, self.group)  # every rank's slice, one after the other
        return torch.cat(stacked.chunk(self.world), dim=1)


def build(rank, world, group, dims=None, dtype=torch.float32, device="cpu", seed=0, all_reduce_only=False):
    """The model's part on `rank`: every rank draws the full weights from
    `seed` (in fp32, then cast) and keeps its columns and rows.
    `all_reduce_only`: the tail's sum all-reduced in place and the LM head
    split over the hidden size (True), or the tail sequence parallel and the
    head split over the vocabulary (False); the same logits up to rounding
    either way."""
    dims = dims or small(world)
    g = torch.Generator().manual_seed(seed)
    hidden, mlp, vocab = dims["hidden"], dims["mlp"], dims["vocab"]
    if mlp % world or vocab % world or hidden % world:
        raise ValueError(f"mlp {mlp}, vocab {vocab} and hidden {hidden} must divide among {world} ranks")

    def full(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    def norm_weight():
        return 1.0 + 0.1 * torch.randn(hidden, generator=g)

    def mine(w, dim):
        return w.chunk(world, dim)[rank]

    def mlp_parts():
        return mine(full(mlp, hidden), 0), mine(full(hidden, mlp), 1)

    blocks = []
    for _ in range(dims["layers"]):
        in1, out1 = mlp_parts()
        in2, out2 = mlp_parts()
        blocks.append(dict(norm1=norm_weight(), in1=in1, out1=out1, norm2=norm_weight(), in2=in2, out2=out2))
    tail_in, tail_out = mlp_parts()
    parts = dict(blocks=blocks, tail_norm=norm_weight(), tail_in=tail_in, tail_out=tail_out,
                 final_norm=norm_weight(), head=mine(full(vocab, hidden), 1 if all_reduce_only else 0))
    cast = lambda d: {k: (v.to(dtype=dtype, device=device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    parts = cast(parts)
    parts["blocks"] = [cast(b) for b in blocks]
    return TPModel(parts, group, rank, world, dims["eps"], all_reduce_only).eval()


def collectives(all_reduce_only=False, layers=SMALL["layers"]):
    """What one forward issues, by tpcomm's op names:
    "dist": what tpcomm.install routes: the torch.distributed calls and the
            functional collectives (tpcomm.functional_collectives) alike, so
            every collective of "rewrites";
    "rewrites": what tpcomm.compile_backend rewrites (Dynamo traces dist.* and
            funcol alike): per block two all-reduces, the tail's collectives,
            and the head's funcol all-gather or all-reduce;
    "fused": the all-reduces whose sum the residual add and an RMSNorm follow
            (every block's two; the tail's all-reduce, which final_norm follows;
            never the head's)."""
    if all_reduce_only:
        return {"dist": {"all_reduce": 2 * layers + 2},
                "rewrites": {"all_reduce": 2 * layers + 2, "all_gather": 0, "reduce_scatter": 0},
                "fused": 2 * layers + 1}
    return {"dist": {"all_reduce": 2 * layers, "reduce_scatter": 1, "all_gather": 2},
            "rewrites": {"all_reduce": 2 * layers, "all_gather": 2, "reduce_scatter": 1},
            "fused": 2 * layers}


def example_input(world, dims=None, dtype=torch.float32, device="cpu", seed=1):
    """Hidden states of world * tokens_per_rank tokens, the same on every rank."""
    dims = dims or small(world)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(world * dims["tokens_per_rank"], dims["hidden"], generator=g).to(dtype=dtype, device=device)


def calls_since(comm, before):
    """tpcomm's calls by "op/backend" since the stats() snapshot `before`."""
    now = comm.stats()
    return {f"{op}/{backend}": s["calls"] - before.get((op, backend), {}).get("calls", 0)
            for (op, backend), s in sorted(now.items()) if s["calls"] != before.get((op, backend), {}).get("calls", 0)}


def run_modes(model, x, comm, group, inner="aot_eager", modes=MODES):
    """{mode: {"out": logits, "calls": tpcomm calls by op/backend,
    "rewrites": the compile pass's counts (compiled_* only)}}."""
    results = {}
    for mode in modes:
        torch._dynamo.reset()
        before = comm.stats()
        rewrites = None
        with torch.no_grad():
            if mode == "torch":
                out = model(x)
            elif mode == "install":
                with tpcomm.install(group):
                    out = model(x)
            else:
                backend = inner if mode == "compiled" else tpcomm.compile_backend(inner, fuse=mode == "compiled_fused")
                compiled = torch.compile(model, backend=backend, fullgraph=True)
                compiled(x)  # compiles; the second call runs the compiled graph as it is
                before = comm.stats()
                out = compiled(x)
                rewrites = None if mode == "compiled" else backend.counts
        results[mode] = {"out": out, "calls": calls_since(comm, before), "rewrites": rewrites}
    return results


def summary(results):
    """Per mode: bit-equal to its reference and the largest difference."""
    rows = {}
    for mode, r in results.items():
        ref = results.get("compiled" if mode.startswith("compiled_") else "torch")
        if ref is None or ref is r:
            rows[mode] = dict(bit_equal=None, max_abs_diff=0.0, calls=r["calls"], rewrites=r["rewrites"])
            continue
        diff = (r["out"].float() - ref["out"].float()).abs().max().item()
        rows[mode] = dict(bit_equal=torch.equal(r["out"], ref["out"]), max_abs_diff=diff,
                          calls=r["calls"], rewrites=r["rewrites"])
    return rows


def rank_device(rank, cpu):
    """This rank's device: the CPU, or its GPU (LOCAL_RANK under torchrun), made current."""
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def main(rank, world, args):
    device = rank_device(rank, args.cpu)
    dtype = getattr(torch, args.dtype)
    group = dist.group.WORLD
    comm = tpcomm.Communicator(group, device=device)
    model = build(rank, world, group, dtype=dtype, device=device, all_reduce_only=args.all_reduce_only)
    x = example_input(world, dtype=dtype, device=device)
    rows = summary(run_modes(model, x, comm, group, inner=args.inner))
    if rank == 0:
        form = "all-reduce only" if args.all_reduce_only else "sequence-parallel tail, vocabulary-parallel head"
        print(f"{world} ranks on {device.type}, {dtype}, {form}, tpcomm custom path: "
              f"{'on' if comm.enabled else 'off (' + str(comm.disabled_reason) + ')'}")
        for mode, row in rows.items():
            print(f"{mode:16s} bit_equal={row['bit_equal']!s:5s} max_abs_diff={row['max_abs_diff']:.3g} "
                  f"tpcomm calls={row['calls']} rewrites={row['rewrites']}")
    comm.close()


def _spawned(rank, world, init_method, body, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        body(rank, world, args)
    finally:
        dist.destroy_process_group()


def run_cli(body, args, name):
    """body(rank, world, args) on every rank: --cpu, args.ranks gloo
    processes spawned here; else this process, one of torchrun's (NCCL).
    NVLink multicast stays off (spawned ranks inherit it)."""
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[key] = value
    if args.cpu:
        from tpcomm import _ranks

        with _ranks.rendezvous() as (init_method, _):
            outcome = _ranks.wait(_ranks.start(args.ranks, _spawned, init_method, body, args), timeout_s=600)
        if outcome.failed or outcome.hung:
            sys.exit(f"{name}: ranks {outcome.failed + outcome.hung} failed or hung (output above)")
    else:
        if "RANK" not in os.environ:
            sys.exit("run it with torchrun (one process per GPU), or with --cpu")
        dist.init_process_group("nccl")
        try:
            body(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()


def parser(description):
    """The options of run_cli's examples: --cpu, --ranks, --dtype, --inner
    (parsed(), once every option is added, fills in --dtype's default)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cpu", action="store_true", help="spawn --ranks gloo processes on the CPU")
    p.add_argument("--ranks", type=int, default=2, help="with --cpu: how many processes")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    p.add_argument("--inner", default="aot_eager", help="the backend after tpcomm's pass: aot_eager or inductor")
    return p


def parsed(p, argv=None):
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    return args


def parse(argv=None):
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--all-reduce-only", action="store_true",
                   help="every collective an all-reduce: the tail's sum in place, the LM head split over the hidden "
                        "size (default: a sequence-parallel tail and a vocabulary-parallel head)")
    return parsed(p, argv)


if __name__ == "__main__":
    run_cli(main, parse(), "tp_functional")
