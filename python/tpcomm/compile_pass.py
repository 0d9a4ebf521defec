"""torch.compile puts torch's own collectives on tpcomm: a model written with
torch.distributed (dist.all_reduce, dist.all_gather_into_tensor,
dist.reduce_scatter_tensor: Hugging Face transformers' tensor parallelism
calls them) or with functional collectives (torchtitan, gpt-fast, DTensor)
runs tpcomm's collectives with no edit:

    compiled = torch.compile(model, backend=tpcomm.compile_backend())          # then inductor
    compiled = torch.compile(model, backend=tpcomm.compile_backend("aot_eager"))

compile_backend runs tpcomm.graph_pass.apply (what it rewrites, and where
it leaves the graph as it is: that module's doc) on the graph Dynamo
captured and again on the graph AOT autograd produces, then the inner
backend. tpcomm.inductor_pass.TpcommPass does the same as an inductor
custom pass (it composes with another pass given as `then`, and vLLM's
pass manager takes it):

    torch._inductor.config.post_grad_custom_post_pass = tpcomm.inductor_pass.TpcommPass()

The last graph tpcomm rewrites is checked for all-reduces left unfused next
to an add + RMSNorm, which are reported once (tpcomm.unfused_report). While
it compiles, torch.compile's cache key holds cache_tag: tpcomm's
fingerprint and the world size of each group the graph names.
"""
import torch

from . import _cache_key, _registry, ops
from .graph_pass import COUNTED, apply


class compile_backend:
    """A torch.compile backend: apply() over the graph Dynamo captured,
    then the backend `inner`, a name or a backend callable (inductor by default, with
    `inductor_options` as config patches, e.g. **{"triton.cudagraphs": True}).
    fuse=False leaves the add + RMSNorm unfused (the collectives alone on
    tpcomm: the model's own arithmetic, bit for bit). `counts` holds what
    the pass rewrote over every graph compiled so far."""

    def __init__(self, inner="inductor", *, fuse=True, **inductor_options):
        if inductor_options and inner != "inductor":
            raise ValueError(f"tpcomm: inductor options are for inner='inductor', not {inner!r}")
        self.inner = inner
        self.fuse = fuse
        self.inductor_options = inductor_options
        self.counts = dict.fromkeys(COUNTED, 0)

    def __call__(self, gm, example_inputs):
        apply(gm.graph, self.counts, self.fuse, report=self.inner not in ("inductor", "aot_eager"))
        with torch.compiler.config.patch(cache_key_tag=torch.compiler.config.cache_key_tag + cache_tag(gm.graph)):
            if self.inner == "inductor":
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs, config_patches=self._with_post_grad_pass())
            if self.inner == "aot_eager":
                return self._aot_eager()(gm, example_inputs)
            return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

    # DTensor's collectives (redistribute: the LM head's and colwise_gather_output's all-gathers, the
    # embedding's all-reduce, transformers 4.x's row-parallel all-reduces) are not in the graph Dynamo
    # captures: Dynamo keeps DTensor operations whole, and AOT autograd turns them into functional
    # collectives. So apply() runs once more on the graph AOT produces: by inductor's post-grad pass, or
    # aot_eager's forward compiler.
    def _with_post_grad_pass(self):
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass

        from .inductor_pass import TpcommPass

        patches = dict(self.inductor_options)
        then = patches.get("post_grad_custom_post_pass", config.post_grad_custom_post_pass)
        if then is None or (isinstance(then, CustomGraphPass) and not isinstance(then, TpcommPass)):
            patches["post_grad_custom_post_pass"] = TpcommPass(then=then, counts=self.counts, fuse=self.fuse)
        return patches

    def _aot_eager(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def forward(gm, example_inputs):
            apply(gm.graph, self.counts, self.fuse)
            gm.recompile()
            return make_boxed_func(gm.forward)

        return aot_autograd(fw_compiler=forward)


def cache_tag(graph: torch.fx.Graph) -> str:
    """What compile_backend adds to torch.compile's cache key while it
    compiles graph: ";tpcomm@<tpcomm._cache_key.fingerprint()>" (tpcomm's
    version, the pass's sources, the ops' schemas), then world_tag(graph)."""
    return f";tpcomm@{_cache_key.fingerprint()}" + world_tag(graph)


def _communicator_of(node):
    """The open Communicator a call of a tpcomm op (of any of
    ops.NAMESPACES; an overload or the packet Dynamo records) names, by its
    group_name or comm_id argument, or None."""
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverloadPacket) and "default" in target.overloads():
        target = target.default
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ops.NAMESPACES:
        return None
    for i, argument in enumerate(target._schema.arguments):
        if argument.name in ("group_name", "comm_id"):
            value = node.kwargs.get(argument.name, node.args[i] if i < len(node.args) else None)
            if argument.name == "group_name":
                return _registry.find(value) if isinstance(value, str) else None
            return _registry.find_id(value) if isinstance(value, int) else None
    return None


def world_tag(graph: torch.fx.Graph) -> str:
    """";tpcomm:<group>=<world size>" for each group the graph's tpcomm ops
    name (by group name or communicator id), sorted. torch.compile's on-disk
    caches key a graph by its code and its inputs' shapes, where a group name
    says nothing of the group's size: without the tag, a graph compiled at
    one world size whose inputs do not depend on it would be served at
    another (docs/design.md, Limits)."""
    sizes = {}
    for node in graph.nodes:
        comm = _communicator_of(node)
        if comm is not None:
            sizes[comm.group_name] = comm.world_size
    return "".join(f";tpcomm:{name}={size}" for name, size in sorted(sizes.items()))
