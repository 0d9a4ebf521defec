"""A Llama-8B-shaped tensor-parallel decode step, timed with NCCL, with tpcomm
and with no communication at all (the floor), under CUDA graphs.

    python examples/tp_decode.py                 # every GPU of this machine
    python examples/tp_decode.py --tiny --cpu    # 2 gloo processes, tiny model (what CI runs)

The model has random weights (nothing is downloaded) and Llama-3-8B's shapes:
32 layers, hidden 4096, 32 query and 8 key/value heads of 128, MLP 14336,
vocabulary 128256, split over the ranks the way vLLM splits it:
vocabulary-parallel embedding (one all_reduce), per layer the attention and
MLP column-parallel in and row-parallel out (two all_reduce), and a
vocabulary-parallel LM head whose logits are all-gathered before the argmax.
One decode step is 65 all_reduce and one all_gather. Attention reads a KV
cache of --context positions (random, fixed shape, so the step can be
captured); rotary embeddings are left out, since they add no communication.

Backends: "none" skips every collective (its tokens are wrong; it is the
floor), "nccl" is torch.distributed (gloo with --cpu), "tpcomm" is
tpcomm.Communicator, and "tpcomm_fused" (asked for with --backends) runs the
residual add and the RMSNorm that follow each row-parallel matmul inside the
all-reduce (Communicator.all_reduce_add_rms_norm on the fused kernel; its
sums stay in fp32 up to the norm, so its logits are close to NCCL's, not
equal).
"none_fused" is the floor of the fused step: no collective, and the add and
the norm in one kernel (torch.compile fuses them; on --cpu they run
unfused), so the fused step's communication is measured against a step
with the same fusion ("none" keeps the add and the norm apart, which the
fused step does not pay). The summary gives each backend's time over
"none", and each *_fused backend's over "none_fused" when it ran:

    python examples/tp_decode.py --backends none,none_fused,nccl,tpcomm,tpcomm_fused

Each (batch size, backend) step is captured once as a CUDA graph; then in every
round each backend replays its graph --replays times, the order rotating from
round to round, so no backend profits from running first or last. The figure
is the median over rounds of the time per step. NCCL reads
NCCL_GRAPH_MIXING_SUPPORT once per process: with --nccl-mixing both (the
default on GPUs) a second set of processes with it set to 0 measures
"nccl_nomix" beside its own floor. tpcomm's tokens and logits are compared
with NCCL's (bit for bit on 2 ranks, where both sum in the same order).
Writes results/tp_decode_<gpu>x<n>.json under the working directory (or --out).
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tpcomm import _ranks  # the ranks of one group on this host
from tpcomm.bench.environment import environment  # the benchmark's: GPU, driver, torch, NCCL, date
from tpcomm.bench.timing import rotated

LLAMA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256)
RUN_TIMEOUT_S = 3600  # a set of ranks still running after this is stopped
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--context", type=int, default=1024, help="KV cache positions per sequence (default 1024)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    p.add_argument("--replays", type=int, default=20, help="graph replays per backend per round (default 20)")
    p.add_argument("--backends", default="none,nccl,tpcomm")
    p.add_argument("--nccl-mixing", choices=("default", "off", "both"), default="both",
                   help="NCCL_GRAPH_MIXING_SUPPORT: as set (default), 0 (off), or both in two process sets")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden size 64 (tests)")
    p.add_argument("--cpu", action="store_true", help="2 gloo processes on the CPU, eager, no timing (tests)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


# ------------------------------------------------------------------ the model
class Shard:
    """One rank's weights of the TP-split model, random and fixed by seed."""

    def __init__(self, cfg, rank, world, device, dtype, context, max_batch):
        g = torch.Generator(device=device).manual_seed(1234 + rank)
        h, hd = cfg["hidden"], cfg["head_dim"]
        self.q_heads, self.kv_heads = cfg["heads"] // world, cfg["kv_heads"] // world
        self.vocab_part = cfg["vocab"] // world
        self.vocab_start = rank * self.vocab_part

        def w(*shape, scale):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

        self.embed = w(self.vocab_part, h, scale=1.0)
        self.layers = []
        for _ in range(cfg["layers"]):
            self.layers.append(dict(
                norm1=torch.ones(h, device=device, dtype=dtype), norm2=torch.ones(h, device=device, dtype=dtype),
                qkv=w(h, (self.q_heads + 2 * self.kv_heads) * hd, scale=h ** -0.5),
                o=w(self.q_heads * hd, h, scale=(cfg["heads"] * hd) ** -0.5),
                gate_up=w(h, 2 * cfg["mlp"] // world, scale=h ** -0.5),
                down=w(cfg["mlp"] // world, h, scale=cfg["mlp"] ** -0.5),
                k_cache=w(max_batch, self.kv_heads, context, hd, scale=1.0),
                v_cache=w(max_batch, self.kv_heads, context, hd, scale=1.0)))
        self.final_norm = torch.ones(h, device=device, dtype=dtype)
        self.lm_head = w(h, self.vocab_part, scale=h ** -0.5)
        self.hd = hd


EPS = 1e-5


def rms_norm(x, weight, eps=EPS):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def decode_step(m, tokens, comm):
    """Logits (batch, vocab) and the next tokens for one decode step;
    comm = (all_reduce, all_gather_last_dim, add_norm), where
    add_norm(y, x, weight) -> (rms_norm(x + all_reduce(y)) * weight, x + all_reduce(y))
    is what follows every row-parallel matmul."""
    all_reduce, all_gather, add_norm = comm
    b = tokens.shape[0]
    local = tokens - m.vocab_start
    mine = (local >= 0) & (local < m.vocab_part)
    x = m.embed[local.clamp(0, m.vocab_part - 1)] * mine.unsqueeze(-1).to(m.embed.dtype)
    x = all_reduce(x)
    h = rms_norm(x, m.layers[0]["norm1"])
    qn, kvn, hd = m.q_heads, m.kv_heads, m.hd
    for i, layer in enumerate(m.layers):
        q, k, v = (h @ layer["qkv"]).split([qn * hd, kvn * hd, kvn * hd], dim=-1)
        k_cache, v_cache = layer["k_cache"][:b], layer["v_cache"][:b]
        k_cache[:, :, -1] = k.view(b, kvn, hd)  # this step's position: the cache's last
        v_cache[:, :, -1] = v.view(b, kvn, hd)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.view(b, qn, 1, hd), k_cache, v_cache, enable_gqa=True)
        h, x = add_norm(att.reshape(b, qn * hd) @ layer["o"], x, layer["norm2"])
        gate, up = (h @ layer["gate_up"]).chunk(2, dim=-1)
        following = m.layers[i + 1]["norm1"] if i + 1 < len(m.layers) else m.final_norm
        h, x = add_norm((torch.nn.functional.silu(gate) * up) @ layer["down"], x, following)
    logits = all_gather(h @ m.lm_head)
    return logits, logits.argmax(-1)


def unfused_add_norm(all_reduce):
    def add_norm(y, x, weight):
        x = x + all_reduce(y)
        return rms_norm(x, weight), x
    return add_norm


def local_fused_add_norm():
    """add_norm with no communication, the add and the norm in one kernel:
    torch.compile fuses them (one Triton kernel on CUDA)."""
    @torch.compile(fullgraph=True, dynamic=False)
    def add_norm(y, x, weight):
        x = x + y
        return rms_norm(x, weight), x
    return add_norm


FLOORS = ("none", "none_fused")


def collectives(backend, comm, fused_floor=None):
    """(all_reduce, all_gather_last_dim, add_norm) of a backend; fused_floor:
    none_fused's add_norm (local_fused_add_norm, made once per process)."""
    if backend in FLOORS:
        def identity(t):
            return t
        add_norm = fused_floor if backend == "none_fused" and fused_floor else unfused_add_norm(identity)
        return identity, lambda t: torch.cat([t] * dist.get_world_size(), dim=-1), add_norm
    if backend.startswith("nccl"):
        def all_reduce(t):
            t = t.contiguous()
            dist.all_reduce(t)
            return t

        def all_gather(t):  # (b, v) -> (b, world * v): ranks stacked on dim 0, then moved beside v
            world = dist.get_world_size()
            out = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t.contiguous())
            return out.view((world,) + tuple(t.shape)).movedim(0, -2).reshape(t.shape[:-1] + (-1,))
        return all_reduce, all_gather, unfused_add_norm(all_reduce)

    if backend == "tpcomm_fused":  # the add and the norm inside the all-reduce: one launch
        def add_norm(y, x, weight):
            return comm.all_reduce_add_rms_norm(y, x, weight, EPS)
    else:
        add_norm = unfused_add_norm(comm.all_reduce)
    return comm.all_reduce, lambda t: comm.all_gather(t, dim=-1), add_norm


