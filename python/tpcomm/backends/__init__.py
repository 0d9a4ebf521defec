"""The backends the dispatcher (tpcomm.Communicator) routes a collective to,
one small module each, used by the benchmark (tpcomm.bench) as well, so what
is measured is what runs. The benchmark's comparison-only backends (NCCL
windows, torch SymmetricMemory) live with it: tpcomm.bench.nccl_window and
tpcomm.bench.symm_mem follow the same contract.

Every backend is an object made for one process group (its set-up, where it
needs any, is collective and fails on every rank alike) with:

* the ops it runs, as methods: all_reduce, all_gather, reduce_scatter (the
  subset it has), each taking tensors on the group's device;
* what it needs under CUDA graph capture, in its docstring (nothing beyond
  the tensors for NCCL and tpcomm's kernels; buffers registered at set-up
  for the benchmark's window and symmetric-memory backends, which run on views of them);
* Unavailable, raised with the reason, when it cannot run a call.

Modules: nccl (torch.distributed), kernels (tpcomm's packet, line and bulk
kernels through the internal torch ops and the eager fast path), aiter (AMD
AITER's custom all-reduce: ROCm only, tried first by
the dispatcher there).
"""


class Unavailable(Exception):
    """A backend cannot run this call (or at all); the message says why."""
