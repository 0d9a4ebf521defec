"""tpcomm: fast intra-node collectives (all-reduce, all-gather, reduce-scatter,
and all-reduce fused with the residual add and RMSNorm) for tensor-parallel
LLM inference.

    comm = tpcomm.Communicator(group)        # collective, once per TP group
    y = comm.all_reduce(x)                    # custom kernel, or NCCL fallback
    z = comm.all_gather(x, dim=-1)
    with comm.capture(): ... CUDA graph capture ...
    comm.close()                              # collective, bounded; comm.abort(): not collective

Inside a model's forward, under CUDA graphs and torch.compile, the torch ops
taking the group's name route each call exactly as the Communicator does
(tpcomm.ops):

    y = torch.ops.tpcomm.custom_all_reduce(x, comm.group_name)
    z = torch.ops.tpcomm.custom_all_gather(x, dim, comm.group_name)
    w = torch.ops.tpcomm.custom_reduce_scatter(x, dim, comm.group_name)
    normed, summed = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(x, residual, weight, eps, comm.group_name)

Errors: tpcomm.TpcommError and its subclasses CollectiveTimeout,
CollectiveMismatch, CommunicatorClosed and UnknownGroup (tpcomm.errors), all
RuntimeErrors; tpcomm.TableError (a ValueError) for a bad routing table.
"""
import logging as _logging

from ._teardown import bind_torch_defaults_before_any_group as _bind_torch_defaults
from ._lib import load
from ._log import log_once as _log_once
from .communicator import Communicator
from .config import Config
from .errors import CollectiveMismatch, CollectiveTimeout, CommunicatorClosed, TpcommError, UnknownGroup
from . import fusion, ops, routing_table
from .backward_hooks import skip_backward_hooks_without_grad
from .compile_pass import compile_backend
from .routing_table import TableError
from .torch_collectives import install

# The ops exist as soon as tpcomm is imported (a model can name
# torch.ops.tpcomm.* before any Communicator: tpcomm.ops defines them in
# Python; load() registers the internal ones). A missing or broken build is
# not an import error: it is logged here, and every Communicator reports it
# as its disabled_reason and falls back to torch.distributed.
try:
    load()
except ImportError as _e:
    _log_once(_logging.WARNING, f"tpcomm: {_e}; every Communicator falls back to torch.distributed")

_bind_torch_defaults()  # before the user's init_process_group, where tpcomm is imported first (tpcomm._teardown)

__all__ = ["Communicator", "Config", "TpcommError", "CollectiveTimeout", "CollectiveMismatch", "CommunicatorClosed",
           "UnknownGroup", "TableError", "compile_backend", "fusion", "install", "load", "routing_table",
           "skip_backward_hooks_without_grad"]
from ._version import __version__  # noqa: E402 - one source (setup.py reads it too)


def __getattr__(name):
    """`tpcomm.inductor_pass` on first use: it imports torch._inductor, which
    takes seconds that `import tpcomm` should not pay."""
    if name == "inductor_pass":
        import importlib
        return importlib.import_module(".inductor_pass", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
