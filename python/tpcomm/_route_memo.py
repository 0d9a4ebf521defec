"""The Communicator's per-call choice between tpcomm's kernels and the
fallback, remembered: the route_* answers (tpcomm.routing asked with the
Communicator's routes and caps), the memo of each call's route as the
callable that runs it, and the stats() cells the calls count in.

A memo entry is (stats cell, run, whether run is tpcomm's kernel), keyed
per op by (dtype, size), (dtype, size, dim) for reduce_scatter or (shape,
dim, element size) for all_gather; routing is walked only on a miss. The
fallback is named as stats() counts it: by the group's backend ("nccl" on
GPUs, "gloo" on CPU), tpcomm.routing's "nccl" translated in _route."""
import functools

import torch

from . import _agreement, _autograd, _one_rank, routing
from ._shapes import check_tensor, checked_dim
from .backends import aiter

_ROUTE_MEMO_MAX = 4096  # routes remembered per op before the memo starts over
SINGLE_RANK = "single rank"  # disabled_reason, and the backend (route, stats) of a group of one
_KERNEL_ROUTES = frozenset(routing.KERNELS + routing.QUANTIZED)  # what the kernel-or-None methods run


class RouteMemo:
    """The routing and stats methods of tpcomm.Communicator (its base): they
    use its `world_size`, `max_bytes`, `config`, `_routes`, `_caps`,
    `_memo`, `_stat_cells`, `_fallback`, `_nccl`, `_kernels`, `_aiter` and
    `_agreement`."""

    def route_all_reduce(self, x: torch.Tensor) -> str:
        """The backend all_reduce(x) uses: "packet", "line", "two_shot", "bulk", the fallback
        ("nccl", "gloo"), or "quantized_<mode>" where Config.quantize is on (tpcomm.routing.quantized)."""
        return self._route_of("all_reduce", x)

    def route_all_gather(self, x: torch.Tensor, dim: int = 0) -> str:
        """The backend all_gather(x, dim) uses: "packet", "line", "bulk" or the fallback."""
        check_tensor(x, "input")
        return self._route_of("all_gather", x, checked_dim(x, dim, "route_all_gather"))

    def route_reduce_scatter(self, x: torch.Tensor) -> str:
        """The backend reduce_scatter(x, dim) uses: "packet", "line", "bulk" or the fallback."""
        return self._route_of("reduce_scatter", x)

    def route_all_reduce_add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> str:
        """How all_reduce_add_rms_norm(x, residual, weight) runs: "fused" (one
        kernel), "split" (reduce-scatter in fp32, the norm on this rank's rows,
        all-gather) or "unfused" (all_reduce in fp32, then torch)."""
        return self._route(routing.add_rms_norm, self.config.fused_kernel, x.dtype, weight.dtype,
                           x.numel() * x.element_size(), x.shape[-1] * x.element_size() if x.dim() else 0)

    def stats(self) -> dict:
        """Calls and input bytes per rank so far, per (op, backend) that ran them:
        {("all_reduce", "packet"): {"calls": 12, "bytes": 49152}, ...}. The
        fallback is named by the group's torch.distributed backend ("nccl",
        "gloo"); a group of one counts under "single rank"."""
        return {key: {"calls": c[0], "bytes": c[1]} for key, c in self._stat_cells.items() if c[0]}

    def _route_of(self, op, x, dim=0):
        """The route of `op` of x along a checked dim (the route_* methods' answer)."""
        row = routing.row_bytes(x.shape, dim, x.element_size()) if op == "all_gather" else 0
        return self._route(routing.route, op, x.dtype, x.numel() * x.element_size(), row)

    def _route(self, how, *args):
        """routing's answer `how(routes, caps, *args)`; a group of one has one
        route for every call (add_rms_norm.run takes it the unfused way, whose
        all_reduce is a copy)."""
        if self.world_size == 1:
            return SINGLE_RANK
        got = how(self._routes, self._caps, *args)
        return self._fallback if got == "nccl" else got

    def _run(self, op, x, dim, kernel_only, *args, entry=None):
        """op on the memoised route of a call like x (`entry`, where looked up
        already), counted in stats(), with run's arguments `args`; None
        instead where kernel_only and the route is not one of tpcomm's kernels."""
        cell, run, kernel = entry or self._entry(op, x, dim)
        if kernel_only and not kernel:
            return None
        y = _autograd.without_backward(run, op, x, *args) if x.requires_grad and _autograd.needs_grad(x) \
            else run(x, *args)
        cell[0] += 1  # counted once it ran (the fallback's agreement check may stop it)
        cell[1] += x.numel() * x.element_size()
        return y

    def _entry(self, op, x, dim=0):
        """The memo's (stats cell, run, kernel) for a call of op like x: one
        lookup; routing is walked (_remember) only on a miss."""
        nbytes = x.numel() * x.element_size()
        key = ((x.shape, dim, x.element_size()) if op == "all_gather" else (x.dtype, nbytes, dim)
               if op == "reduce_scatter" else (x.dtype, nbytes))
        return self._memo[op].get(key) or self._remember(op, key, x, nbytes, dim)

    def _remember(self, op, key, x, nbytes, dim=0):
        """Routes a call like x and memoises it (a few thousand shapes at
        most: a serving engine sees a handful per batch size) as (stats cell,
        run, whether the route is tpcomm's kernel). AITER, where it is open,
        routing offers it the call and it takes it, is tried first; what it
        declines runs on the route and is counted there."""
        memo = self._memo[op]
        if len(memo) >= _ROUTE_MEMO_MAX:
            memo.clear()
        backend = self._route_of(op, x, dim)
        cell, run = self._cell(op, backend), self._runner(op, x.dtype, backend)
        run = _agreement.checked(self._agreement, op, run, dim) if backend == self._fallback else run
        if (self._aiter is not None
                and routing.aiter_first(op, self.world_size, self.max_bytes, x.numel() * x.element_size(), dim)
                and self._aiter.takes(op, x)):
            aiter_cell = self._cell(op, "aiter")
            cell, run = aiter_cell, aiter.or_else(getattr(self._aiter, op), run, aiter_cell, cell, nbytes)
        entry = memo[key] = (cell, run, backend in _KERNEL_ROUTES)
        return entry

    def _runner(self, op, dtype, backend):
        """The callable that runs `op` on `backend`, with the op's arguments:
        all_reduce(x, out), all_gather(x, dim), reduce_scatter(parts)."""
        if backend == self._fallback:
            return getattr(self._nccl, op)
        if backend == SINGLE_RANK:
            return getattr(_one_rank, op)
        if op == "all_reduce":
            return self._kernels.all_reduce_runner(dtype, backend)
        return functools.partial(getattr(self._kernels, op), algo=backend)

    def _count(self, op, backend, x):
        """One call of op on backend, of x's bytes, into stats() (once it ran:
        the fallback's agreement check may stop it)."""
        cell = self._cell(op, backend)
        cell[0] += 1
        cell[1] += x.numel() * x.element_size()

    def _cell(self, op, backend):
        return self._stat_cells.setdefault((op, backend), [0, 0])
