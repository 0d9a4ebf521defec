"""Tiny random models of transformers families loaded with their own TP plan
(tp_plan="auto"), and what a forward of one issues, derived from the model's
modules and its TP plan: what tests/test_hf_families_cpu.py (gloo, float32),
.ci/test_transformers_versions.py (the same under other transformers
versions, float32 and bf16) and tests/gpu/test_hf_families_gpu.py (bf16, the
fused kernel) share. Works with transformers 4.57 and 5.x (their TP plans
name the styles differently: ROW_PARALLEL, GATHERED).

As a script it is one rank of those CPU tests (run under torchrun): for
each family and dtype, one forward of a prompt in plain torch and then in
each mode asked for: inside tpcomm.install ("install"), compiled with
tpcomm.compile_backend("aot_eager") ("compiled"), compiled inside
tpcomm.install ("compiled_install"), and "compiled_unprepared", the
compiled mode before tpcomm.skip_backward_hooks_without_grad(model) (which
every other mode runs after, as a user would), run only where the model
holds backward hooks. Writes, from rank 0, a JSON
of the versions and, by family and dtype, whether each mode's greedy tokens
(the argmax at every position) are plain torch's, the counts tpcomm's
stats() and the compile pass report, the warnings tpcomm logged, and the
counts expected(); check() judges one family's result.

    torchrun --nproc-per-node=2 tests/hf_families.py FAMILY[,FAMILY...] DIR OUT.json \
        [--dtypes float32,bfloat16] [--modes install,compiled,compiled_install]
"""
import argparse
import fnmatch
import json
import logging
import os

import torch
import torch.distributed as dist

import logit_accuracy

# transformers >= 5.2x with the `kernels` package swaps modules (rotary, norms)
# for kernels fetched from the Hub on CUDA: the families compare tpcomm with
# transformers' own torch code, offline, so its modules stay as written.
os.environ.setdefault("USE_HUB_KERNELS", "NO")

SHAPE = dict(hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=8,
             vocab_size=96, max_position_embeddings=64)
LAYERS = 2
# The TP styles whose module ends in an all-reduce of its partial sums (4.x: rowwise_rep)
ROW_PARALLEL = ("rowwise", "rowwise_rep", "rowwise_split_input", "moe_tp_experts")
# The TP styles whose module's output DTensor all-gathers (Shard -> Replicate; 4.x: colwise_rep)
GATHERED = ("colwise_gather_output", "colwise_rep")
MODES = ("install", "compiled", "compiled_install")


def model_class(family):
    import transformers as t

    return {"qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {}),
            "mistral": (t.MistralConfig, t.MistralForCausalLM, {}),
            "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM, {"sliding_window": 4}),
            "phi3": (t.Phi3Config, t.Phi3ForCausalLM, {"pad_token_id": 0}),
            "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, {"num_local_experts": 3, "num_experts_per_tok": 2}),
            # LayerNorm with neither weight nor bias (F.layer_norm in fp32, cast back)
            "olmo": (t.OlmoConfig, t.OlmoForCausalLM, {}),
            # the residual multiplier: residual + h * 0.22 (Granite 3's)
            "granite": (t.GraniteConfig, t.GraniteForCausalLM, {"residual_multiplier": 0.22}),
            # parallel attention + MLP, (residual + attn) + mlp; a LayerNorm written out, weight before the cast
            "cohere": (t.CohereConfig, t.CohereForCausalLM, {}),
            }[family]


def _parallelized(module):
    """Whether transformers applied a TP style to module: hooks on it (the
    style's input and output transforms) or DTensor parameters. (4.57 leaves
    the modules of a plan entry it does not apply as they are: Mixtral's
    experts.)"""
    from torch.distributed.tensor import DTensor

    return bool(module._forward_hooks or module._forward_pre_hooks) or any(
        isinstance(p, DTensor) for p in module.parameters(recurse=False))


def planned_modules(model, styles):
    """The modules the model's TP plan gives one of `styles` (and that
    transformers parallelized), by name."""
    plan = dict(getattr(model, "tp_plan", None) or model.config.base_model_tp_plan)
    names = []
    for name, module in model.named_modules():
        for pattern, style in plan.items():
            if style in styles and (fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(name, "model." + pattern)):
                if _parallelized(module):
                    names.append(name)
                break
    return names


