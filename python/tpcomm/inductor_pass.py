"""tpcomm's compile pass as an inductor custom pass (a CustomGraphPass, so
inductor's cache keys on it and vLLM's pass manager takes it):

    torch._inductor.config.post_grad_custom_post_pass = tpcomm.inductor_pass.TpcommPass()

It runs tpcomm.graph_pass.apply: torch's functional collectives on groups
with an open Communicator become tpcomm's ops, and (fuse=True) each
all-reduce with the add + RMSNorm around it, in the aten form AOT autograd
gives the norm (tpcomm.aten_norms), becomes the fused op. A module of its
own because importing inductor takes seconds, which `import tpcomm` does
not pay: tpcomm.compile_pass imports it only when it compiles with inductor."""
import hashlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import _cache_key, _registry, graph_pass


class TpcommPass(CustomGraphPass):
    """graph_pass.apply on a graph (fuse=False: the collectives alone),
    then `then` (another custom pass) if given. `counts` (a dict given, or
    its own) holds what it rewrote so far (graph_pass.COUNTED)."""

    def __init__(self, then=None, counts=None, fuse=True):
        if then is not None and not isinstance(then, CustomGraphPass):
            raise TypeError(f"tpcomm: TpcommPass(then=...) takes a CustomGraphPass (what inductor can cache), "
                            f"got {type(then).__name__}")
        self.then = then
        self.fuse = fuse
        self.counts = counts if counts is not None else dict.fromkeys(graph_pass.COUNTED, 0)

    def __call__(self, graph: torch.fx.Graph) -> None:
        graph_pass.apply(graph, self.counts, self.fuse)
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        """What inductor's cache keys on: tpcomm's fingerprint (its version,
        the pass's sources, the ops' schemas: tpcomm._cache_key), whether it
        fuses, the groups it may put on tpcomm (those with an open Communicator
        now) and `then`."""
        digest = hashlib.sha256(f"fuse={self.fuse};{_cache_key.fingerprint()}".encode())
        digest.update(repr(sorted((name, _registry.find(name).world_size) for name in _registry.names()
                                  if _registry.find(name) is not None)).encode())
        return digest.hexdigest(), self.then.uuid() if self.then is not None else None
