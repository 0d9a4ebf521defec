"""AMD AITER's all-reduce in the dispatcher, on 2 gloo ranks in a ROCm-shaped
environment (torch.version.hip set, a stand-in `aiter` module that keeps
AITER's API and sums over the gloo group): tried first for all_reduce and for
all_gather along dim 0, declined sizes go on to the table's route, capture()
enters AITER's, close() closes it; absent on CUDA and where `aiter` does not
import, off with TPCOMM_AITER=0 and Config(aiter=False), and off on every rank
when one rank lacks it. The adapter's calls are checked against the real
wheel in test_aiter_contract.py."""
import contextlib
import sys
import types

import torch
import torch.distributed as dist

import tpcomm
from bitexact import assert_bits_equal, exact_values, expected_sum
from multiproc import run_ranks
from tpcomm.backends import aiter as aiter_backend

DECLINE_OVER = 4096  # bytes: the stand-in declines larger inputs
DECLINE_AT_CALL = 48  # elements: should_custom_ar takes them, the call itself returns None


def _install_fake_aiter(events):
    class CustomAllreduce:  # AITER's names and parameters (CONTRACT)
        def __init__(self, group, device, max_size):
            self.group, self.max_size = group, max_size
            events.append(("init", dist.get_world_size(group), max_size))

        def should_custom_ar(self, inp):
            nbytes = inp.numel() * inp.element_size()
            return nbytes % 16 == 0 and nbytes <= DECLINE_OVER

        def custom_all_reduce(self, input, open_fp8_quant=False):
            events.append(("all_reduce", input.numel()))
            if input.numel() == DECLINE_AT_CALL:
                return None
            y = input.clone()
            dist.all_reduce(y, group=self.group)
            return y

        def custom_all_gather(self, inp):
            events.append(("all_gather", inp.numel()))
            if inp.numel() == DECLINE_AT_CALL:
                return None
            parts = [torch.empty_like(inp) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, inp, group=self.group)
            return torch.cat([p.reshape(-1) for p in parts])

        @contextlib.contextmanager
        def capture(self):
            events.append(("capture", "enter"))
            yield
            events.append(("capture", "exit"))

        def close(self):
            events.append(("close",))

    names = aiter_backend.AITER_MODULE.split(".")
    for i in range(1, len(names) + 1):
        sys.modules[".".join(names[:i])] = types.ModuleType(".".join(names[:i]))
    sys.modules[aiter_backend.AITER_MODULE].CustomAllreduce = CustomAllreduce


def _rocm_shaped(with_module=True):
    events = []
    torch.version.hip = "6.3.42131"
    if with_module:
        _install_fake_aiter(events)
    return events


def _body_present(rank, world_size):
    events = _rocm_shaped()
    comm = tpcomm.Communicator(device="cpu")
    assert comm.aiter_reason is None, comm.aiter_reason
    assert events[0] == ("init", world_size, comm.max_bytes)
    x = exact_values(rank, (16, 8), torch.float32, seed=3)  # 512 B: AITER takes it
    assert comm.route_all_reduce(x) == "gloo"  # the table's route (the fallback, gloo here); AITER is tried first
    assert_bits_equal(comm.all_reduce(x), expected_sum(world_size, (16, 8), torch.float32, seed=3), "aiter")
    big = exact_values(rank, (64, 64), torch.float32, seed=4)  # 16 KiB: declined
    assert_bits_equal(comm.all_reduce(big), expected_sum(world_size, (64, 64), torch.float32, seed=4), "declined")
    out = torch.empty_like(x)
    assert comm.all_reduce(x, out=out) is out
    g = comm.all_gather(x, dim=0)
    assert g.shape == (16 * world_size, 8)
    comm.all_gather(x, dim=1)  # another layout: not AITER's
    with comm.capture():
        pass
    stats = comm.stats()
    assert stats[("all_reduce", "aiter")]["calls"] == 2 and stats[("all_reduce", "gloo")]["calls"] == 1, stats
    assert stats[("all_gather", "aiter")]["calls"] == 1 and stats[("all_gather", "gloo")]["calls"] == 1, stats
    assert ("capture", "enter") in events and ("capture", "exit") in events
    comm.close()
    assert events[-1] == ("close",)


def _body_declined_at_the_call(rank, world_size):
    """A call AITER's should_custom_ar takes but its all-reduce (or
    all-gather) then declines runs on the table's route, with the right
    result, and stats() counts it there, not as AITER's."""
    events = _rocm_shaped()
    comm = tpcomm.Communicator(device="cpu")
    assert comm.aiter_reason is None, comm.aiter_reason
    x = exact_values(rank, (DECLINE_AT_CALL,), torch.float32, seed=5)
    for _ in range(2):  # the first call and the memoised route alike
        assert_bits_equal(comm.all_reduce(x), expected_sum(world_size, (DECLINE_AT_CALL,), torch.float32, seed=5),
                          "declined all_reduce")
        g = comm.all_gather(x)
        assert_bits_equal(g, torch.cat([exact_values(r, (DECLINE_AT_CALL,), torch.float32, seed=5)
                                        for r in range(world_size)]), "declined all_gather")
    assert events.count(("all_reduce", DECLINE_AT_CALL)) == 2 and events.count(("all_gather", DECLINE_AT_CALL)) == 2
    nbytes = DECLINE_AT_CALL * 4
    assert comm.stats() == {("all_reduce", "gloo"): {"calls": 2, "bytes": 2 * nbytes},
                            ("all_gather", "gloo"): {"calls": 2, "bytes": 2 * nbytes}}, comm.stats()
    comm.all_reduce(torch.ones(16))  # taken: counted as AITER's
    assert comm.stats()[("all_reduce", "aiter")] == {"calls": 1, "bytes": 64}
    comm.close()


def _body_switched_off(rank, world_size):
    events = _rocm_shaped()
    comm = tpcomm.Communicator(device="cpu", config=tpcomm.Config(aiter=False))
    assert "Config.aiter" in comm.aiter_reason and not events
    comm.all_reduce(torch.ones(4))
    assert set(comm.stats()) == {("all_reduce", "gloo")}
    comm.close()


def _body_env_off(rank, world_size):
    events = _rocm_shaped()
    comm = tpcomm.Communicator(device="cpu")
    assert "TPCOMM_AITER=0" in comm.aiter_reason and not events, comm.aiter_reason
    comm.close()


def _body_absent(rank, world_size):
    _rocm_shaped(with_module=rank != 1)  # rank 1 cannot import aiter
    comm = tpcomm.Communicator(device="cpu")
    assert comm.aiter_reason.startswith("rank 1: aiter does not import"), comm.aiter_reason
    comm.all_reduce(torch.ones(4))
    assert set(comm.stats()) == {("all_reduce", "gloo")}
    comm.close()


def _body_cuda_torch(rank, world_size):
    torch.version.hip = None
    comm = tpcomm.Communicator(device="cpu")
    assert "AITER is for ROCm" in comm.aiter_reason
    comm.close()


def test_aiter_is_tried_first_on_rocm():
    run_ranks(2, _body_present)


def test_a_call_aiter_declines_is_counted_where_it_ran():
    run_ranks(2, _body_declined_at_the_call)


def test_aiter_off_by_config():
    run_ranks(2, _body_switched_off)


def test_aiter_off_by_env():
    run_ranks(2, _body_env_off, env={"TPCOMM_AITER": "0"})


def test_aiter_absent_on_one_rank_is_off_everywhere():
    run_ranks(2, _body_absent)


def test_aiter_absent_on_cuda():
    run_ranks(2, _body_cuda_torch)