def save_model(family, model_dir, shape=SHAPE, norm_spread=0.0):
    """Rank 0 writes a random model of `family` to model_dir unless one is
    there (seeded: the same weights every run); every rank returns once it
    is there. norm_spread > 0 adds U(-spread, spread) to every RMSNorm and
    LayerNorm weight and bias (ones, Gemma's zeros, biases zeros at init), so that each norm scales the
    hidden dimensions by weights of its own and a norm given the wrong
    weight, or the wrong weight offset, changes the model's output."""
    config_cls, model_cls, extra = model_class(family)
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        torch.manual_seed(0)
        model = model_cls(config_cls(num_hidden_layers=LAYERS, **shape, **extra))
        with torch.no_grad():
            for module in model.modules():
                if norm_spread and type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
                    for p in (getattr(module, "weight", None), getattr(module, "bias", None)):
                        if p is not None:
                            p.add_(torch.empty_like(p).uniform_(-norm_spread, norm_spread))
        model.save_pretrained(model_dir)
    dist.barrier()


def load_tp(family, model_dir, dtype):
    """The saved model with its own TP plan over the world group's ranks
    (transformers places it on the accelerator LOCAL_RANK names, else the CPU)."""
    import transformers

    _, model_cls, _ = model_class(family)
    # the group's size: transformers' default, WORLD_SIZE, is set by torchrun, not by tests/multiproc.py
    if hasattr(transformers, "DistributedConfig"):  # 5.x
        tp = dict(distributed_config=transformers.DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size()))
    else:  # 4.x
        tp = dict(tp_plan="auto", tp_size=dist.get_world_size())
    return model_cls.from_pretrained(model_dir, dtype=dtype, **tp).eval()


def tp_group(model):
    """The process group of the model's TP mesh: its "tp" dimension, or the
    mesh itself where transformers made it one-dimensional without names."""
    mesh = model._device_mesh
    return (mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else mesh).get_group()


def _layer_norm(layer):
    """Whether the decoder layer's norms are LayerNorms (nn.LayerNorm, OLMo's, Cohere's), not RMSNorms."""
    return any(type(m).__name__.endswith("LayerNorm") and "RMS" not in type(m).__name__ for m in layer.modules())


def _parallel(model):
    """Whether attention and the MLP read the same input, their sums added to the residual together:
    GPT-NeoX's use_parallel_residual, or a layer with no norm between them (Cohere, Phi)."""
    layer = model.model.layers[0]
    return bool(getattr(model.config, "use_parallel_residual", not hasattr(layer, "post_attention_layernorm")))


def expected(model):
    """What a forward of the TP model issues, from its modules and TP plan:
    row-parallel all-reduces, the embedding's all-reduces, DTensor all-gathers,
    whether its layers have the sandwich norm (Gemma), the stats key its
    row-parallel all-reduces count under once fused with their norms, and how
    many pairs of them the compile pass merges (one a layer in a parallel
    block: the fused calls are the row-parallel all-reduces less those)."""
    sandwich = hasattr(model.model.layers[0], "post_feedforward_layernorm")
    pattern = "norm_add_norm" if sandwich else "add_norm"
    if _layer_norm(model.model.layers[0]):
        pattern = pattern.replace("norm", "layer_norm")
    else:
        pattern = pattern.replace("norm", "rms_norm")
    return {"row_parallel_per_forward": len(planned_modules(model, ROW_PARALLEL)),
            "embedding_all_reduces": len(planned_modules(model, ("embedding_rowwise",))),
            "sandwich_norm": sandwich,
            "fused_key": "all_reduce_" + pattern,
            "merged_per_forward": len(model.model.layers) if _parallel(model) else 0,
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


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("families")
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    import transformers

    dist.init_process_group("gloo")
    families = {family: {dtype: run_family(family, os.path.join(args.model_dir, family), getattr(torch, dtype),
                                           args.modes.split(","))
                         for dtype in args.dtypes.split(",")}
                for family in args.families.split(",")}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
                       "families": families}, f, indent=1)
    dist.destroy_process_group()


