"""AMD AITER's custom all-reduce (`amd-aiter` on PyPI) as a tpcomm backend,
for ROCm: AITER's CustomAllreduce on a gloo group of the same ranks.

The dispatcher (tpcomm.Communicator) tries it first for all_reduce, and for
all_gather along dim 0, on ROCm where `aiter` imports and TPCOMM_AITER (or
Config.aiter) is not off; what AITER declines (should_custom_ar) goes on to
tpcomm's kernels and then RCCL. Its capture() is entered inside the
Communicator's. On CUDA, or where `aiter` does not import, available() says
why and nothing is created.

Everything this adapter calls on AITER is listed in CONTRACT, and
tests/test_aiter_contract.py checks that list against the pinned wheel's
source (parsed, not imported: `import aiter` builds HIP code and works only on
a ROCm machine), so an AITER API change fails CI instead of a server.
"""
import contextlib
import logging

import torch
import torch.distributed as dist

from .._log import log_once

AITER_MODULE = "aiter.dist.device_communicators.custom_all_reduce"
PINNED_WHEEL = "amd-aiter==0.1.7.post2.dev18"
# class -> method -> the parameters this adapter passes, by name, in order.
CONTRACT = {
    "CustomAllreduce": {
        "__init__": ("group", "device", "max_size"),
        "should_custom_ar": ("inp",),
        "custom_all_reduce": ("input", "open_fp8_quant"),
        "custom_all_gather": ("inp",),
        "capture": (),
        "close": (),
    },
}


def available():
    """(True, None), or (False, why AITER cannot be used here)."""
    if getattr(torch.version, "hip", None) is None:
        return False, "AITER is for ROCm; this torch is built for CUDA"
    try:
        import importlib

        importlib.import_module(AITER_MODULE)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason, not a crash
        return False, f"aiter does not import: {type(e).__name__}: {e}"
    return True, None


class AiterAllReduce:
    """all_reduce (and a flat all_gather) through AITER for the ranks of
    `group`. Collective: every rank of the group constructs it."""

    name = "aiter"

    def __init__(self, group, device, max_size):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"tpcomm: {why}")
        import importlib

        module = importlib.import_module(AITER_MODULE)
        ranks = dist.get_process_group_ranks(group)
        # AITER exchanges its IPC handles over a CPU group; only the members create it
        self.cpu_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.impl = module.CustomAllreduce(group=self.cpu_group, device=device, max_size=max_size)
        self.world_size = len(ranks)

    def can_take(self, x):
        return bool(self.impl.should_custom_ar(x))

    def takes(self, op, x):
        """Whether AITER takes this call (tpcomm.routing.aiter_first says
        which calls are offered to it): all_gather offers the input made
        contiguous, AITER's flat layout."""
        return self.can_take(x if op == "all_reduce" else x.contiguous())

    def all_reduce(self, x, out=None):
        """The sum (written into `out` when given), or None when AITER
        declines (the caller falls back)."""
        y = self.impl.custom_all_reduce(input=x, open_fp8_quant=False)
        return y if y is None or out is None else out.copy_(y)

    def all_gather(self, x, dim=0):
        """Every rank's x concatenated along dim 0 (the only dim the
        dispatcher sends here), or None when AITER declines."""
        flat = self.impl.custom_all_gather(inp=x.contiguous())
        return None if flat is None else flat.view((self.world_size * x.shape[0],) + tuple(x.shape[1:]))

    @contextlib.contextmanager
    def capture(self):
        """Entered inside tpcomm's capture(): AITER registers the graph's
        buffers when it exits."""
        with self.impl.capture():
            yield

    def close(self):
        self.impl.close()


def or_else(attempt, fallback, cell, fallback_cell, nbytes):
    """run(*args): attempt(*args) (AITER), or, where it declines, fallback(*args),
    with the call counted in fallback_cell instead of cell ([calls, bytes]
    of Communicator.stats), so the stats name the backend that ran."""
    def run(*args):
        y = attempt(*args)
        if y is not None:
            return y
        cell[0] -= 1
        cell[1] -= nbytes
        fallback_cell[0] += 1
        fallback_cell[1] += nbytes
        return fallback(*args)

    return run


def open_for(group, device, max_bytes, config, agreed_error):
    """(AiterAllReduce, None) where AITER can run on every rank of the group,
    else (None, why not). agreed_error(error) is the group's verdict from every
    rank's error (collective): a verdict exchange comes first, so no rank
    waits in a set-up the others skip."""
    # The switches are in the configuration every rank compared at init, and
    # every rank runs the same torch build: no exchange is needed to agree
    # that AITER is off for those reasons.
    if config.disable:
        reason = "off (TPCOMM_DISABLE)"
    elif not config.aiter:
        reason = "off (TPCOMM_AITER=0 or Config.aiter=False)"
    elif getattr(torch.version, "hip", None) is None:
        reason = available()[1]
    else:
        reason = agreed_error(available()[1])
    if reason is None:
        made, error = None, None
        try:
            made = AiterAllReduce(group, device, max_bytes)  # collective
        except Exception as e:  # noqa: BLE001 - a reason, never a crash
            error = f"AITER's CustomAllreduce failed: {type(e).__name__}: {e}"
        reason = agreed_error(error)
        if reason is None:
            log_once(logging.INFO, "tpcomm: AMD AITER's custom all-reduce is tried first for all_reduce and "
                                   "all_gather along dim 0 (what it declines: tpcomm's kernels, then RCCL)")
            return made, None
        if made is not None:
            made.close()
    log_once(logging.INFO, f"tpcomm: AITER backend not used: {reason}")
    return None, reason
