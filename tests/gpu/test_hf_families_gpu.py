"""Transformers families on tpcomm's kernels (tests/hf_families.py: tiny
random models loaded with their own TP plan), bf16, one forward of a prompt
per mode: Qwen3 (pre-norm: each row-parallel all-reduce, then the residual
add and the next RMSNorm: ADD_NORM), Gemma3 (the sandwich norm, weight
1 + w: an RMSNorm of the all-reduce's sum, the residual add, the next
RMSNorm: NORM_ADD_NORM), Granite (ADD_NORM with the residual multiplier),
OLMo (ADD_LAYER_NORM, no weight or bias) and Cohere (parallel attention +
MLP: the two all-reduces merged, then ADD_LAYER_NORM). The hidden size (384) puts every all-reduce and
fused call within the fused kernel's limits, and every norm has weights
(and LayerNorm biases) of its own (hf_families.save_model's norm_spread), so a norm given the wrong
weight or weight offset changes the logits. The model is loaded and then
given to tpcomm.skip_backward_hooks_without_grad, as a user does (the
q_norm / k_norm hooks of transformers 5.3 to 5.21 would break the graph).

Modes, each checked against what the model's modules and TP plan issue
(hf_families.expected):
* eager, inside tpcomm.install: every row-parallel and embedding all-reduce
  and every DTensor all-gather (the LM head's) counted on tpcomm's kernels;
  on 2 ranks the logits are plain torch's bit for bit (a sum of two is a + b
  rounded once, whoever adds). A random rank is made late (torch.cuda._sleep)
  before each decoder layer.
* torch.compile with tpcomm.compile_backend() (inductor): every row-parallel
  all-reduce fused with its norms, counted once under its pattern's key
  with the route "fused" (the fused kernel, not the unfused fallback); the
  embedding's all-reduce and the all-gathers on the kernels; a random rank
  made late before the forward. The logits are the same bits on every rank.

Accuracy ("within the fused op's bound of an fp32 run"): the reference is the
same weights run in fp32 without TP, against which each run's logits are
held to plain torch's bf16 TP run's error (tests/logit_accuracy.py: the
criterion and why; inductor keeps pointwise chains in fp32 too).

Where ranks share one GPU (TPCOMM_SHARE_GPU=1) the group is gloo, whose
all-gather into one tensor (the functional collective DTensor's
redistribute calls) crashes on CUDA tensors (pytorch#152645): the plain
torch run gathers through host memory there (_torch_gathers; an all-gather
moves bits, so any correct one gives the same logits), and the tpcomm runs
never reach gloo (install and the compile pass take every collective; in
the compiled run a gather left behind would go through host memory and
fail the counts rather than crash).

    TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=2 python -m pytest -q -rs tests/gpu/test_hf_families_gpu.py   # and =3

Dry run of the same bodies on CPU ranks (gloo, bf16; no kernels, so the
fused calls route "unfused" and the collectives count under "gloo"):

    python tests/gpu/test_hf_families_gpu.py --cpu [--world N] [--inner aot_eager|inductor] [FAMILY ...]
"""
import contextlib
import os
import sys

if __name__ == "__main__":  # the dry run: the helper modules' directories, as conftest.py puts them
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(_HERE), os.path.join(os.path.dirname(os.path.dirname(_HERE)), "python")]

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import hf_families  # noqa: E402 - tests/ is on sys.path (conftest.py's directory)
import multiproc  # noqa: E402
import tpcomm  # noqa: E402
from bitexact import assert_bits_equal  # noqa: E402
from logit_accuracy import failures as accuracy_failures  # noqa: E402
from gpu_checks import KERNELS, delay_random_rank, no_compile_caches, shared_rng  # noqa: E402
from tpcomm import functional_collectives  # noqa: E402

pytestmark = pytest.mark.gpu

FAMILIES = ("qwen3", "gemma3", "granite", "olmo", "cohere")
# the key each family's fused calls count under (hf_families.expected derives it; this pins it)
FUSED_KEY = {"qwen3": "all_reduce_add_rms_norm", "gemma3": "all_reduce_rms_norm_add_rms_norm",
             "granite": "all_reduce_add_rms_norm", "olmo": "all_reduce_add_layer_norm",
             "cohere": "all_reduce_add_layer_norm"}
