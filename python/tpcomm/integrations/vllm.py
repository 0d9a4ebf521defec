"""tpcomm as a vLLM platform plugin.

vLLM builds every process group's device communicator from
`current_platform.get_device_communicator_cls()`, and an out-of-tree
platform comes from the `vllm.platform_plugins` entry point group. This
module's `register()` is that entry point (named `tpcomm`); it activates
only when `VLLM_PLUGINS` names `tpcomm` and vLLM finds a CUDA GPU:

    VLLM_PLUGINS=tpcomm vllm serve MODEL --tensor-parallel-size 2

The platform is vLLM's CUDA platform with one change: its device
communicator is TpcommCudaCommunicator, a subclass of vLLM's
CudaCommunicator. On tensor-parallel groups ("tp:N") it opens a
tpcomm.Communicator and offers it every all_reduce, all_gather and
reduce_scatter through its kernel-or-None methods (Communicator.custom_*:
one lookup of the Communicator's route memo a call); everything else stays
with vLLM's CudaCommunicator, whose backends are all still built: calls
tpcomm declines (dtypes, sizes, layouts, non-contiguous inputs, as vLLM's
own custom all-reduce declines them), the other ops, every other group, and
CUDA graph capture (tpcomm's kernels need no registration around a capture,
vLLM's own backends keep theirs).

tpcomm is not used at all on a group where vLLM would not run its own custom
all-reduce (non-TP groups, --disable-custom-all-reduce), under
VLLM_BATCH_INVARIANT (a row's sum would depend on whether its batch fits
tpcomm's buffers), on stateless groups (elastic EP: tpcomm needs a
torch.distributed group), or where the Communicator turns its custom path
off (TPCOMM_DISABLE=1, several nodes, no peer access: its disabled_reason is
logged and kept in `tpcomm_reason`).

vLLM is imported only when the classes are first used: importing this module
without vLLM works, and TpcommCudaPlatform / TpcommCudaCommunicator then
raise ImportError. Everything used from vLLM is listed in
tpcomm.integrations.vllm_contract, which the tests check against the pinned
release's sources.
"""
import importlib
import logging

from .._log import log_once

PLUGIN_NAME = "tpcomm"
PLATFORM_QUALNAME = __name__ + ".TpcommCudaPlatform"
COMMUNICATOR_QUALNAME = __name__ + ".TpcommCudaCommunicator"

logger = logging.getLogger(__name__)


def register():
    """The `vllm.platform_plugins` entry point: the platform's qualified name
    when VLLM_PLUGINS names this plugin and vLLM detects CUDA, else None (the
    plugin stays inactive and vLLM picks its platform as usual)."""
    allowed = _vllm("vllm.envs").VLLM_PLUGINS
    if allowed is None or PLUGIN_NAME not in allowed:
        return None
    if _vllm("vllm.platforms").cuda_platform_plugin() is None:
        logger.warning("tpcomm: VLLM_PLUGINS names tpcomm but vLLM finds no CUDA platform here: "
                       "the tpcomm platform stays inactive")
        return None
    return PLATFORM_QUALNAME


def _vllm(module):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"tpcomm.integrations.vllm needs vLLM ({module} does not import: {e}); "
                          "install vllm, or do not use this module") from e


def platform_class(base):
    """vLLM's CUDA platform `base` whose device communicator is tpcomm's."""
    class TpcommCudaPlatform(base):
        """vLLM's CUDA platform, with tpcomm's communicator on TP groups."""

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return COMMUNICATOR_QUALNAME

    TpcommCudaPlatform.__qualname__ = "TpcommCudaPlatform"
    return TpcommCudaPlatform


def _open_tpcomm(group, device):
    from .. import Communicator

    return Communicator(group, device=device)


