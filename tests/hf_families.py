"""Tiny random models of transformers families loaded with their own TP plan
(tp_plan="auto"), and what a forward of one issues, derived from the model's
modules and its TP plan: what tests/test_hf_families_cpu.py (gloo, float32)
and tests/gpu/test_hf_families_gpu.py (bf16, the fused kernel) share.

As a script it is one rank of tests/test_hf_families_cpu.py (run under
torchrun): one forward of a prompt in four modes: plain torch, inside
tpcomm.install, compiled with tpcomm.compile_backend, and compiled inside
tpcomm.install. Writes, from rank 0, a JSON of whether each mode's greedy
tokens (the argmax at every position) are plain torch's, the counts
tpcomm's stats() and the compile pass report, and the counts expected().

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


def save_model(family, model_dir, shape=SHAPE, norm_spread=0.0):
    """Rank 0 writes a random model of `family` to model_dir unless one is
    there (seeded: the same weights every run); every rank returns once it
    is there. norm_spread > 0 adds U(-spread, spread) to every RMSNorm
    weight (ones, or Gemma's zeros, at init), so that each norm scales the
    hidden dimensions by weights of its own and a norm given the wrong
    weight, or the wrong weight offset, changes the model's output."""
    config_cls, model_cls, extra = model_class(family)
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        torch.manual_seed(0)
        model = model_cls(config_cls(num_hidden_layers=LAYERS, **shape, **extra))
        with torch.no_grad():
            for module in model.modules():
                if norm_spread and type(module).__name__.endswith("RMSNorm"):
                    module.weight.add_(torch.empty_like(module.weight).uniform_(-norm_spread, norm_spread))
        model.save_pretrained(model_dir)
    dist.barrier()


def load_tp(family, model_dir, dtype):
    """The saved model with its own TP plan over the world group's ranks
    (transformers places it on the accelerator LOCAL_RANK names, else the CPU)."""
    from transformers import DistributedConfig

    _, model_cls, _ = model_class(family)
    # the group's size: transformers' default, WORLD_SIZE, is set by torchrun, not by tests/multiproc.py
    tp = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    return model_cls.from_pretrained(model_dir, dtype=dtype, distributed_config=tp).eval()


def tp_group(model):
    """The process group of the model's TP mesh: its "tp" dimension, or the
    mesh itself where transformers made it one-dimensional without names."""
    mesh = model._device_mesh
    return (mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else mesh).get_group()


def expected(model):
    """What a forward of the TP model issues, from its modules and TP plan:
    row-parallel all-reduces, the embedding's all-reduces, DTensor all-gathers,
    whether its layers have the sandwich norm (Gemma), and the stats key its
    row-parallel all-reduces count under once fused with their norms."""
    sandwich = hasattr(model.model.layers[0], "post_feedforward_layernorm")
    return {"row_parallel_per_forward": len(planned_modules(model, ROW_PARALLEL)),
            "embedding_all_reduces": len(planned_modules(model, ("embedding_rowwise",))),
            "sandwich_norm": sandwich,
            "fused_key": "all_reduce_rms_norm_add_rms_norm" if sandwich else "all_reduce_add_rms_norm",
            "gathered_per_forward": len(planned_modules(model, GATHERED)),
            "plan": dict(getattr(model, "tp_plan", None) or {})}


def calls(comm):
    """comm.stats()' calls by "op/backend"."""
    return {f"{op}/{how}": v["calls"] for (op, how), v in comm.stats().items()}


def calls_since(comm, before):
    """The calls (calls()) made since `before` (an earlier calls())."""
    after = calls(comm)
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def by_op(counted):
    """calls() summed over the backends of each op."""
    out = {}
    for key, n in counted.items():
        op = key.split("/")[0]
        out[op] = out.get(op, 0) + n
    return out


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

    save_model(family, model_dir)
    model = load_tp(family, model_dir, torch.float32)
    group = tp_group(model)
    comm = tpcomm.Communicator(group, device=torch.device("cpu"))
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))

    def tokens(run):
        with torch.no_grad():
            return run(ids, use_cache=False).logits.argmax(-1)

    plain = tokens(model)
    result = dict(expected(model), modes={})
    for mode in ("install", "compiled", "compiled_install"):
        torch._dynamo.reset()
        before = calls(comm)
        backend = tpcomm.compile_backend("aot_eager") if mode.startswith("compiled") else None
        run = torch.compile(model, backend=backend) if backend else model
        if mode.endswith("install"):
            with tpcomm.install(group):
                got = tokens(run)
        else:
            got = tokens(run)
        result["modes"][mode] = {
            "tokens_agree": bool(torch.equal(got, plain)),
            "calls": calls_since(comm, before),
            "pass": dict(backend.counts) if backend else None}
    comm.close()
    return result


if __name__ == "__main__":
    main()