SHAPE = dict(hidden_size=384, intermediate_size=768, num_attention_heads=6, num_key_value_heads=6, head_dim=64,
             vocab_size=384, max_position_embeddings=64)  # heads, MLP and vocabulary split evenly over 2 and 3 ranks
NORM_SPREAD = 0.5    # norm weights and biases: init + U(-0.5, 0.5)
PROMPT = (2, 8)      # batch, positions


# ------------------------------------------------------------ references
class _HostGather:
    """Stands for a Communicator in tpcomm.functional_collectives' hook for
    the plain torch run on a gloo group: the all-gather through host memory
    (gloo's CPU all-gather); every other functional collective declined,
    so torch's own kernel runs it."""

    def __init__(self, group, device):
        self.group, self.device, self.world_size = group, device, group.size()

    def all_gather(self, x, dim):
        host = x.cpu()
        parts = [torch.empty_like(host) for _ in range(self.world_size)]
        dist.all_gather(parts, host, group=self.group)
        return torch.cat(parts, dim).to(self.device)

    def all_reduce(self, x):
        return None

    def reduce_scatter(self, x, dim):
        return None


@contextlib.contextmanager
def _torch_gathers(group, device):
    """Plain torch's collectives, DTensor's all-gathers through host memory
    where the group is gloo (see the module's doc). Not inside an install
    (both hold the one hook)."""
    if dist.get_backend(group) != "gloo":
        yield
        return
    assert not tpcomm.torch_collectives._installed, "_torch_gathers inside tpcomm.install"
    shim = _HostGather(group, device)
    functional_collectives.hook(lambda name: shim if name == group.group_name else None, lambda fn, *a: fn(*a))
    try:
        yield
    finally:
        functional_collectives.unhook()


def _logits(run, ids):
    with torch.no_grad():
        return run(ids, use_cache=False).logits


def _fp32_logits(family, model_dir, ids, device):
    """The reference: the same weights in fp32, one device, no TP."""
    torch.set_float32_matmul_precision("highest")  # fp32 matmuls, never TF32: the reference must be fp32
    _, model_cls, _ = hf_families.model_class(family)
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    return _logits(model, ids).float()


def _check_accuracy(what, logits, torch_bf16, ref32):
    failed = accuracy_failures(what, logits, torch_bf16, ref32)
    assert not failed, failed[0]


def _same_on_all_ranks(logits, group, what):
    host = logits.cpu()
    parts = [torch.empty_like(host) for _ in range(group.size())]
    dist.all_gather(parts, host, group=group)
    for r, part in enumerate(parts):
        assert_bits_equal(part, parts[0], f"{what}: rank {r}'s logits differ from rank 0's")


# ------------------------------------------------------------ the custom path
def _assert_on(calls, expected, what, on_gpu):
    """calls ({"op/backend": n}) are exactly `expected` per op, and on the
    GPU every collective ran on tpcomm's kernels (no "gloo"/"nccl" fallback)."""
    assert hf_families.by_op(calls) == {op: n for op, n in expected.items() if n}, (what, calls)
    if on_gpu:
        off = [k for k in calls if k.split("/")[0] in ("all_reduce", "all_gather") and k.split("/")[1] not in KERNELS]
        assert not off, f"{what}: collectives off tpcomm's kernels: {off} in {calls}"


