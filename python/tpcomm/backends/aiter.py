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

import torch
import torch.distributed as dist

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

    def can_take(self, x):
        return bool(self.impl.should_custom_ar(x))

    def all_reduce(self, x):
        """The sum, or None when AITER declines (the caller falls back)."""
        return self.impl.custom_all_reduce(input=x, open_fp8_quant=False)

    def all_gather(self, x):
        """Every rank's x concatenated flat, or None when AITER declines."""
        return self.impl.custom_all_gather(inp=x)

    @contextlib.contextmanager
    def capture(self):
        """Entered inside tpcomm's capture(): AITER registers the graph's
        buffers when it exits."""
        with self.impl.capture():
            yield

    def close(self):
        self.impl.close()