class Warnings(logging.Handler):
    """The warnings logged on tpcomm's logger while attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_family(family, model_dir, dtype, modes):
    import tpcomm
    from tpcomm import unfused_report

    assert "compiled_unprepared" not in modes[1:], "compiled_unprepared runs first: before the hooks are skipped"
    save_model(family, model_dir)
    model = load_tp(family, model_dir, dtype)
    group = tp_group(model)
    comm = tpcomm.Communicator(group, device=torch.device("cpu"))
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))

    def logits(run):
        with torch.no_grad():
            return run(ids, use_cache=False).logits

    plain = logits(model)
    # where tpcomm rounds otherwise than the model (bf16), runs are held to an fp32 run's tokens
    ref32 = logits(load_tp(family, model_dir, torch.float32)) if dtype != torch.float32 else None
    result = dict(expected(model), modes={})
    hooked = any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())
    for mode in modes:
        if mode == "compiled_unprepared" and not hooked:
            continue
        if mode != "compiled_unprepared":
            result["hooked_modules"] = tpcomm.skip_backward_hooks_without_grad(model)
        torch._dynamo.reset()
        unfused_report._said.clear()  # each mode's own warnings and graph breaks
        torch._dynamo.utils.counters["graph_break"].clear()
        warnings = Warnings()
        tpcomm_logger = logging.getLogger("tpcomm")
        tpcomm_logger.addHandler(warnings)
        before = calls(comm)
        backend = tpcomm.compile_backend("aot_eager") if mode.startswith("compiled") else None
        run = torch.compile(model, backend=backend) if backend else model
        try:
            if mode.endswith("install"):
                with tpcomm.install(group):
                    got = logits(run)
            else:
                got = logits(run)
        finally:
            tpcomm_logger.removeHandler(warnings)
        result["modes"][mode] = {
            "tokens_agree": bool(torch.equal(got.argmax(-1), plain.argmax(-1))),
            "accuracy_failures": logit_accuracy.failures(mode, got, plain, ref32) if ref32 is not None else [],
            "calls": calls_since(comm, before),
            "pass": dict(backend.counts) if backend else None,
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "warnings": warnings.messages}
    comm.close()
    return result


def check(r, what, exact=True):
    """The failures of one family's result r (run_family's) as messages:
    each mode's greedy tokens are plain torch's (exact) or its logits as
    accurate (not exact: bf16, tests/logit_accuracy.py); eager under install, each
    row-parallel all-reduce and the embedding's on tpcomm; compiled, each
    row-parallel all-reduce fused with its norms, counted once under its
    pattern's key, and nothing reported unfused; compiled_unprepared (a model
    with backward hooks), a graph break reported naming the hooks; DTensor's
    all-gathers on tpcomm in every mode. In a parallel block each layer's two
    row-parallel all-reduces are merged into one, then fused."""
    rows, gathers, embeddings = r["row_parallel_per_forward"], r["gathered_per_forward"], r["embedding_all_reduces"]
    merged = r.get("merged_per_forward", 0)
    fused_key, failed = r["fused_key"], []
    if rows <= 0:
        failed.append(f"{what}: no row-parallel module in the TP plan {r['plan']}")
    for mode, m in r["modes"].items():
        where, calls = f"{what}, {mode}", m["calls"]
        ops = by_op(calls)
        if exact and not m["tokens_agree"]:
            failed.append(f"{where}: greedy tokens differ from plain torch's")
        failed += [f"{what}, {f}" for f in m["accuracy_failures"]]
        if ops.get("all_gather", 0) != gathers:
            failed.append(f"{where}: {gathers} all-gathers expected on tpcomm, got {calls}")
        if mode == "install":
            want = {k: v for k, v in {"all_reduce": rows + embeddings, "all_gather": gathers}.items() if v}
            if ops != want:
                failed.append(f"{where}: expected {want}, got {calls}")
        elif mode == "compiled_unprepared":
            if not any("graph break" in w and "backwards hooks" in w for w in m["warnings"]):
                failed.append(f"{where}: no warning of the backward hooks' graph breaks: {m['warnings']}")
        else:
            fused = rows - merged
            if ops.get(fused_key) != fused or ops.get("all_reduce", 0) != embeddings:
                failed.append(f"{where}: expected all {rows} row-parallel all-reduces ({merged} pairs merged) fused "
                              f"as {fused} {fused_key} and {embeddings} embedding all-reduces, got {calls}")
            # the pass counts each graph once: one a layer reuses after a graph break, once, not per layer
            counted = m["pass"][fused_key], m["pass"]["all_gather"], m["pass"]["all_reduce_merged"]
            if m["graph_breaks"]:
                wrong = not 0 < counted[0] <= fused
            else:
                wrong = counted != (fused, gathers, merged)
            if wrong:
                failed.append(f"{where}: the pass counted {m['pass']} ({m['graph_breaks']} graph breaks)")
            if m["warnings"]:
                failed.append(f"{where}: tpcomm warned {m['warnings']}")
    return failed


if __name__ == "__main__":
    main()
