"""vLLM's CustomAllreduce contract on the Communicator (should_custom_ar,
custom_all_reduce, custom_all_gather, custom_reduce_scatter: tpcomm's kernel
or None, never NCCL), the seed routing built on it, its host cost (one memo
lookup a call), a group of one rank, and the errors of the group-name ops.
CPU ranks over gloo (tests/multiproc.py): on CPU the kernels always decline,
so these tests prove the declines and the caller's fallback, and, with the
custom path faked open (kernels_open), the routing of what is taken;
tests/gpu/test_all_gather_gpu.py proves the kernel side."""
import logging
import struct

import pytest
import torch
import torch.distributed as dist

import tpcomm
from bitexact import assert_bits_equal
from multiproc import run_ranks
from tpcomm import routing

KiB = 1024
SEED_CAP = 64 * KiB  # vLLM's CudaCommunicator sends gathers up to this to custom_all_gather


class FakeKernels:
    """Kernels (tpcomm.backends.kernels' interface) whose every call returns
    a copy of its input, recording (op, kernel): what the taken calls run
    on CPU ranks."""

    def __init__(self):
        self.ran = []

    def all_reduce_runner(self, dtype, algo):
        return lambda x, out=None: self._ran("all_reduce", algo, x)

    def all_gather(self, x, dim, algo):
        return self._ran("all_gather", algo, x)

    def reduce_scatter(self, parts, algo):
        return self._ran("reduce_scatter", algo, parts)

    def _ran(self, op, algo, x):
        self.ran.append((op, algo))
        return x.clone()


def kernels_open(comm, world_size):
    """comm as if its custom path were open: the kernels' caps, FakeKernels,
    and its route memo emptied (what it holds was routed with the path off)."""
    comm._caps = routing.Caps(world_size, comm.max_bytes, comm.packet_max_bytes, comm.platform)
    comm._kernels = FakeKernels()
    for memo in comm._memo.values():
        memo.clear()


def seed_all_gather(comm, x, dim, cap=SEED_CAP):
    """vLLM's CudaCommunicator.all_gather, literally: tpcomm's kernel up to
    the cap, torch.distributed when it declines (None)."""
    if x.nbytes <= cap:
        y = comm.custom_all_gather(x, dim)
        if y is not None:
            return y
    parts = [torch.empty_like(x) for _ in range(comm.world_size)]
    dist.all_gather(parts, x.contiguous(), group=comm.group)
    return torch.cat(parts, dim)


def special_values(rank, shape, dtype):
    """Values each rank holds differently: NaNs with distinct payloads, ±inf,
    subnormals, ±0 and ordinary numbers, so a gather that moves the wrong
    bytes, canonicalises a NaN or drops a sign is caught bit for bit."""
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.float32:
        words = [0x7FC00001 + rank, 0xFFC00010 + rank, 0x7F800000, 0xFF800000, 0x00000001 + rank, 0x80000003,
                 0x00000000, 0x80000000]
        pattern = torch.tensor(words, dtype=torch.int64).to(torch.int32)
    else:  # bfloat16
        words = [0x7FC1 + rank, 0xFFC2, 0x7F80, 0xFF80, 0x0001 + rank, 0x8003, 0x0000, 0x8000]
        pattern = torch.tensor([w - 0x10000 if w >= 0x8000 else w for w in words], dtype=torch.int16)
    fill = torch.arange(n, dtype=torch.float32).mul_(0.25).add_(rank).to(dtype)
    flat = fill.view(pattern.dtype).clone()
    flat[: min(n, len(pattern))] = pattern[: min(n, len(pattern))]
    flat[-min(n, len(pattern)):] = pattern[: min(n, len(pattern))].flip(0)
    return flat.view(dtype).view(shape)


SEED_CASES = ([(torch.bfloat16, (m, 1024)) for m in (1, 2, 7, 16, 31, 48)] + [(torch.bfloat16, (1, 32768))]
              + [(torch.float32, s) for s in ((1, 16), (8, 16), (8, 2))] + [(torch.bfloat16, (48, 1024 + 8))])


