"""What the quantized all-reduce costs a trained model in accuracy.

Trains a small Llama-style model (byte-level vocabulary, RMSNorm, rotary
attention, SwiGLU; 8 layers of hidden 512: about 25 M parameters) on one GPU
for at most --train-minutes, on text that ships with Python: the standard
library's .py sources, every 20th file (sorted by path) held out. Then it
measures on the held-out text:

  * the perplexity without tensor parallelism (one process);
  * at TP2 and TP4 (ranks sharing GPU 0, gloo for the host side, the model
    sharded as examples/tp_decode.py shards it: vocabulary-parallel
    embedding and LM head, column-parallel in and row-parallel out), the
    perplexity with tpcomm's exact all-reduce and with each quantized mode
    (Config.quantize), every bfloat16 all-reduce quantized (the table's
    quantized_min_bytes set to 16 bytes: the worst case);
  * greedy decoding of 64 held-out prompts of 64 bytes for 32 tokens: the
    share of generated tokens equal to the exact TP run's at the same place.

    python examples/quantized_accuracy.py --out quantized_accuracy.json
    python examples/quantized_accuracy.py --tiny --cpu --out /tmp/q.json   # the CPU smoke test

The smoke test (--tiny) is sized to run in 15-20 s on 2 busy CPU cores
(TINY_RUN: 100 training steps, 15 s at most, TP2 only; --tp 2,4 adds the
4-rank run, 25-40 s more there); the real run's sizes are RUN. Options
override them one by one.

--checkpoint PATH keeps the trained weights there (and reuses them when the
file exists; they are not committed). On --cpu the ranks run gloo on the CPU
and every all-reduce is its reference (tpcomm.reference's rank-order sum,
tpcomm.quantized_reference's emulation of the quantized kernel): the
plumbing and the arithmetic, not the kernel. Writes a JSON of the results
and prints the table docs/benchmarks.md holds.
"""
import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODEL = dict(layers=8, hidden=512, heads=8, head_dim=64, mlp=1408, vocab=256, context=256)
TINY = dict(layers=2, hidden=64, heads=4, head_dim=16, mlp=128, vocab=256, context=64)
MODES = ("fp8", "int8", "int4")
BACKENDS = ("exact",) + MODES
EPS = 1e-5
PROMPT_BYTES, NEW_TOKENS = 64, 32
# The sizes of a run (options left out): the real one, and --tiny's smoke test.
RUN = dict(train_minutes=9.0, train_steps=12000, batch=64, eval_tokens=65536, prompts=64, tp="2,4")
TINY_RUN = dict(train_minutes=0.25, train_steps=100, batch=8, eval_tokens=1024, prompts=8, tp="2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def sized(flag, kind, what):
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, type=kind, default=None, help=f"{what} (default {RUN[name]}; --tiny: {TINY_RUN[name]})")

    sized("--train-minutes", float, "training time limit")
    sized("--train-steps", int, "steps the schedule plans for")
    sized("--batch", int, "sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3)
    sized("--eval-tokens", int, "held-out tokens scored")
    sized("--tp", str, "tensor-parallel sizes")
    sized("--prompts", int, "greedy prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="where the trained weights are kept (reused if present)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden 64, sized by TINY_RUN (tests)")
    p.add_argument("--cpu", action="store_true", help="everything on the CPU, references for the all-reduces")
    p.add_argument("--out", default="quantized_accuracy.json")
    args = p.parse_args(argv)
    for name, value in (TINY_RUN if args.tiny else RUN).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ----------------------------------------------------------------- the text
def corpus():
    """(train bytes, held-out bytes) of the standard library's .py sources:
    files sorted by path, every 20th held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and "dist-packages" not in f)
    train, held = bytearray(), bytearray()
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            (held if i % 20 == 19 else train).extend(f.read() + b"\n")
    return bytes(train), bytes(held)


# ---------------------------------------------------------------- the model
def init_weights(cfg, seed):
    """fp32 weights of the whole model; q, k and v columns head by head."""
    g = torch.Generator().manual_seed(seed)
    h, hd, heads, mlp, vocab = cfg["hidden"], cfg["head_dim"], cfg["heads"], cfg["mlp"], cfg["vocab"]

    def w(*shape, fan_in):
        return torch.randn(*shape, generator=g) * fan_in ** -0.5

    weights = {"embed": torch.randn(vocab, h, generator=g) * 0.02, "final_norm": torch.ones(h),
               "lm_head": w(h, vocab, fan_in=h)}
    for i in range(cfg["layers"]):
        weights.update({f"{i}.norm1": torch.ones(h), f"{i}.norm2": torch.ones(h),
                        f"{i}.q": w(h, heads * hd, fan_in=h), f"{i}.k": w(h, heads * hd, fan_in=h),
                        f"{i}.v": w(h, heads * hd, fan_in=h),
                        f"{i}.o": w(heads * hd, h, fan_in=heads * hd) / math.sqrt(2 * cfg["layers"]),
                        f"{i}.gate": w(h, mlp, fan_in=h), f"{i}.up": w(h, mlp, fan_in=h),
                        f"{i}.down": w(mlp, h, fan_in=mlp) / math.sqrt(2 * cfg["layers"])})
    return weights


def shard(weights, cfg, rank, world):
    """Rank `rank`'s part: heads, MLP columns and vocabulary split in
    `world` equal slices (column-parallel q/k/v/gate/up and LM head,
    row-parallel o/down, vocabulary-parallel embedding)."""
    hd = cfg["head_dim"]
    heads, mlp, vocab = cfg["heads"] // world, cfg["mlp"] // world, cfg["vocab"] // world
    cols = slice(rank * heads * hd, (rank + 1) * heads * hd)
    m, v = slice(rank * mlp, (rank + 1) * mlp), slice(rank * vocab, (rank + 1) * vocab)
    out = {"embed": weights["embed"][v], "final_norm": weights["final_norm"], "lm_head": weights["lm_head"][:, v],
           "vocab_start": rank * vocab}
    for i in range(cfg["layers"]):
        for name in ("norm1", "norm2"):
            out[f"{i}.{name}"] = weights[f"{i}.{name}"]
        for name in ("q", "k", "v"):
            out[f"{i}.{name}"] = weights[f"{i}.{name}"][:, cols]
        out[f"{i}.o"] = weights[f"{i}.o"][cols]
        out[f"{i}.gate"], out[f"{i}.up"] = weights[f"{i}.gate"][:, m], weights[f"{i}.up"][:, m]
        out[f"{i}.down"] = weights[f"{i}.down"][m]
    return out


def rms_norm(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight


def rope(x, positions):
    """Rotary embedding of (batch, heads, seq, head_dim), halves rotated."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.float()[:, None] * freq[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def forward(s, tokens, cfg, all_reduce=None, all_gather=None):
    """Logits (batch, seq, vocab) of a model part `s` (shard(); the whole
    model with world 1, where the collectives are None)."""
    b, t = tokens.shape
    hd = cfg["head_dim"]
    vocab_part = s["embed"].shape[0]
    local = tokens - s.get("vocab_start", 0)
    mine = (local >= 0) & (local < vocab_part)
    x = s["embed"][local.clamp(0, vocab_part - 1)] * mine.unsqueeze(-1).to(s["embed"].dtype)
    reduce = all_reduce or (lambda y: y)
    x = reduce(x)
    positions = torch.arange(t, device=tokens.device)
    for i in range(cfg["layers"]):
        h = rms_norm(x, s[f"{i}.norm1"])
        heads = s[f"{i}.q"].shape[1] // hd
        q, k, v = ((h @ s[f"{i}.{n}"]).view(b, t, heads, hd).transpose(1, 2) for n in ("q", "k", "v"))
        att = F.scaled_dot_product_attention(rope(q, positions), rope(k, positions), v, is_causal=True)
        x = x + reduce(att.transpose(1, 2).reshape(b, t, heads * hd) @ s[f"{i}.o"])
        h = rms_norm(x, s[f"{i}.norm2"])
        x = x + reduce((F.silu(h @ s[f"{i}.gate"]) * (h @ s[f"{i}.up"])) @ s[f"{i}.down"])
    logits = rms_norm(x, s["final_norm"]) @ s["lm_head"]
    return all_gather(logits) if all_gather else logits


# ----------------------------------------------------------------- training
def train(cfg, args, data, device, say):
    """Trains the whole model (fp32 weights, bf16 autocast on the GPU):
    AdamW, warm-up then cosine over --train-steps, stopped at
    --train-minutes. Returns (weights, facts)."""
    torch.manual_seed(args.seed)
    weights = {k: v.to(device).requires_grad_() for k, v in init_weights(cfg, args.seed).items()}
    opt = torch.optim.AdamW(weights.values(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    text = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    g = torch.Generator(device=device).manual_seed(args.seed)
    ctx = cfg["context"]
    warmup = max(1, min(200, args.train_steps // 10))
    start, losses, step = time.monotonic(), [], 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                       enabled=False)
    while step < args.train_steps and time.monotonic() - start < 60 * args.train_minutes:
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.train_steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        at = torch.randint(0, text.numel() - ctx - 1, (args.batch,), generator=g, device=device)
        window = text[at[:, None] + torch.arange(ctx + 1, device=device)].long()
        with autocast:
            logits = forward(weights, window[:, :-1], cfg)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg["vocab"]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights.values(), 1.0)
        opt.step()
        losses.append(loss.item() if step % 50 == 0 or step + 1 == args.train_steps else None)
        if step % 500 == 0:
            say(f"step {step}: loss {losses[-1]:.4f}")
        step += 1
    recent = [x for x in losses[-500:] if x is not None]
    facts = {"steps": step, "minutes": round((time.monotonic() - start) / 60, 2), "batch": args.batch,
             "context": ctx, "tokens_seen": step * args.batch * ctx, "lr": args.lr,
             "final_loss": round(sum(recent) / len(recent), 4) if recent else None}
    return {k: v.detach().cpu() for k, v in weights.items()}, facts


# --------------------------------------------------------------- evaluation
def eval_batches(cfg, held, tokens, batch=8):
    """Held-out windows of context + 1 bytes, `tokens` predictions in all,
    evenly spaced through the held-out text, in batches."""
    ctx = cfg["context"]
    n = max(1, tokens // ctx)
    stride = (len(held) - ctx - 1) // n
    text = torch.frombuffer(bytearray(held), dtype=torch.uint8)
    windows = torch.stack([text[i * stride:i * stride + ctx + 1].long() for i in range(n)])
    return list(windows.split(batch))


def prompts(held, count):
    text = torch.frombuffer(bytearray(held), dtype=torch.uint8)
    stride = (len(held) - PROMPT_BYTES) // count
    return torch.stack([text[i * stride + 7:i * stride + 7 + PROMPT_BYTES].long() for i in range(count)])


@torch.no_grad()
def evaluate(s, cfg, batches, prompt_tokens, device, all_reduce=None, all_gather=None):
    """(held-out perplexity, greedy tokens (prompts x NEW_TOKENS))."""
    nll, count = 0.0, 0
    for w in batches:
        w = w.to(device)
        logits = forward(s, w[:, :-1], cfg, all_reduce, all_gather).float()
        nll += F.cross_entropy(logits.reshape(-1, cfg["vocab"]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    seq = prompt_tokens.to(device)
    for _ in range(NEW_TOKENS):
        logits = forward(s, seq[:, -cfg["context"]:], cfg, all_reduce, all_gather)
        seq = torch.cat([seq, logits[:, -1].float().argmax(-1, keepdim=True)], 1)
    return math.exp(nll / count), seq[:, PROMPT_BYTES:].cpu()


def agreement(a, b):
    return round(float((a == b).float().mean()), 4)


# --------------------------------------------------------------- TP ranks
def cpu_threads(args, processes):
    """Intra-op threads of one of `processes` processes sharing the CPU: one
    for the tiny model, whose ops are too small to split (extra threads only
    spin against each other and any other load: minutes instead of seconds
    on 2 busy cores), else this process's share of the cores."""
    return 1 if args.tiny else max(1, (os.cpu_count() or 1) // processes)


def reference_collectives(mode):
    """(all_reduce, all_gather_last_dim) on the CPU: every rank's input
    gathered (as bytes: gloo's gather is a copy), then the exact
    kernels' rank-order fp32 sum or the quantized kernel's emulation."""
    from tpcomm import quantized_reference
    from tpcomm.reference import rank_order_sum

    def gather(t):
        t = t.contiguous()
        parts = [torch.empty_like(t.view(torch.uint8)) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.view(torch.uint8))
        return [p.view(t.dtype) for p in parts]

    def all_reduce(t):
        parts = gather(t)
        if mode == "exact":
            return rank_order_sum(parts).to(t.dtype)
        return quantized_reference.emulate(parts, mode)

    return all_reduce, lambda t: torch.cat(gather(t), -1)


def rank_main(rank, world, init_method, args, weights_path, result_path):
    import tpcomm
    import tpcomm._testing
    from tpcomm import routing_table
    from tpcomm.topology import force_multicast_off

    force_multicast_off()
    cpu = args.cpu
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if cpu:
        torch.set_num_threads(cpu_threads(args, world))
    else:
        torch.cuda.set_device(device)
        tpcomm._testing.allow_shared_gpu(True)  # the ranks share GPU 0
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    cfg = TINY if args.tiny else MODEL
    weights = torch.load(weights_path)
    s = {k: (v.to(device, torch.bfloat16) if isinstance(v, torch.Tensor) else v)
         for k, v in shard(weights, cfg, rank, world).items()}
    _, held = corpus()
    batches, prompt_tokens = eval_batches(cfg, held, args.eval_tokens), prompts(held, args.prompts)
    # every bfloat16 all-reduce quantized: the worst case for accuracy
    table = dict(routing_table.load_table(), quantized_min_bytes={"*": 16})
    results = {}
    for backend in BACKENDS:
        mode = None if backend == "exact" else backend
        comm = None
        if cpu:
            all_reduce, all_gather = reference_collectives(backend)
        else:
            comm = tpcomm.Communicator(device=device, table=table, config=tpcomm.Config(quantize=mode))
            if not comm.enabled:
                raise RuntimeError(f"tpcomm's custom path is off: {comm.disabled_reason}")
            all_reduce, all_gather = comm.all_reduce, (lambda t, c=comm: c.all_gather(t, dim=-1))
        ppl, generated = evaluate(s, cfg, batches, prompt_tokens, device, all_reduce, all_gather)
        entry = {"perplexity": round(ppl, 4), "tokens": generated.tolist()}
        if comm is not None:
            entry["routes"] = {f"{op}/{b}": v["calls"] for (op, b), v in comm.stats().items()}
            if mode and not any(b == f"quantized_{mode}" for _, b in comm.stats()):
                raise RuntimeError(f"{backend}: no all-reduce took the quantized kernel: {comm.stats()}")
            comm.close()
        results[backend] = entry
    dist.barrier()
    if rank == 0:  # written last, whole: the parent takes its presence for done
        with open(result_path + ".part", "w") as f:
            json.dump(results, f)
        os.replace(result_path + ".part", result_path)
    dist.destroy_process_group()


def run_tp(world, args, weights_path, timeout_s=1800):
    """The ranks of one TP size (tpcomm._ranks: a failed or hung rank ends
    the run naming it); rank 0's results."""
    from tpcomm import _ranks

    with _ranks.rendezvous() as (init_method, tmp):
        path = os.path.join(tmp, "rank0.json")
        procs = _ranks.start(world, rank_main, init_method, args, weights_path, path)
        outcome = _ranks.wait(procs, timeout_s, done=lambda: os.path.exists(path), grace_s=60.0)
        if outcome.failed or outcome.hung or not os.path.exists(path):
            raise SystemExit(f"TP{world}: ranks {outcome.failed} failed, {outcome.hung} hung")
        with open(path) as f:
            return json.load(f)


# ------------------------------------------------------------------ driver
def main(argv=None):
    args = parse_args(argv)
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if not args.cpu and not torch.cuda.is_available():
        print("quantized_accuracy needs a CUDA GPU (--cpu runs the references on the CPU)")
        return 1
    cfg = TINY if args.tiny else MODEL
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if args.cpu:
        torch.set_num_threads(cpu_threads(args, 1))
    t0 = time.monotonic()

    def say(what):
        print(f"[{time.monotonic() - t0:7.1f} s] {what}", flush=True)

    train_text, held = corpus()
    say(f"text: {len(train_text)} training bytes, {len(held)} held out")
    weights_path = args.checkpoint or os.path.join(tempfile.mkdtemp(prefix="tpcomm-quant-acc-"), "weights.pt")
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        weights, training = saved["weights"], saved["training"]
        say(f"weights from {args.checkpoint}")
    else:
        weights, training = train(cfg, args, train_text, device, say)
        torch.save({"weights": weights, "training": training}, weights_path)
        say(f"trained: {training}")
    params = sum(v.numel() for v in weights.values())
    shard_path = weights_path + ".plain"
    torch.save(weights, shard_path)

    whole = {k: v.to(device, torch.bfloat16) for k, v in weights.items()}
    batches, prompt_tokens = eval_batches(cfg, held, args.eval_tokens), prompts(held, args.prompts)
    ppl, no_tp_tokens = evaluate(whole, cfg, batches, prompt_tokens, device)
    say(f"no TP: perplexity {ppl:.4f}")
    results = {"no_tp": {"perplexity": round(ppl, 4)}}
    for world in [int(w) for w in args.tp.split(",") if w.strip()]:
        if cfg["heads"] % world or cfg["mlp"] % world or cfg["vocab"] % world:
            raise SystemExit(f"the model does not split over {world} ranks")
        run = run_tp(world, args, shard_path)
        exact = torch.tensor(run["exact"]["tokens"])
        for backend, entry in run.items():
            tokens = torch.tensor(entry.pop("tokens"))
            entry["agree_with_exact_tp"] = agreement(tokens, exact)
            entry["agree_with_no_tp"] = agreement(tokens, no_tp_tokens)
        results[f"tp{world}"] = run
        say(f"TP{world}: " + ", ".join(f"{b} {e['perplexity']:.4f}" for b, e in run.items()))
    data = {"command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
            "seed": args.seed, "model": dict(cfg, parameters=params, dtype="bfloat16"),
            "training": training, "text": {"train_bytes": len(train_text), "heldout_bytes": len(held),
                                           "python": sys.version.split()[0]},
            "eval": {"heldout_tokens": sum(w[:, 1:].numel() for w in batches), "prompts": args.prompts,
                     "prompt_bytes": PROMPT_BYTES, "new_tokens": NEW_TOKENS,
                     "all_reduces": "references on the CPU" if args.cpu else
                     "tpcomm's kernels, every bfloat16 all-reduce quantized (quantized_min_bytes 16)"},
            "results": results}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(table(data))
    say(f"wrote {args.out}")
    return 0


def table(data):
    """The markdown table of docs/benchmarks.md."""
    lines = ["| run | all-reduce | held-out perplexity | greedy tokens = exact TP | = no TP |",
             "|---|---|---|---|---|",
             f"| no TP | none | {data['results']['no_tp']['perplexity']:.4f} | | |"]
    for key, run in data["results"].items():
        if key == "no_tp":
            continue
        for backend, e in run.items():
            name = "tpcomm exact" if backend == "exact" else f"tpcomm quantized {backend}"
            lines.append(f"| {key.upper()} | {name} | {e['perplexity']:.4f} | {100 * e['agree_with_exact_tp']:.1f} % "
                         f"| {100 * e['agree_with_no_tp']:.1f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