def _family_body(rank, world, family, root, inner, on_gpu):
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if on_gpu:
        os.environ["LOCAL_RANK"] = str(device.index)  # transformers places the TP model on cuda:LOCAL_RANK
    model_dir = os.path.join(root, family)
    hf_families.save_model(family, model_dir, SHAPE, norm_spread=NORM_SPREAD)
    model = hf_families.load_tp(family, model_dir, torch.bfloat16)
    tpcomm.skip_backward_hooks_without_grad(model)  # transformers 5.3-5.21's q_norm/k_norm hooks: no graph break
    assert next(model.parameters()).device == device, next(model.parameters()).device
    group = hf_families.tp_group(model)
    comm = tpcomm.Communicator(group, device=device)
    if on_gpu:
        assert comm.enabled, comm.disabled_reason
    want = hf_families.expected(model)
    rows, gathers, embeddings = want["row_parallel_per_forward"], want["gathered_per_forward"], \
        want["embedding_all_reduces"]
    fused_key, merged = want["fused_key"], want["merged_per_forward"]
    assert rows > 0 and gathers > 0, want
    assert fused_key == FUSED_KEY[family] and merged == (len(model.model.layers) if family == "cohere" else 0), want
    ids = torch.randint(0, SHAPE["vocab_size"], PROMPT, generator=torch.Generator().manual_seed(1)).to(device)
    ref32 = _fp32_logits(family, model_dir, ids, device)
    with _torch_gathers(group, device):
        torch_bf16 = _logits(model, ids)
    rng = shared_rng(world)

    # eager, inside tpcomm.install; a random rank late before each decoder layer
    def late(*_):
        delay_random_rank(rank, world, rng)  # returns None: the layer's inputs stay as they are

    hooks = [layer.register_forward_pre_hook(late) for layer in model.model.layers] if on_gpu else []
    before = hf_families.calls(comm)
    with tpcomm.install(group):
        eager = _logits(model, ids)
    for h in hooks:
        h.remove()
    what = f"{family} at {world} ranks, eager install"
    _assert_on(hf_families.calls_since(comm, before),
               {"all_reduce": rows + embeddings, "all_gather": gathers}, what, on_gpu)
    if world == 2:
        assert_bits_equal(eager, torch_bf16, f"{what}: logits differ from plain torch's")
    _same_on_all_ranks(eager, group, what)
    _check_accuracy(what, eager, torch_bf16, ref32)

    # compiled with tpcomm.compile_backend
    what = f"{family} at {world} ranks, compile_backend({inner!r})"
    torch._dynamo.reset()
    backend = tpcomm.compile_backend(inner)
    compiled = torch.compile(model, backend=backend)
    with no_compile_caches(), _torch_gathers(group, device):  # no cached graph: the pass runs, its counts prove it
        _logits(compiled, ids)
        counts = dict(backend.counts)
        if on_gpu:
            delay_random_rank(rank, world, rng)
        before = hf_families.calls(comm)
        logits = _logits(compiled, ids)
    calls = hf_families.calls_since(comm, before)
    # a parallel block's two all-reduces merged into one (Cohere), then fused
    assert counts[fused_key] == rows - merged and counts["all_reduce_merged"] == merged \
        and counts["all_gather"] == gathers, (what, counts)
    _assert_on({k: n for k, n in calls.items() if not k.startswith(fused_key + "/")},
               {"all_reduce": embeddings, "all_gather": gathers}, what, on_gpu)
    fused = {k: n for k, n in calls.items() if k.startswith(fused_key + "/")}
    assert sum(fused.values()) == rows - merged, (what, calls)
    _same_on_all_ranks(logits, group, what)
    _check_accuracy(what, logits, torch_bf16, ref32)
    route = "fused" if on_gpu else "unfused"  # CPU ranks have no kernel
    assert fused == {f"{fused_key}/{route}": rows - merged}, (
        f"{what}: expected all {rows} row-parallel all-reduces ({merged} pairs merged) fused as {fused_key} on "
        f"the route {route!r}, got "
        f"{fused}; 'unfused' means routing.norm_pattern refused the call (dtype, row length, packet cap)")
    comm.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_on_the_fused_kernel(tmp_path, family):
    multiproc.run_gpu(_family_body, family, str(tmp_path), "inductor", True, timeout=600)


def _dry_run(argv):
    """The bodies on CPU ranks (see the module's doc)."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--inner", default="aot_eager")
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            multiproc.run_ranks(args.world, _family_body, family, root, args.inner, False, timeout=1800)
            print(f"{family} at {args.world} CPU ranks, {args.inner}: passed")


if __name__ == "__main__":
    _dry_run(sys.argv[1:])
