"""tpcomm._registry, the one registry of open Communicators: by group name
(what torch.ops.tpcomm.* take) and by id (what the internal ops' fake
implementations read), the newest of a group winning, closing removing both."""
import types

import pytest

import tpcomm
from tpcomm import _registry, _testing


def _comm(name, comm_id, world_size=2):
    return types.SimpleNamespace(group_name=name, comm_id=comm_id, world_size=world_size)


def test_lookups_by_name_and_by_id():
    old, new, off = _comm("g", 0x7E00_0001), _comm("g", 0x7E00_0002, 4), _comm("h", 0)
    for comm in (old, new, off):
        _registry.register(comm)
    try:
        assert _registry.find("g") is new and _registry.communicator_for("g") is new  # the newest of the group
        assert _registry.by_id(old.comm_id) is old and _registry.by_id(new.comm_id).world_size == 4
        assert _registry.find("h") is off  # a communicator whose custom path is off: found by name only
        with pytest.raises(ValueError, match="comm_id 0 is not an open communicator"):
            _registry.by_id(0)
        _registry.unregister(old)  # an older one of the group closing leaves the newer in place
        assert _registry.find("g") is new
        with pytest.raises(ValueError, match="not an open communicator"):
            _registry.by_id(old.comm_id)
    finally:
        for comm in (old, new, off):
            _registry.unregister(comm)
    assert _registry.find("g") is None and _registry.find("h") is None
    with pytest.raises(tpcomm.CommunicatorClosed, match=r"group 'g' is closed \(open groups: \[.*\]\)"):
        _registry.communicator_for("g")  # its Communicators were closed
    with pytest.raises(tpcomm.UnknownGroup, match=r"no open Communicator for group 'never' in this process "
                                                  r"\(open groups: \[.*\]\)"):
        _registry.communicator_for("never")
    with pytest.raises(ValueError):
        _registry.by_id(new.comm_id)


def test_stand_in_is_registered_for_the_context_only():
    with _testing.stand_in(3) as comm:
        assert _registry.by_id(comm.comm_id) is comm and _registry.find(comm.group_name) is comm
        assert comm.world_size == 3
    assert _registry.find(comm.group_name) is None
