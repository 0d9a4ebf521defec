"""Eager torch.distributed calls on tpcomm: with one group installed,

    comm = tpcomm.Communicator(group)
    with tpcomm.install(group):              # or: handle = tpcomm.install(group); ...; handle.uninstall()
        model(x)                             # its dist.all_reduce(t, group=group) runs comm.all_reduce

that group's dist.all_reduce, dist.all_gather_into_tensor and
dist.reduce_scatter_tensor (and the legacy _all_gather_base /
_reduce_scatter_base) go through the group's open Communicator, as Hugging
Face transformers' tensor parallelism issues them, and its functional
collectives (DTensor's redistribute: tpcomm.functional_collectives).
Leaving the `with` (or
uninstall()) restores torch's own path.

tpcomm takes a call only when it gives the same result: the sum (all_reduce,
reduce_scatter), async_op=False, one tensor on the Communicator's device,
contiguous, of the shapes the op needs; everything else (other reduce ops,
async_op=True, other groups, lists of tensors, a closed Communicator) runs
torch's own call unchanged. The Communicator itself routes what it takes:
its kernels, or torch.distributed where they do not apply (stats() says
which).

How: dist.all_reduce and the others stay the very functions they are (so
Dynamo still recognises them by identity and traces them as functional
collectives, which tpcomm.compile_backend then rewrites); what changes is
the ProcessGroup method they end in (ProcessGroup.allreduce,
_allgather_base, _reduce_scatter_base), replaced on the class by a wrapper
that hands calls on an installed group to tpcomm and every other call to
the original method. Functional collectives and everything else in
torch.distributed do not go through these Python methods. The wrapper is on
the class while at least one group is installed.
"""
import functools
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import _registry, functional_collectives