# ---------------------------------------------------------------- one rank
def rank_main(rank, world, init_method, args, backends, result_path):
    import tpcomm
    from tpcomm.topology import force_multicast_off

    force_multicast_off()

    cpu = args.cpu
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=init_method, rank=rank,
                            world_size=world, **({} if cpu else {"device_id": device}))
    t0 = time.monotonic()

    def say(what):  # progress from rank 0, so a run stopped by a time limit shows where it was
        if rank == 0:
            print(f"[{time.monotonic() - t0:6.1f} s] {what}", flush=True)

    cfg = TINY if args.tiny else LLAMA_8B
    dtype = torch.float32 if cpu else torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    say(f"{world} ranks up ({', '.join(backends)}; NCCL_GRAPH_MIXING_SUPPORT="
        f"{os.environ.get('NCCL_GRAPH_MIXING_SUPPORT', 'unset')})")
    model = Shard(cfg, rank, world, device, dtype, args.context, max(batches))
    say("weights and KV cache built")
    comm = None
    if any(b.startswith("tpcomm") for b in backends):
        # the tpcomm backend never calls the fused op, so one Communicator serves both
        comm = tpcomm.Communicator(device=device)
    if comm is not None and not cpu and not comm.enabled:
        raise RuntimeError(f"tpcomm's custom path is off: {comm.disabled_reason}")
    fused_floor = None if cpu else local_fused_add_norm()
    results = {}
    for batch in batches:
        tokens = torch.randint(0, cfg["vocab"], (batch,), generator=torch.Generator().manual_seed(batch)).to(device)
        outs, graphs = {}, {}
        for backend in backends:
            step = (lambda be=backend: decode_step(model, tokens, collectives(be, comm, fused_floor)))
            outs[backend] = [t.clone() for t in step()]  # eager, also the warm-up
            if not cpu:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    step()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with (comm.capture() if backend.startswith("tpcomm") else contextlib.nullcontext()), \
                        torch.cuda.graph(graph):
                    captured = step()
                graph.replay()
                torch.cuda.synchronize()
                outs[backend] = [t.clone() for t in captured]
                graphs[backend] = graph
        say(f"batch {batch}: every backend run" + ("" if cpu else " and captured"))  # no graphs on the CPU
        entry = {"tokens": outs[backends[-1]][1].tolist()}
        if "nccl" in outs or "nccl_nomix" in outs:
            ref = outs.get("nccl") or outs.get("nccl_nomix")
            as_bits = torch.int32 if dtype == torch.float32 else torch.int16
            # tpcomm_fused keeps fp32 between the sum and the norm: not NCCL's bits, nearly its tokens
            for name, key in (("tpcomm", ""), ("tpcomm_fused", "fused_")):
                if name not in outs:
                    continue
                logits, tokens = outs[name]
                entry[key + "tokens_agree"] = bool(torch.equal(tokens, ref[1]))
                entry[key + "logits_max_abs_diff"] = float((logits.float() - ref[0].float()).abs().max())
                if name == "tpcomm":
                    entry["logits_bit_equal"] = bool(torch.equal(logits.view(as_bits), ref[0].view(as_bits)))
        if not cpu:
            entry["ms_per_step"] = _time_interleaved(graphs, backends, args.rounds, args.replays)
            say(f"batch {batch}: ms per step {entry['ms_per_step']}")
        results[batch] = entry
    if comm is not None:
        results["tpcomm_calls"] = {f"{op}/{b}": v["calls"] for (op, b), v in comm.stats().items()}
    if rank == 0:  # first, so nothing that follows can lose the measurements
        with open(result_path + ".part", "w") as f:
            json.dump(results, f)
        os.replace(result_path + ".part", result_path)
    say("results written")
    del graphs  # the captured graphs hold NCCL and tpcomm work: gone before either is torn down
    if comm is not None:
        comm.close()
    dist.barrier()
    say("done")
    sys.stdout.flush()
    # No destroy_process_group: NCCL's teardown after graph capture has been
    # seen to hang here, and the process exits now without running it.
    os._exit(0)


