"""Hooks for tpcomm's own tests, never for serving: not part of Config,
not compared between ranks, off unless a test turns them on in each rank.

allow_shared_gpu(True) lets the ranks of a group that share one GPU keep the
custom path, so the kernels' results can be checked on a one-GPU machine
(their speed cannot: the ranks' kernels time-slice, an op takes
milliseconds). The test harness calls it in every rank when TPCOMM_SHARE_GPU=1
is set; a rank that did not would turn the custom path off for the group.

stand_in(world_size) puts a made-up communicator in the registry, for tests
of the internal ops' fake implementations."""
import contextlib
import itertools
import types

from . import _registry

_shared_gpu = False


def allow_shared_gpu(allowed=True):
    """Ranks on one GPU keep the custom path (tests only), in this process."""
    global _shared_gpu
    _shared_gpu = bool(allowed)


def shared_gpu_allowed():
    return _shared_gpu


_stand_ins = itertools.count(1)


@contextlib.contextmanager
def stand_in(world_size):
    """A made-up open communicator of `world_size` ranks in tpcomm._registry,
    under a fresh id and group name, for as long as the context lasts: what
    the fake implementations find by id, in tests without a process group.
    Yields it (.comm_id, .group_name, .world_size)."""
    n = next(_stand_ins)
    comm = types.SimpleNamespace(comm_id=0x7F00_0000_0000 + n, group_name=f"tpcomm-stand-in-{n}",
                                 world_size=world_size)
    _registry.register(comm)
    try:
        yield comm
    finally:
        _registry.unregister(comm)
