"""The open Communicators of this process, by group name (what the
group-name ops torch.ops.tpcomm.* take) and by id (what the internal ops
torch.ops._tpcomm.* take, whose fake implementations need the world size).

A group's entry is the Communicator of that group created last; closing it
removes both entries (closing an older one of the same group leaves the newer
one in place)."""
_by_name = {}
_by_id = {}


def register(comm):
    _by_name[comm.group_name] = comm
    if comm.comm_id:
        _by_id[comm.comm_id] = comm


def unregister(comm):
    if _by_name.get(comm.group_name) is comm:
        del _by_name[comm.group_name]
    for comm_id in [comm_id for comm_id, c in _by_id.items() if c is comm]:
        del _by_id[comm_id]


def find(group_name):
    """The open Communicator of the group, or None."""
    return _by_name.get(group_name)


def names():
    """The names of the groups that have an open Communicator, sorted."""
    return tuple(sorted(_by_name))


def communicator_for(group_name):
    """The open Communicator of the group; RuntimeError naming the open ones when none."""
    comm = _by_name.get(group_name)
    if comm is None:
        raise RuntimeError(f"tpcomm: no open Communicator for group {group_name!r} in this process "
                           f"(open: {sorted(_by_name)})")
    return comm


def by_id(comm_id):
    """The open Communicator with that id; ValueError when none is open."""
    comm = _by_id.get(comm_id)
    if comm is None:
        raise ValueError(f"tpcomm: comm_id {comm_id} is not an open communicator")
    return comm