def _time_interleaved(graphs, backends, rounds, replays):
    """Median over rounds of ms per step; the order of backends rotates."""
    times = {b: [] for b in backends}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds + 1):  # round 0 warms up
        for b in rotated(backends, r):
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            for _ in range(replays):
                graphs[b].replay()
            end.record()
            end.synchronize()
            ms = torch.tensor([start.elapsed_time(end) / replays], device="cuda")
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank
            if r:
                times[b].append(float(ms))
    return {b: round(statistics.median(v), 4) for b, v in times.items()}


# ------------------------------------------------------------------ driver
def run_set(world, args, backends, env):
    """One set of processes (one per GPU, or 2 on the CPU) with `env` added."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with _ranks.rendezvous() as (init_method, tmp):
            path = os.path.join(tmp, "rank0.json")
            procs = _ranks.start(world, rank_main, init_method, args, backends, path)
            # once rank 0 has written the results, the ranks get a grace to leave (a hang in teardown costs no data)
            outcome = _ranks.wait(procs, RUN_TIMEOUT_S, grace_s=60.0, done=lambda: os.path.exists(path))
            if outcome.failed or outcome.hung:
                bad = outcome.failed + outcome.hung
                raise RuntimeError(f"tp_decode: rank {bad[0]} {_ranks.exit_text(procs[bad[0]].exitcode)} "
                                   "(its traceback is above)" if outcome.failed else
                                   f"tp_decode: ranks {bad} still running after {RUN_TIMEOUT_S} s: stopped")
            if outcome.lingered:
                print("ranks still running 60 s after writing their results: stopped", flush=True)
            with open(path) as f:
                return json.load(f)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(runs):
    """Per batch: ms per step of every backend, each one's overhead over the
    floor of its own process set ("none"), each *_fused backend's over
    "none_fused" where that ran, and tpcomm's speed-up over each NCCL."""
    out = {}
    for label, res in runs.items():
        for batch, entry in res.items():
            if not batch.isdigit():
                continue
            row = out.setdefault(batch, {"ms_per_step": {}, "over_floor_pct": {}})
            times = entry.get("ms_per_step", {})
            for b, ms in times.items():
                row["ms_per_step"][f"{b} ({label})" if b in FLOORS else b] = ms
                if b in FLOORS:
                    continue
                if times.get("none"):
                    row["over_floor_pct"][b] = round(100.0 * (ms / times["none"] - 1.0), 1)
                if b.endswith("_fused") and times.get("none_fused"):
                    row.setdefault("over_fused_floor_pct", {})[b] = round(100.0 * (ms / times["none_fused"] - 1.0), 1)
            for k in ("tokens_agree", "logits_bit_equal", "logits_max_abs_diff", "fused_tokens_agree",
                      "fused_logits_max_abs_diff"):
                if k in entry:
                    row[f"{k} ({label})"] = entry[k]
    for row in out.values():
        ms = row["ms_per_step"]
        for mine in ("tpcomm", "tpcomm_fused"):
            if mine in ms and any(b in ms for b in ("nccl", "nccl_nomix")):
                row[f"{mine}_faster_than_pct"] = {b: round(100.0 * (1.0 - ms[mine] / ms[b]), 1)
                                                  for b in ("nccl", "nccl_nomix") if b in ms}
    return out


