"""The open Communicators of this process, by group name (what the
group-name ops torch.ops.tpcomm.* take) and by id (what the internal ops
torch.ops._tpcomm.* take, whose fake implementations need the world size).

A group's entry is the Communicator of that group created last; closing it
removes both entries (closing an older one of the same group leaves the newer
one in place)."""
from .errors import CommunicatorClosed, UnknownGroup

_by_name = {}
_by_id = {}
_closed_names = set()  # groups whose last Communicator was closed: their ops raise CommunicatorClosed


def register(comm):
    _by_name[comm.group_name] = comm
    _closed_names.discard(comm.group_name)
    if comm.comm_id:
        _by_id[comm.comm_id] = comm


def unregister(comm):
    if _by_name.get(comm.group_name) is comm:
        del _by_name[comm.group_name]
        _closed_names.add(comm.group_name)
    for comm_id in [comm_id for comm_id, c in _by_id.items() if c is comm]:
        del _by_id[comm_id]


def find(group_name):
    """The open Communicator of the group, or None."""
    return _by_name.get(group_name)


def names():
    """The names of the groups that have an open Communicator, sorted."""
    return tuple(sorted(_by_name))


def communicator_for(group_name):
    """The open Communicator of the group; CommunicatorClosed when the group's
    last one was closed, UnknownGroup (naming the open ones) when it never had
    one. Both are TpcommErrors."""
    comm = _by_name.get(group_name)
    if comm is None:
        if group_name in _closed_names:
            raise CommunicatorClosed(f"tpcomm: the Communicator of group {group_name!r} is closed "
                                     f"(open groups: {sorted(_by_name)})")
        raise UnknownGroup(f"tpcomm: no open Communicator for group {group_name!r} in this process "
                           f"(open groups: {sorted(_by_name)})")
    return comm


def find_id(comm_id):
    """The open Communicator with that id (what the internal ops take), or None."""
    return _by_id.get(comm_id)


def by_id(comm_id):
    """The open Communicator with that id; ValueError when none is open."""
    comm = find_id(comm_id)
    if comm is None:
        raise ValueError(f"tpcomm: comm_id {comm_id} is not an open communicator")
    return comm