def _body_contract(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    for dtype, shape in SEED_CASES:
        for dim in (0, 1, -1):
            x = special_values(rank, shape, dtype)
            assert comm.custom_all_gather(x, dim) is None  # CPU: the kernels always decline
            y = seed_all_gather(comm, x, dim)
            x.fill_(7)  # the result must not depend on the input after the call
            expected = torch.cat([special_values(r, shape, dtype) for r in range(world_size)], dim)
            assert_bits_equal(y, expected, f"seed all_gather {dtype} {shape} dim {dim}")
    x = torch.ones(8, 16)
    assert not comm.should_custom_ar(x) and comm.custom_all_reduce(x) is None
    assert comm.stats() == {}, comm.stats()  # the contract never ran the dispatcher's fallback
    with pytest.raises(IndexError):
        comm.custom_all_gather(x, 2)
    with pytest.raises(TypeError, match="dim"):
        comm.custom_all_gather(x, 1.5)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        comm.custom_all_reduce([1.0])
    assert comm.custom_reduce_scatter(torch.ones(3, 16), 0) is None  # no kernel takes it: None, not ValueError

    # With the kernels' caps in place (as on GPUs), the declines are the
    # dispatcher's routing: dtype, size, alignment, layout.
    kernels_open(comm, world_size)
    assert comm.should_custom_ar(torch.ones(8, 16))
    assert comm.route_all_reduce(torch.ones(8, 16)) in routing.KERNELS
    assert not comm.should_custom_ar(torch.ones(8, 16, dtype=torch.int64)), "dtype"
    assert not comm.should_custom_ar(torch.ones(3)), "12 bytes: not a multiple of 16"
    assert not comm.should_custom_ar(torch.ones(comm.max_bytes // 4 + 4)), "over max_bytes"
    assert not comm.should_custom_ar(torch.ones(16, 8).t()), "not contiguous"
    assert comm.custom_all_reduce(torch.ones(3)) is None
    assert comm.custom_reduce_scatter(torch.ones(4, 2, dtype=torch.int64), 1) is None, "dtype"
    assert comm.stats() == {} and comm._kernels.ran == []
    assert comm.custom_reduce_scatter(torch.ones(8, 16), 1) is not None
    with pytest.raises(ValueError, match="divisible"):  # a kernel would take it: the dim must divide
        comm.custom_reduce_scatter(torch.ones(3 * world_size + 1, 16), 0)
    assert comm.custom_all_gather(torch.ones(8, 16), -1) is not None
    assert comm._kernels.ran == [("reduce_scatter", "packet"), ("all_gather", "packet")], comm._kernels.ran
    comm._caps = None
    comm.close()
    assert not comm.should_custom_ar(x) and comm.custom_all_reduce(x) is None and comm.custom_all_gather(x) is None

    off = tpcomm.Communicator(device="cpu", config=tpcomm.Config(disable=True))
    assert not off.should_custom_ar(x) and off.custom_all_gather(x, 0) is None
    off.close()


def test_contract_declines_and_the_seed_routing_falls_back():
    run_ranks(2, _body_contract)


class CountingMemo(dict):
    """A route memo that counts its lookups in `lookups` (a shared list)."""

    def __init__(self, lookups):
        super().__init__()
        self.lookups = lookups

    def get(self, key, default=None):
        self.lookups.append(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.lookups.append(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.lookups.append(key)
        return super().__contains__(key)


def _body_one_lookup_a_call(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    walks, lookups = [], []
    real_route = routing.route
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(routing, "route", lambda *args: walks.append(args[2]) or real_route(*args))  # args[2]: the op
        memos = {op: CountingMemo(lookups) for op in routing.OPS}
        mp.setattr(comm, "_memo", memos)
        mp.setattr(comm, "_all_reduce_memo", memos["all_reduce"])
        x = torch.ones(8, 16)
        calls = {"all_reduce": lambda: comm.custom_all_reduce(x), "should_custom_ar": lambda: comm.should_custom_ar(x),
                 "all_gather": lambda: comm.custom_all_gather(x, 1),
                 "reduce_scatter": lambda: comm.custom_reduce_scatter(x, 0)}

        def cost(call):
            """(routing walks, memo lookups) of call(), and whether it was declined (None or False)."""
            del walks[:], lookups[:]
            got = call()
            return (len(walks), len(lookups)), got is None or got is False

        for path in ("declined", "taken"):  # CPU: every call declined; then the custom path faked open
            if path == "taken":
                kernels_open(comm, world_size)
            for name, call in calls.items():
                first, declined = cost(call)
                assert first[0] <= 1 and first[1] == 1, (path, name, first)  # the first call of a shape routes
                assert declined == (path == "declined"), (path, name)
                for _ in range(3):
                    again, declined = cost(call)
                    assert again == (0, 1), f"{path} {name}: {again[0]} routing walks, {again[1]} memo lookups"
                    assert declined == (path == "declined"), (path, name)
            # the dispatcher's all_reduce reads the same memo: no walk of its own
            assert cost(lambda: comm.all_reduce(x))[0] == (0, 1), path
            assert len(memos["all_reduce"]) == 1 and len(memos["all_gather"]) == 1, memos
    taken = [op for op, _ in comm._kernels.ran]
    assert taken.count("all_reduce") == 5 and taken.count("all_gather") == 4 and taken.count("reduce_scatter") == 4
    assert comm.stats()[("all_reduce", "gloo")]["calls"] == 1, comm.stats()  # the declined round's all_reduce
    comm._caps = None
    comm.close()


def test_the_contract_reads_the_route_memo_once_a_call():
    """Host cost of the kernel-or-None methods: after a shape's first call,
    a declined call and a taken one each do no routing walk and one lookup
    of the Communicator's route memo (the dispatcher's, so all_reduce shares
    it), and a decline is remembered like a route."""
    run_ranks(2, _body_one_lookup_a_call)


def test_special_values_hold_what_they_say():
    x = special_values(1, (1, 16), torch.float32)
    words = [struct.unpack("<I", struct.pack("<f", v))[0] for v in x.flatten().tolist()]
    assert torch.isnan(x).sum() == 4 and torch.isinf(x).sum() == 4
    assert x.view(torch.int32)[0, 0].item() == 0x7FC00002  # a payload survives view()
    assert 0x80000000 in words and 0x00000000 in words


# ------------------------------------------------------------ a group of one

def _check_single(comm):
    assert comm.world_size == 1 and not comm.enabled and comm.disabled_reason == "single rank"
    assert "single rank" in repr(comm) and comm.comm_id == 0
    x = torch.arange(24, dtype=torch.float32).view(4, 6)
    y = comm.all_reduce(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    out = torch.zeros_like(x)
    assert comm.all_reduce(x, out=out) is out and torch.equal(out, x)
    assert comm.all_reduce(x, out=x) is x
    t = x.t()
    for dim in (0, 1, -1):
        g = comm.all_gather(t, dim)
        assert torch.equal(g, t) and g.is_contiguous() and g.data_ptr() != t.data_ptr()
        s = comm.reduce_scatter(t, dim)
        assert torch.equal(s, t) and s.is_contiguous()
    w = torch.linspace(0.5, 1.5, 6)
    normed, z = comm.all_reduce_add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(z, x + x)
    assert torch.equal(normed, (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * w))
    assert torch.equal(torch.ops.tpcomm.custom_all_reduce(x, comm.group_name), x)
    assert torch.ops.tpcomm.custom_all_gather(x, 1, comm.group_name).shape == x.shape
    assert not comm.should_custom_ar(x) and comm.custom_all_reduce(x) is None
    _check_bad_arguments_raise(comm, x)  # though every answer here is a copy or None
    assert {b for _, b in comm.stats()} == {"single rank"}, comm.stats()


def _check_bad_arguments_raise(comm, x):
    """The Communicator's methods raise for a dim that is not an int (and a
    non-tensor input) on every path: declined, closed or a group of one."""
    for bad in (1.5, "0", None, True):
        for call in (comm.all_gather, comm.reduce_scatter, comm.custom_all_gather, comm.custom_reduce_scatter,
                     comm.route_all_gather):
            with pytest.raises(TypeError, match=r"dim must be an int"):
                call(x, bad)
    for call in (comm.custom_all_reduce, comm.should_custom_ar, comm.custom_all_gather):
        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            call([1.0])
    with pytest.raises(IndexError, match="out of range"):
        comm.custom_all_gather(x, 2)


def _body_world_of_one(rank, world_size, caplog_path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tpcomm").addHandler(handler)
    calls = []
    real = dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor
    dist.all_reduce = lambda *a, **k: calls.append("all_reduce")
    dist.all_gather = lambda *a, **k: calls.append("all_gather")
    dist.all_gather_into_tensor = lambda *a, **k: calls.append("all_gather_into_tensor")
    try:
        if world_size == 1:
            comm = tpcomm.Communicator(device="cpu")
            _check_single(comm)
        else:  # a new_group of one rank inside two: every rank makes both groups, each uses its own
            dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = real
            groups = [dist.new_group([r]) for r in range(world_size)]
            dist.all_reduce = lambda *a, **k: calls.append("all_reduce")
            dist.all_gather = lambda *a, **k: calls.append("all_gather")
            comm = tpcomm.Communicator(groups[rank], device="cpu")
            _check_single(comm)
        comm.close()
    finally:
        dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = real
    assert calls == [], calls
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]


@pytest.mark.parametrize("world_size", [1, 2])
def test_group_of_one_copies_with_no_collective_and_no_warning(world_size):
    run_ranks(world_size, _body_world_of_one, None)


# ------------------------------------------------------------ errors

def _body_group_name_errors(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x = torch.ones(4, 4)
    with pytest.raises(tpcomm.UnknownGroup, match=r"'nobody'.*open groups: \['0'\]") as info:
        torch.ops.tpcomm.custom_all_reduce(x, "nobody")
    assert isinstance(info.value, tpcomm.TpcommError)
    for bad in (1.5, "0", None):
        # the op's schema (SymInt dim) is checked by torch first: its error names dim (README's Errors)
        for op in (torch.ops.tpcomm.custom_all_gather, torch.ops.tpcomm.custom_reduce_scatter):
            with pytest.raises(RuntimeError, match="Expected a value of type 'int' for argument 'dim'"):
                op(x, bad, comm.group_name)
    _check_bad_arguments_raise(comm, x)  # the kernels decline every call here
    comm.close()
    _check_bad_arguments_raise(comm, x)
    for op in (lambda: torch.ops.tpcomm.custom_all_reduce(x, comm.group_name),
               lambda: torch.ops.tpcomm.custom_all_gather(x, 0, comm.group_name),
               lambda: torch.ops.tpcomm.custom_reduce_scatter(x, 0, comm.group_name),
               lambda: torch.ops.tpcomm.custom_all_reduce_add_rms_norm(x, x, torch.ones(4), 1e-6, comm.group_name)):
        with pytest.raises(tpcomm.CommunicatorClosed, match="closed"):
            op()
    again = tpcomm.Communicator(device="cpu")  # a new Communicator of the group opens its ops again
    assert torch.equal(torch.ops.tpcomm.custom_all_reduce(x, again.group_name), x * world_size)
    again.close()


def test_group_name_op_errors():
    run_ranks(2, _body_group_name_errors)


def test_table_error_is_exported(tmp_path):
    bad = tmp_path / "table.json"
    bad.write_text("{}")
    assert tpcomm.TableError is tpcomm.routing_table.TableError and issubclass(tpcomm.TableError, ValueError)
    with pytest.raises(tpcomm.TableError, match="no 'routes' object"):
        tpcomm.routing_table.load_table(str(bad))
