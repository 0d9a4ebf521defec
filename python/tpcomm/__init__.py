"""tpcomm: fast intra-node collectives for tensor-parallel LLM inference.

    comm = tpcomm.Communicator(group)        # collective, once per TP group
    y = comm.all_reduce(x)                    # custom kernel, or NCCL fallback
    z = comm.all_gather(x, dim=-1)
    with comm.capture(): ... CUDA graph capture ...
    comm.close()                              # collective, bounded; comm.abort(): not collective

The torch ops behind them, usable inside a model's forward under CUDA graphs
and torch.compile: torch.ops.tpcomm.custom_all_reduce(x, comm.handle, algo),
custom_all_reduce_out(x, out, comm.handle, algo),
custom_all_gather(x, dim, comm.handle, algo). comm.handle is the
communicator's id (looked up on every call: a closed one raises).

Errors: tpcomm.TpcommError and its subclasses CollectiveTimeout,
CollectiveMismatch and CommunicatorClosed (tpcomm.errors), all RuntimeErrors.
"""
import logging as _logging

from ._lib import load
from ._log import log_once as _log_once
from .communicator import Communicator
from .config import Config
from .errors import CollectiveMismatch, CollectiveTimeout, CommunicatorClosed, TpcommError
from . import fusion, policy

# The ops exist as soon as tpcomm is imported (a model can name
# torch.ops.tpcomm.* before any Communicator). A missing or broken build is
# not an import error: it is logged here, and every Communicator reports it
# as its disabled_reason and falls back to torch.distributed.
try:
    load()
except ImportError as _e:
    _log_once(_logging.WARNING, f"tpcomm: {_e}; torch.ops.tpcomm is unavailable and every "
                                "Communicator falls back to torch.distributed")

__all__ = ["Communicator", "Config", "TpcommError", "CollectiveTimeout", "CollectiveMismatch", "CommunicatorClosed",
           "fusion", "load", "policy"]
from ._version import __version__  # noqa: E402 - one source (setup.py reads it too)