# The ProcessGroup methods dist's functions call, by what they do: torch
# 2.10-2.14 gather and scatter through _allgather_base / _reduce_scatter_base,
# torch 2.15 through all_gather_single / reduce_scatter_single (same
# arguments). Those the installed torch has are replaced.
_KINDS = {"allreduce": "all_reduce",
          "_allgather_base": "all_gather", "all_gather_single": "all_gather",
          "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}
_originals = {}   # method name -> the ProcessGroup method it replaces, while installed
_installed = {}   # group name -> its Installation
# Set while tpcomm runs a call it took or its fallback runs (torch_path): the
# collectives issued then must reach torch, not come back here.
_inside = threading.local()


class _Done(dist.Work):
    """The Work of a call tpcomm has run: complete when returned (tpcomm's
    ops are ordered on the current stream, as any later use of the result)."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return self._result


def _taker(group):
    """The open Communicator of `group` if it is installed and tpcomm is not
    already inside a call, else None."""
    if getattr(_inside, "active", False) or group.group_name not in _installed:
        return None
    return _registry.find(group.group_name)


def _single(args, kwargs, n, options):
    """The n tensors (then the options) of a call made as dist's functions
    make it, or None."""
    if kwargs or len(args) != n + 1 or not isinstance(args[-1], options):
        return None
    return args


def _plain(comm, *tensors):
    return all(type(t) is torch.Tensor and t.device == comm.device and t.is_contiguous() for t in tensors)


def _run(fn, *args):
    if getattr(_inside, "active", False):
        return fn(*args)
    _inside.active = True
    try:
        return fn(*args)
    finally:
        _inside.active = False


def torch_path(fn):
    """Decorates tpcomm's fallback to torch.distributed (backends/nccl.py):
    the collectives it issues reach torch's own methods even on an
    installed group, so a call tpcomm declined is not offered to it again.
    Traced by torch.compile it is fn itself (traced collectives are
    functional: they never reach ProcessGroup's methods)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return _run(lambda: fn(*args, **kwargs))
    return run


def _all_reduce(comm, args, kwargs):
    """Runs an in-place all_reduce of args on comm; its Work, or None when
    tpcomm declines the call."""
    found = _single(args, kwargs, 1, c10d.AllreduceOptions)
    if found:
        tensors, opts = found
        if type(tensors) is list and len(tensors) == 1 and _plain(comm, tensors[0]) \
                and opts.reduceOp == dist.ReduceOp.SUM and not opts.asyncOp:
            _run(comm.all_reduce, tensors[0], tensors[0])
            return _Done(tensors)
    return None


def _all_gather(comm, args, kwargs):
    found = _single(args, kwargs, 2, c10d.AllgatherOptions)
    if found:
        out, x, opts = found
        if _plain(comm, out, x) and not opts.asyncOp and out.dtype == x.dtype and x.dim() > 0 \
                and out.shape == (comm.world_size * x.shape[0],) + tuple(x.shape[1:]):
            out.copy_(_run(comm.all_gather, x, 0))
            return _Done([out])
    return None


def _reduce_scatter(comm, args, kwargs):
    found = _single(args, kwargs, 2, c10d.ReduceScatterOptions)
    if found:
        out, x, opts = found
        if _plain(comm, out, x) and opts.reduceOp == dist.ReduceOp.SUM and not opts.asyncOp \
                and out.dtype == x.dtype and x.dim() > 0 and x.shape[0] % comm.world_size == 0 \
                and out.shape == (x.shape[0] // comm.world_size,) + tuple(x.shape[1:]):
            out.copy_(_run(comm.reduce_scatter, x, 0))
            return _Done([out])
    return None


_RUNNERS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter}


def _wrapper(method):
    """ProcessGroup.<method> as installed: tpcomm's run of the call where the
    group is installed and tpcomm takes it, else torch's own method."""
    runner = _RUNNERS[_KINDS[method]]

    def call(self, *args, **kwargs):
        comm = _taker(self)
        done = runner(comm, args, kwargs) if comm else None
        return done if done is not None else _originals[method](self, *args, **kwargs)

    call.__name__ = method
    return call


class Installation:
    """One group's torch.distributed collectives on tpcomm (see the module's
    doc); a context manager. uninstall() (or leaving the `with`) restores
    torch's path for the group; once no group is installed, ProcessGroup's
    methods are torch's own again."""

    def __init__(self, group_name):
        self.group_name = group_name

    @property
    def installed(self):
        return _installed.get(self.group_name) is self

    def uninstall(self):
        if not self.installed:
            return
        del _installed[self.group_name]
        if not _installed:
            for name, method in _originals.items():
                setattr(dist.ProcessGroup, name, method)
            _originals.clear()
            functional_collectives.unhook()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()

    def __repr__(self):
        return f"tpcomm.Installation(group {self.group_name!r}, {'installed' if self.installed else 'uninstalled'})"


def replaced_methods():
    """The ProcessGroup methods an installation replaces in this torch."""
    return tuple(m for m in _KINDS if m in dist.ProcessGroup.__dict__)


def install(group=None) -> Installation:
    """Sends `group`'s (default: the world group's) dist.all_reduce,
    all_gather_into_tensor and reduce_scatter_tensor through the group's
    open tpcomm Communicator, which must exist. Returns the Installation
    (a context manager; .uninstall())."""
    if not dist.is_initialized():
        raise RuntimeError("tpcomm.install needs torch.distributed to be initialised")
    group = group if group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"tpcomm.install takes a torch.distributed ProcessGroup, got {type(group).__name__}")
    name = group.group_name
    if _registry.find(name) is None:
        raise RuntimeError(f"tpcomm.install: no open tpcomm.Communicator for group {name!r}; "
                           "create one (tpcomm.Communicator(group)) first")
    if name in _installed:
        raise RuntimeError(f"tpcomm.install: group {name!r} is already installed")
    if not _originals:
        for method in replaced_methods():
            _originals[method] = dist.ProcessGroup.__dict__[method]
            setattr(dist.ProcessGroup, method, _wrapper(method))
    _installed[name] = handle = Installation(name)
    # DTensor's and the functional collectives' eager calls (tpcomm.functional_collectives)
    functional_collectives.hook(lambda group_name: _taker_by_name(group_name), _run)
    return handle


def _taker_by_name(group_name):
    if getattr(_inside, "active", False) or group_name not in _installed:
        return None
    return _registry.find(group_name)
