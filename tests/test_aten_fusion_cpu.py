"""The fusion on the graph AOT autograd makes (tpcomm.aten_norms), on 2
gloo ranks: a row-parallel layer as transformers 4.x writes it (the local
matmul's output a Partial DTensor, redistributed to Replicate: an all-reduce
Dynamo's graph does not show) followed by the residual add and the next
norm (Llama-style) or by Gemma's sandwich norm, in fp32 and bf16.
compile_backend("aot_eager"), TpcommPass on AOT's forward graph (what
inductor's post-grad pass gets) and compile_backend("inductor") through
inductor's lowering fuse it under the right pattern, giving
the fused op's definition bit for bit (norm_patterns.from_sums: the
ranks' partial sums added in fp32, the add and norms in fp32, each output
rounded once); fuse=False leaves it and gives the eager model's bits; the
Dynamo graph alone (inner backend "eager") holds no collective to fuse."""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

import tpcomm
from tpcomm.norm_patterns import STATS_KEY, Pattern, from_sums
from multiproc import run_ranks

HIDDEN = 16


def _llama_norm(h, weight):
    h32 = h.to(torch.float32)
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def _gemma_norm(h, weight):
    h32 = h.float()
    out = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (out * (1.0 + weight.float())).type_as(h)


class _RowParallel(torch.nn.Module):
    """out = all_reduce(x @ w.T) through DTensor, then the residual add and
    the next norm (ADD_NORM), or Gemma's norm, add, next norm (NORM_ADD_NORM)."""

    def __init__(self, mesh, gemma, dtype, rank):
        super().__init__()
        g = torch.Generator().manual_seed(11 + rank)  # each rank's shard of the weight
        self.mesh, self.gemma = mesh, gemma
        self.w = torch.nn.Parameter((torch.randn(HIDDEN, HIDDEN // 2, generator=g) / 4).to(dtype))
        g = torch.Generator().manual_seed(12)  # the norms' weights: the same on every rank
        self.n1 = torch.nn.Parameter((torch.rand(HIDDEN, generator=g) + 0.5).to(dtype))
        self.n2 = torch.nn.Parameter((torch.rand(HIDDEN, generator=g) + 0.5).to(dtype))

    def fused(self, x, residual):
        """What the fused op computes for forward(x, residual)."""
        sums = torch.nn.functional.linear(x, self.w).float()
        dist.all_reduce(sums)  # two ranks' bf16 / fp32 partials: exact in fp32
        if self.gemma:
            return from_sums(Pattern.NORM_ADD_NORM, sums, residual, self.n1, self.n2, 1e-6, 1e-6, 1.0, x.dtype)
        return from_sums(Pattern.ADD_NORM, sums, residual, self.n1, None, 1e-6, 1e-6, 0.0, x.dtype)

    def forward(self, x, residual):
        partial = DTensor.from_local(torch.nn.functional.linear(x, self.w), self.mesh, [Partial()], run_check=False)
        y = partial.redistribute(self.mesh, [Replicate()]).to_local()
        if self.gemma:
            o = residual + _gemma_norm(y, self.n1)
            return _gemma_norm(o, self.n2), o
        z = residual + y
        return _llama_norm(z, self.n1), z


def _aot_pass(fuse):
    """A torch.compile backend running TpcommPass on AOT's forward graph, and the pass."""
    from torch._dynamo.backends.common import aot_autograd

    from tpcomm.inductor_pass import TpcommPass

    tpcomm_pass = TpcommPass(fuse=fuse)

    def forward(gm, example_inputs):
        tpcomm_pass(gm.graph)
        gm.recompile()
        return gm

    return aot_autograd(fw_compiler=forward), tpcomm_pass.counts


def _body(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    mesh = init_device_mesh("cpu", (world_size,))
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(20 + rank)
        x = torch.randn(2, 3, HIDDEN // 2, generator=g).to(dtype)
        residual = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(21)).to(dtype)
        for gemma in (False, True):
            what = f"{dtype}, {'Gemma' if gemma else 'Llama'}"
            key = STATS_KEY[Pattern.NORM_ADD_NORM if gemma else Pattern.ADD_NORM]
            layer = _RowParallel(mesh, gemma, dtype, rank)
            with torch.no_grad():
                eager, fused = layer(x, residual), layer.fused(x, residual)
                for fuse in (True, False):
                    backends = [("aot_eager", tpcomm.compile_backend("aot_eager", fuse=fuse)), ("pass", _aot_pass(fuse))]
                    if fuse:  # through inductor's lowering too (unfused, its own arithmetic is not eager's bits)
                        backends.append(("inductor", tpcomm.compile_backend("inductor")))
                    for name, backend in backends:
                        backend, counts = (backend, backend.counts) if name != "pass" else backend
                        torch._dynamo.reset()
                        with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit skips the pass's counts
                            got = torch.compile(layer, backend=backend, fullgraph=True)(x, residual)
                        assert counts["all_reduce"] == 1, (what, name, counts)  # DTensor's, rewritten after AOT
                        assert counts[key] == fuse and sum(counts[k] for k in STATS_KEY.values()) == fuse, \
                            (what, name, fuse, counts)
                        for a, b in zip(got, fused if fuse else eager):
                            assert torch.equal(a, b), (what, name, fuse, (a.float() - b.float()).abs().max())
                torch._dynamo.reset()
                dynamo_only = tpcomm.compile_backend("eager")
                torch.compile(layer, backend=dynamo_only, fullgraph=True)(x, residual)
                assert not any(dynamo_only.counts.values()), (what, dynamo_only.counts)
    comm.close()
    dist.barrier()


def test_dtensor_row_parallel_fuses_after_aot():
    run_ranks(2, _body, timeout=600)


class _RowParallelLayerNorm(_RowParallel):
    """DTensor's all-reduce [times m], the residual add, then nn.LayerNorm's F.layer_norm
    (ADD_LAYER_NORM): AOT writes it aten.native_layer_norm, the product aten.mul. bias: the norm's
    bias (n2) or none; written: Cohere's LayerNorm code instead, aten ops after AOT."""

    def __init__(self, mesh, dtype, rank, bias, m, written=False):
        super().__init__(mesh, False, dtype, rank)
        self.bias, self.m, self.written = bias, m, written

    def fused(self, x, residual):
        sums = torch.nn.functional.linear(x, self.w).float()
        dist.all_reduce(sums)
        return from_sums(Pattern.ADD_LAYER_NORM, sums, residual, self.n1, None, 1e-5, 1e-5, 0.0, x.dtype,
                         bias=self.n2 if self.bias else None, residual_scale=self.m or 1.0)

    def forward(self, x, residual):
        partial = DTensor.from_local(torch.nn.functional.linear(x, self.w), self.mesh, [Partial()], run_check=False)
        y = partial.redistribute(self.mesh, [Replicate()]).to_local()
        z = residual + (y if self.m is None else y * self.m)
        if self.written:  # Cohere's LayerNorm: no bias, the weight multiplied in fp32 before the cast back
            h = z.to(torch.float32)
            mean = h.mean(-1, keepdim=True)
            n = (h - mean) * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
            return (self.n1.to(torch.float32) * n).to(z.dtype), z
        return torch.nn.functional.layer_norm(z, (HIDDEN,), self.n1, self.n2 if self.bias else None, 1e-5), z


def _body_layer_norm(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    mesh = init_device_mesh("cpu", (world_size,))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, HIDDEN // 2, generator=torch.Generator().manual_seed(20 + rank)).to(dtype)
        residual = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(21)).to(dtype)
        for bias, m, written in ((True, None, False), (False, None, False), (True, 0.5, False), (False, 0.5, True)):
            layer = _RowParallelLayerNorm(mesh, dtype, rank, bias, m, written)
            # inductor decomposes F.layer_norm (var_mean) before its post-grad pass, where the pass runs
            for inner in ("aot_eager",) + (("inductor",) if not written else ()):
                backend = tpcomm.compile_backend(inner)
                torch._dynamo.reset()
                with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
                    got = torch.compile(layer, backend=backend, fullgraph=True)(x, residual)
                    fused = layer.fused(x, residual)
                what = (dtype, bias, m, written, inner)
                assert backend.counts[STATS_KEY[Pattern.ADD_LAYER_NORM]] == 1, (what, backend.counts)
                for a, b in zip(got, fused):  # the op's definition, bit for bit
                    assert torch.equal(a, b), (what, (a.float() - b.float()).abs().max())
    comm.close()
    dist.barrier()


def test_dtensor_row_parallel_layer_norm_fuses_after_aot():
    run_ranks(2, _body_layer_norm, timeout=600)
