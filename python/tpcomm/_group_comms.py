"""The open Communicator of a process group, by the group's name: the one
lookup the compile pass and the eager install use, so both follow the
package's registry of communicators (tpcomm._registry where the package has
it, else the table in tpcomm.ops)."""


def _table():
    try:
        from . import _registry
    except ImportError:
        from . import ops

        return ops._COMMUNICATORS
    return _registry._by_name


def find(group_name):
    """The open tpcomm Communicator of the group named `group_name` in this
    process, or None."""
    return _table().get(group_name)


def names():
    """The names of the groups that have an open Communicator, sorted."""
    return tuple(sorted(_table()))