def main(argv=None):
    args = parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    world = 2 if args.cpu else torch.cuda.device_count()
    if world < 2:
        print(f"tp_decode needs 2 GPUs (found {world}); --cpu runs 2 gloo processes")
        return 0
    cfg = TINY if args.tiny else LLAMA_8B
    if cfg["kv_heads"] % world or cfg["vocab"] % world:
        print(f"the model's {cfg['kv_heads']} KV heads and vocabulary do not split over {world} ranks")
        return 1
    runs = {}
    if args.nccl_mixing in ("default", "both") or args.cpu:
        runs["mixing default"] = run_set(world, args, backends, {})
    if args.nccl_mixing in ("off", "both") and not args.cpu and "nccl" in backends:
        nomix = [b for b in backends if b in ("none", "nccl")]
        res = run_set(world, args, nomix, {"NCCL_GRAPH_MIXING_SUPPORT": "0"})
        for entry in res.values():
            if isinstance(entry, dict) and "ms_per_step" in entry:
                entry["ms_per_step"] = {("nccl_nomix" if b == "nccl" else b): v
                                        for b, v in entry["ms_per_step"].items()}
        runs["mixing off"] = res
    env = environment(world)
    data = {"env": env, "model": dict(cfg, context=args.context, dtype="float32" if args.cpu else "bfloat16",
                                      ranks=world),
            "method": f"CUDA graph per (batch, backend); {args.rounds} rounds, backends in rotating order, "
                      f"{args.replays} replays each; median over rounds of ms per step, slowest rank",
            "runs": runs, "summary": summarize(runs)}
    path = args.out or os.path.join("results", "tp_decode_" + _gpu_tag(env, world) + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(json.dumps(data["summary"], indent=1))
    print(f"wrote {path}")
    return 0


def _gpu_tag(env, world):
    name = env.get("gpu", "cpu").split()[-1].lower()
    return f"{name}x{world}"


if __name__ == "__main__":
    sys.exit(main())
