"""Hugging Face transformers' Llama with its own tensor-parallel plan
(tp_plan="auto"), one forward of a decode-shaped batch (batch x 1 token),
timed with torch.distributed's collectives and with tpcomm's, eager and
compiled (the torch.distributed modes are named by the run's backend: nccl
on GPUs, gloo with --cpu):

  nccl           the model as transformers runs it (dist.all_reduce on NCCL)
  tpcomm         the same inside tpcomm.install(group)
  nccl_compiled  torch.compile(model) (inductor)
  tpcomm_compiled  torch.compile(model, backend=tpcomm.compile_backend()):
                 the collectives on tpcomm, each all-reduce fused with the
                 residual add and RMSNorm after it

    torchrun --nproc-per-node=4 examples/hf_llama_tp.py            # Llama-3-8B's layer shape, 4 layers
    torchrun --nproc-per-node=2 examples/hf_llama_tp.py --tiny --cpu   # gloo, a tiny model (a CI test)

The weights are random (nothing is downloaded): rank 0 saves a LlamaConfig
model to --model-dir (made once, reused; by default a temporary directory
removed at the end), every rank loads it with the TP
plan. Every mode's next tokens are compared with the first mode's (by
default the torch.distributed one's); the time is the
median over --reps forwards (eager: launch overhead included, as a serving
engine without CUDA graphs pays it), slowest rank. Writes
results/hf_llama_tp_<gpu>x<n>.json under the working directory (or --out).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

def modes_of(backend):
    """Every mode of a run whose torch.distributed backend is `backend`."""
    return (backend, "tpcomm", f"{backend}_compiled", "tpcomm_compiled")


LLAMA_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=32000)
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--reps", type=int, default=30, help="timed forwards per mode and batch (default 30)")
    p.add_argument("--modes", default=None, help="comma-separated, of " + ", ".join(modes_of("nccl")) +
                   " (gloo for nccl with --cpu; default: all four)")
    p.add_argument("--tiny", action="store_true", help="a model of hidden size 32 (tests)")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32 (tests)")
    p.add_argument("--model-dir", default=None, help="where the random model is saved and kept (default: a temporary directory, removed)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def save_model_once(path, shape, layers, dtype):
    """Rank 0 writes a random LlamaConfig model to `path` unless one is there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=256, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)


def timed(forward, ids, reps, cuda):
    """Median seconds per forward over reps (after 3 warm-ups), slowest rank."""
    for _ in range(3):
        forward(ids)
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        forward(ids)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main(argv=None):
    args = parse_args(argv)
    from tpcomm.topology import force_multicast_off

    force_multicast_off()
    import tpcomm
    from transformers import DistributedConfig, LlamaForCausalLM

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world < 2:
        print("hf_llama_tp runs under torchrun with 2 or more ranks (--nproc-per-node=N)")
        return 0
    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    shape = TINY if args.tiny else LLAMA_8B_LAYER
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model_dir, made = args.model_dir, None
    if model_dir is None:  # rank 0 makes it and tells the others where
        made = [tempfile.mkdtemp(prefix="tpcomm-llama-") if rank == 0 else None]
        dist.broadcast_object_list(made, src=0)
        model_dir = made[0]
    if rank == 0:
        save_model_once(model_dir, shape, args.layers, dtype)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                             distributed_config=DistributedConfig(tp_plan="auto")).eval()
    group = model._device_mesh["tp"].get_group()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    comm = tpcomm.Communicator(group, device=device)
    if cuda and not comm.enabled:
        raise RuntimeError(f"tpcomm's custom path is off: {comm.disabled_reason}")
    backend = str(dist.get_backend(group))
    compiled = {f"{backend}_compiled": lambda: torch.compile(model),
                "tpcomm_compiled": lambda: torch.compile(model, backend=tpcomm.compile_backend())}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else list(modes_of(backend))
    unknown = [m for m in modes if m not in modes_of(backend)]
    if unknown:
        raise SystemExit(f"hf_llama_tp: modes {unknown} unknown on {backend}: "
                         f"choose from {', '.join(modes_of(backend))}")
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(0, shape["vocab_size"], (batch, 1), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        entry, reference = {"s_per_forward": {}}, None
        for mode in modes:
            torch._dynamo.reset()
            run = compiled[mode]() if mode in compiled else model

            def forward(x, run=run):
                with torch.no_grad():
                    return run(x, use_cache=False).logits[:, -1]

            if mode == "tpcomm":
                with tpcomm.install(group):
                    logits = forward(ids)
                    seconds = timed(forward, ids, args.reps, cuda)
            else:
                logits = forward(ids)
                seconds = timed(forward, ids, args.reps, cuda)
            entry["s_per_forward"][mode] = seconds
            if reference is None:
                reference = logits
            entry[f"{mode}_tokens_agree"] = bool(torch.equal(logits.argmax(-1), reference.argmax(-1)))
            entry[f"{mode}_logits_max_abs_diff"] = float((logits.float() - reference.float()).abs().max())
        results[str(batch)] = entry
    results["tpcomm_calls"] = {f"{op}/{b}": v["calls"] for (op, b), v in comm.stats().items()}
    if rank == 0:
        from tpcomm.bench.environment import environment

        env = environment(world)
        data = {"env": env, "model": dict(shape, layers=args.layers, dtype=str(dtype).split(".")[-1], ranks=world),
                "method": f"one forward of batch x 1 token, use_cache=False; median of {args.reps} after 3 "
                          f"warm-ups, slowest rank; compiled modes: torch.compile defaults (no CUDA graphs)",
                "results": results}
        gpu = env.get("gpu", "cpu").split()[-1].lower() if cuda else "cpu"
        path = args.out or os.path.join("results", f"hf_llama_tp_{gpu}x{world}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(json.dumps(results, indent=1))
        print(f"wrote {path}")
    comm.close()
    dist.barrier()
    if made and rank == 0:
        shutil.rmtree(model_dir, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
