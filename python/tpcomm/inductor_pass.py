"""tpcomm's compile pass as an inductor custom pass (a CustomGraphPass, so
inductor's cache keys on it and vLLM's pass manager takes it):

    torch._inductor.config.post_grad_custom_post_pass = tpcomm.inductor_pass.TpcommPass()

It runs tpcomm.compile_pass.apply: torch's functional collectives on groups
with an open Communicator become tpcomm's ops (the add + RMSNorm fusion
matches only the graph Dynamo captures, before AOT autograd decomposes the
norm: tpcomm.compile_backend runs it there). A separate module from
compile_pass because importing inductor takes seconds, which `import tpcomm`
does not pay."""
import hashlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import _cache_key, _registry, compile_pass


class TpcommPass(CustomGraphPass):
    """compile_pass.apply on a graph, then `then` (another custom pass) if
    given. `counts` (a dict given, or its own) holds what it rewrote so far
    (compile_pass.COUNTED)."""

    def __init__(self, then=None, counts=None):
        if then is not None and not isinstance(then, CustomGraphPass):
            raise TypeError(f"tpcomm: TpcommPass(then=...) takes a CustomGraphPass (what inductor can cache), "
                            f"got {type(then).__name__}")
        self.then = then
        self.counts = counts if counts is not None else dict.fromkeys(compile_pass.COUNTED, 0)

    def __call__(self, graph: torch.fx.Graph) -> None:
        compile_pass.apply(graph, self.counts)
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        """What inductor's cache keys on: tpcomm's fingerprint (its version,
        the pass's sources, the ops' schemas: tpcomm._cache_key), the groups
        it may put on tpcomm (those with an open Communicator now) and `then`."""
        digest = hashlib.sha256(_cache_key.fingerprint().encode())
        digest.update(repr(sorted((name, _registry.find(name).world_size) for name in _registry.names()
                                  if _registry.find(name) is not None)).encode())
        return digest.hexdigest(), self.then.uuid() if self.then is not None else None