def communicator_class(base, open_tpcomm=_open_tpcomm):
    """A subclass of vLLM's CudaCommunicator `base` that sends what tpcomm
    takes to a tpcomm Communicator made by open_tpcomm(cpu_group, device)."""
    class TpcommCudaCommunicator(base):
        """vLLM's CudaCommunicator; on TP groups all_reduce, all_gather and
        reduce_scatter go to tpcomm where its kernels take the call.
        `tpcomm`: the Communicator (None where not used), `tpcomm_reason`:
        why it is not used (None where it is)."""

        def __init__(self, cpu_group, device=None, device_group=None, unique_name="", global_ranks=None,
                     global_world_size=None, tcp_store_group=None, use_all2all=False):
            super().__init__(cpu_group=cpu_group, device=device, device_group=device_group,
                             unique_name=unique_name, global_ranks=global_ranks,
                             global_world_size=global_world_size, tcp_store_group=tcp_store_group,
                             use_all2all=use_all2all)
            self.tpcomm = None
            self.tpcomm_reason = self._why_not_tpcomm(unique_name, tcp_store_group)
            if self.tpcomm_reason is None:
                # Built on the gloo cpu_group: its set-up exchanges Python
                # objects, and every call it gets is one its kernels take, so
                # it never issues a collective of its own on the group.
                comm = open_tpcomm(self.cpu_group, self.device)
                if comm.enabled:
                    self.tpcomm = comm
                else:
                    self.tpcomm_reason = f"tpcomm's custom path is off: {comm.disabled_reason}"
                    comm.close()
            if self.tpcomm is not None:
                log_once(logging.INFO, f"tpcomm: vLLM group {unique_name}: all_reduce, all_gather and "
                                       "reduce_scatter go to tpcomm where its kernels take them, the rest to vLLM")
            else:
                log_once(logging.INFO, f"tpcomm: vLLM group {unique_name} stays on vLLM's communicator: "
                                       f"{self.tpcomm_reason}")

        def _why_not_tpcomm(self, unique_name, tcp_store_group):
            if unique_name.split(":")[0] != "tp":
                return f"{unique_name or 'an unnamed group'} is not a tensor-parallel group"
            if not getattr(self, "use_custom_allreduce", False):
                return "vLLM's custom all-reduce is off for this group (--disable-custom-all-reduce)"
            if _vllm("vllm.envs").VLLM_BATCH_INVARIANT:
                return ("VLLM_BATCH_INVARIANT: a sum must not depend on the batch size, and sizes past "
                        "tpcomm's buffers would go to another backend")
            if tcp_store_group is not None:
                return "a stateless group (tpcomm needs a torch.distributed process group)"
            if self.world_size < 2:
                return f"world size {self.world_size}"
            return None

        def all_reduce(self, input_):
            comm = self.tpcomm
            out = comm.custom_all_reduce(input_) if comm is not None else None
            return out if out is not None else super().all_reduce(input_)

        def all_gather(self, input_, dim=-1):
            comm = self.tpcomm
            if comm is not None and -input_.dim() <= dim < input_.dim():  # vLLM's own check raises for the rest
                out = comm.custom_all_gather(input_, dim)
                if out is not None:
                    return out
            return super().all_gather(input_, dim)

        def reduce_scatter(self, input_, dim=-1):
            # vLLM splits input_.movedim(0, dim) along its first dim: the
            # parts along `dim` (tpcomm's layout) only for dims 0 and 1, where
            # that move is a swap. Parts that do not divide are vLLM's to refuse.
            comm = self.tpcomm
            if comm is not None and -input_.dim() <= dim < input_.dim():
                dim %= input_.dim()
                if dim < 2 and input_.shape[dim] % self.world_size == 0:
                    out = comm.custom_reduce_scatter(input_, dim)
                    if out is not None:
                        return out
            return super().reduce_scatter(input_, dim)

        def destroy(self):
            """Closes the tpcomm Communicator (collective over the group,
            bounded by its timeout), then vLLM's backends, even if the close
            raised."""
            comm, self.tpcomm = self.tpcomm, None
            try:
                if comm is not None:
                    comm.close()
            finally:
                super().destroy()

    TpcommCudaCommunicator.__qualname__ = "TpcommCudaCommunicator"
    return TpcommCudaCommunicator


_LAZY = {
    "TpcommCudaPlatform": lambda: platform_class(_vllm("vllm.platforms.cuda").CudaPlatform),
    "TpcommCudaCommunicator": lambda: communicator_class(
        _vllm("vllm.distributed.device_communicators.cuda_communicator").CudaCommunicator),
}


def __getattr__(name):
    """The classes over vLLM's, built (and vLLM imported) on first use."""
    make = _LAZY.get(name)
    if make is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = globals()[name] = make()
    return cls

