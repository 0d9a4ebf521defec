"""Ranks that disagree on the fallback path (tpcomm._agreement): before a
call runs on torch.distributed the ranks compare op, dtype, shape and dim,
and on any difference every rank raises CollectiveMismatch naming the field
and the peer; nothing runs, the group stays usable. Without the check gloo
aborts one rank or, for an all_gather of parts of other dtypes, gives the
other wrong data with no error. Two gloo ranks, every entry point that can
reach the fallback: the Communicator's methods, the group-name torch ops,
install()'d torch.distributed calls and the fusion patterns' private op."""
import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import Config
from tpcomm.norm_patterns import Pattern
from multiproc import run_ranks

SQUARE = (16, 16)  # dim 0 and dim 1 split alike: only the dim tells the calls apart


def _weight(x):
    return torch.ones(x.shape[-1], dtype=x.dtype)


# entry -> op -> call(comm, x, dim); the ops each entry point offers
ENTRIES = {
    "method": {
        "all_reduce": lambda comm, x, dim: comm.all_reduce(x),
        "all_gather": lambda comm, x, dim: comm.all_gather(x, dim),
        "reduce_scatter": lambda comm, x, dim: comm.reduce_scatter(x, dim),
        "all_reduce_add_rms_norm": lambda comm, x, dim: comm.all_reduce_add_rms_norm(x, x.clone(), _weight(x)),
    },
    "torch_op": {
        "all_reduce": lambda comm, x, dim: torch.ops.tpcomm.custom_all_reduce(x, comm.group_name),
        "all_gather": lambda comm, x, dim: torch.ops.tpcomm.custom_all_gather(x, dim, comm.group_name),
        "reduce_scatter": lambda comm, x, dim: torch.ops.tpcomm.custom_reduce_scatter(x, dim, comm.group_name),
        "all_reduce_add_rms_norm": lambda comm, x, dim: torch.ops.tpcomm.custom_all_reduce_add_rms_norm(
            x, x.clone(), _weight(x), 1e-6, comm.group_name),
        "all_reduce_rms_norm_add": lambda comm, x, dim: torch.ops._tpcomm.all_reduce_norm(
            x, x.clone(), _weight(x), None, 1e-6, 0.0, 0.0, int(Pattern.NORM_ADD), comm.group_name),
    },
    "install": {  # dim 0 only, as torch's calls are
        "all_reduce": lambda comm, x, dim: dist.all_reduce(x, group=comm.group),
        "all_gather": lambda comm, x, dim: dist.all_gather_into_tensor(
            x.new_empty((comm.world_size * x.shape[0],) + x.shape[1:]), x, group=comm.group),
        "reduce_scatter": lambda comm, x, dim: dist.reduce_scatter_tensor(
            x.new_empty((x.shape[0] // comm.world_size,) + x.shape[1:]), x, group=comm.group),
    },
}
# op -> an op of the same entry point a peer calls instead (the "op" disagreement)
OTHER = {"all_reduce": "all_gather", "all_gather": "all_reduce", "reduce_scatter": "all_reduce",
         "all_reduce_add_rms_norm": "all_reduce", "all_reduce_rms_norm_add": "all_reduce_add_rms_norm"}


def _disagreements(op, dims):
    """(field, per-rank (op, dtype, shape, dim)) that differ in that field
    only; `dims`: whether the entry point takes a dim."""
    cases = [("dtype", lambda r: (op, torch.float32 if r == 0 else torch.bfloat16, SQUARE, 0)),
             ("shape", lambda r: (op, torch.float32, SQUARE if r == 0 else (8, 16), 0)),
             ("op", lambda r: (op if r == 0 else OTHER[op], torch.float32, SQUARE, 0))]
    if dims and op in ("all_gather", "reduce_scatter"):
        cases.append(("dim", lambda r: (op, torch.float32, SQUARE, r)))
    return cases


def _body_disagreeing_ranks_raise(rank, world_size, entry):
    group = dist.new_group(list(range(world_size)))
    comm = tpcomm.Communicator(group, device="cpu")
    calls = ENTRIES[entry]
    with tpcomm.install(group) if entry == "install" else _nothing():
        for op in calls:
            for field, make in _disagreements(op, dims=entry != "install"):
                name, dtype, shape, dim = make(rank)
                x = torch.full(shape, float(rank + 1), dtype=dtype)
                with pytest.raises(tpcomm.CollectiveMismatch) as info:
                    calls[name](comm, x, dim)
                message = str(info.value)
                assert f"{field} differs" in message and f"peers that differ from it: [{1 - rank}]" in message, \
                    (entry, op, field, message)
            # a stopped call is not counted (nothing ran); the group is as it was: an agreeing call
            # gives the exact sum
            if entry == "method":
                assert comm.stats() == {}, (op, comm.stats())
            y = comm.all_reduce(torch.full(SQUARE, float(rank + 1)))
            assert torch.equal(y, torch.full(SQUARE, 3.0)), (entry, op, y)
            comm._stat_cells.clear()
    comm.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_disagreeing_ranks_raise_collective_mismatch_on_every_rank(entry):
    run_ranks(2, _body_disagreeing_ranks_raise, entry, timeout=120)


def _body_all_gather_dtypes(rank, world_size):
    """The case gloo got wrong with no error: parts of another dtype."""
    comm = tpcomm.Communicator(device="cpu")
    x = torch.arange(4096, dtype=torch.float32 if rank == 0 else torch.int32) + 7
    with pytest.raises(tpcomm.CollectiveMismatch, match=r"dtype differs \(rank 0: torch.float32; rank 1: torch.int32\)"):
        comm.all_gather(x, 0)
    comm.close()


def test_all_gather_of_other_dtypes_raises_instead_of_wrong_data():
    run_ranks(2, _body_all_gather_dtypes)


def _body_switch(rank, world_size, expect_on):
    comm = tpcomm.Communicator(device="cpu")
    assert (comm._agreement is not None) is expect_on, comm.config
    assert torch.equal(comm.all_gather(torch.full((4,), float(rank)), 0), torch.tensor([0.0] * 4 + [1.0] * 4))
    comm.close()


@pytest.mark.parametrize("env, expect_on", [({}, True), ({"TPCOMM_FALLBACK_CHECK": "0"}, False),
                                            ({"TPCOMM_FALLBACK_CHECK": "1"}, True)])
def test_on_by_default_on_gloo_and_switched_by_the_variable(env, expect_on):
    run_ranks(2, _body_switch, expect_on, env=env)


def _body_ranks_disagree_on_the_check(rank, world_size):
    with pytest.raises(ValueError, match="fallback_check"):
        tpcomm.Communicator(device="cpu", config=Config(fallback_check=rank == 0))


def test_ranks_with_and_without_the_check_raise_at_creation():
    """A rank that exchanges headers and one that does not would pair a
    header with a collective: the ranks compare the setting at creation."""
    run_ranks(2, _body_ranks_disagree_on_the_check)


def test_config_field_and_variable(monkeypatch):
    assert Config().fallback_check is None and Config().describe()["fallback_check"] == "None"
    assert Config(fallback_check=False).checked().describe()["fallback_check"] == "False"
    with pytest.raises(ValueError, match="fallback_check='yes' must be None, True or False"):
        Config(fallback_check="yes").checked()
    monkeypatch.setenv("TPCOMM_FALLBACK_CHECK", "off")
    assert Config.from_env().fallback_check is False
    monkeypatch.setenv("TPCOMM_FALLBACK_CHECK", "sometimes")
    with pytest.raises(ValueError, match="TPCOMM_FALLBACK_CHECK='sometimes'"):
        Config.from_env()


def test_headers_tell_long_shapes_apart_and_name_the_field():
    """Shapes past the header's dims differ in their checksum; the message
    names the field, every rank's value and this rank's differing peers."""
    from tpcomm import _agreement

    long = [2] * (_agreement.SHAPE_DIMS + 2)
    a = _agreement.header("all_gather", torch.empty(long), 0).tolist()
    b = _agreement.header("all_gather", torch.empty(long[:-1] + [3]), 0).tolist()
    assert [i for i in range(len(a)) if a[i] != b[i]] == [5]  # the checksum of the dims past the header's
    message = _agreement.mismatch_message([a, a, b], 0, "gloo")
    assert "shape differs" in message and "peers that differ from it: [2]" in message, message
    c = _agreement.header("reduce_scatter", torch.empty(4, 4, dtype=torch.float8_e5m2), 1).tolist()
    message = _agreement.mismatch_message([a, c], 1, "gloo")
    assert "op differs (rank 0: all_gather; rank 1: reduce_scatter)" in message, message
    assert "torch.float8_e5m2 (4, 4), dim 1" in message, message


def _body_unnamed_backend(rank, world_size):
    """A group made with a backend per device type ("cpu:gloo"): get_backend
    names none ("undefined" for init_process_group() with no backend), the
    fallback is still named by the backend that runs the device's tensors."""
    group = dist.new_group(list(range(world_size)), backend="cpu:gloo")
    assert str(dist.get_backend(group)) != "gloo"
    comm = tpcomm.Communicator(group, device="cpu")
    x = torch.ones(4)
    assert comm.route_all_reduce(x) == "gloo" and "gloo only" in repr(comm)
    assert comm._agreement is not None  # on by default: the fallback is gloo
    comm.all_reduce(x)
    assert list(comm.stats()) == [("all_reduce", "gloo")], comm.stats()
    comm.close()


def test_the_fallback_is_named_by_its_backend_when_the_group_names_several():
    run_ranks(2, _body_unnamed_backend)
