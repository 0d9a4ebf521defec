"""One rank of tests/test_hf_families_cpu.py (run under torchrun, gloo,
float32): a tiny random model of a transformers family loaded with its own
TP plan (tp_plan="auto"), one forward of a prompt in four modes: plain
torch, inside tpcomm.install, compiled with tpcomm.compile_backend, and
compiled inside tpcomm.install. Writes, from rank 0, a JSON of whether each
mode's greedy tokens (the argmax at every position) are plain torch's, the
counts tpcomm's stats() and the compile pass report, and the number of
row-parallel all-reduces a forward runs, derived from the model's modules
and its TP plan.

    torchrun --nproc-per-node=2 tests/hf_families.py FAMILY[,FAMILY...] DIR OUT.json
"""
import fnmatch
import json
import os
import sys

import torch
import torch.distributed as dist

SHAPE = dict(hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=8,
             vocab_size=96, max_position_embeddings=64)
LAYERS = 2
# The TP styles whose module ends in an all-reduce of its partial sums
ROW_PARALLEL = ("rowwise", "rowwise_split_input", "moe_tp_experts")
# The TP styles whose module's output DTensor all-gathers (Shard -> Replicate)
GATHERED = ("colwise_gather_output",)


def model_class(family):
    import transformers as t

    return {"qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {}),
            "mistral": (t.MistralConfig, t.MistralForCausalLM, {}),
            "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM, {"sliding_window": 4}),
            "phi3": (t.Phi3Config, t.Phi3ForCausalLM, {"pad_token_id": 0}),
            "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, {"num_local_experts": 3, "num_experts_per_tok": 2}),
            }[family]


def planned_modules(model, styles):
    """The modules the model's TP plan gives one of `styles`, by name."""
    plan = dict(getattr(model, "tp_plan", None) or model.config.base_model_tp_plan)
    names = []
    for name, _ in model.named_modules():
        for pattern, style in plan.items():
            if style in styles and (fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(name, "model." + pattern)):
                names.append(name)
                break
    return names


def main():
    families, model_dir, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    results = {family: run_family(family, os.path.join(model_dir, family)) for family in families.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


def run_family(family, model_dir):
    import tpcomm
    from transformers import DistributedConfig

    rank = dist.get_rank()
    config_cls, model_cls, extra = model_class(family)
    if rank == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        torch.manual_seed(0)
        model_cls(config_cls(num_hidden_layers=LAYERS, **SHAPE, **extra)).save_pretrained(model_dir)
    dist.barrier()
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32,
                                      distributed_config=DistributedConfig(tp_plan="auto")).eval()
    group = model._device_mesh["tp"].get_group()
    comm = tpcomm.Communicator(group, device=torch.device("cpu"))
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))

    def tokens(run):
        with torch.no_grad():
            return run(ids, use_cache=False).logits.argmax(-1)

    def calls():
        return {f"{op}/{how}": v["calls"] for (op, how), v in comm.stats().items()}

    plain = tokens(model)
    layer = model.model.layers[0]
    result = {"row_parallel_per_forward": len(planned_modules(model, ROW_PARALLEL)),
              "embedding_all_reduces": len(planned_modules(model, ("embedding_rowwise",))),
              "sandwich_norm": hasattr(layer, "post_feedforward_layernorm"),
              "gathered_per_forward": len(planned_modules(model, GATHERED)),
              "plan": dict(getattr(model, "tp_plan", None) or {}), "modes": {}}
    for mode in ("install", "compiled", "compiled_install"):
        torch._dynamo.reset()
        before = calls()
        backend = tpcomm.compile_backend("aot_eager") if mode.startswith("compiled") else None
        run = torch.compile(model, backend=backend) if backend else model
        if mode.endswith("install"):
            with tpcomm.install(group):
                got = tokens(run)
        else:
            got = tokens(run)
        after = calls()
        result["modes"][mode] = {
            "tokens_agree": bool(torch.equal(got, plain)),
            "calls": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
            "pass": dict(backend.counts) if backend else None}
    comm.close()
    return result


if __name__ == "__main__":
    main()
