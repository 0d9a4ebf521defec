"""The Communicator's life after construction: its device-side error record
(check), CUDA graph capture, and its end, collective (close) or on this rank
alone (abort). docs/design.md, Teardown, says what each lets go of."""
import contextlib
import ctypes

import torch

from . import _group_setup, _lib, _registry
from .errors import CollectiveTimeout, CommunicatorClosed


class Lifecycle:
    """The life-cycle methods of tpcomm.Communicator (its base): they use its
    `_comm`, `_lib`, `comm_id`, `_last_comm_id`, `_caps`, `_closed`, `group`,
    `rank`, `device`, `timeout_s`, `serial`, `_group_key`, `_memo`, `_aiter`,
    `_nccl` and `_agreement`."""

    def check(self) -> None:
        """Raises the recorded error if an op failed on the device: a peer that did not arrive within
        timeout_s (CollectiveTimeout), peers that called different ops (CollectiveMismatch), or, after
        close(), a CUDA graph captured on this communicator that was replayed (CommunicatorClosed).
        Reads host-mapped memory: no synchronisation."""
        if self._comm is not None:
            code = self._lib.tpc_comm_async_error(self._comm, ctypes.byref(_lib.AsyncError()))
            _lib.check(self._lib, self._comm, code, "device error")
        elif self._last_comm_id:  # closed: the record outlives the communicator
            record = _lib.AsyncError()
            code = self._lib.tpc_id_async_error(self._last_comm_id, ctypes.byref(record))
            if record.code != _lib.OK:
                _lib.check(self._lib, None, code, "device error")

    @contextlib.contextmanager
    def capture(self):
        """Context for CUDA graph capture of this communicator's ops.

        The kernels read only their input and buffers registered at init, and take their sequence number
        from a counter on the device, so captured ops need no registration afterwards and replay
        correctly in any order and interleaved with eager calls. A graph replayed after close() finds
        the communicator closed on the device, writes NaN into its outputs and nothing else, and check()
        reports it. The context only checks, on entry, that the communicator is open and no earlier op
        failed on the device (an error found inside a capture would abort it)."""
        self._check_open()
        self.check()
        with self._aiter.capture() if self._aiter is not None else contextlib.nullcontext():
            yield self  # AITER registers the graph's buffers when its context exits

    def close(self, timeout_s: "float | None" = None) -> None:
        """Frees the registered buffers and lets go of the group (so that dist.destroy_process_group()
        ends it). Collective: every rank calls it. Waits at most `timeout_s` (default: this
        communicator's timeout_s + 5 s) for the peers to arrive; if one does not (it died, or never
        calls close), the communicator is aborted instead (see abort()) and CollectiveTimeout names the
        missing ranks."""
        if (group := self._mark_closed()) is None or self._comm is None:
            return
        timeout_s = self.timeout_s + 5.0 if timeout_s is None else float(timeout_s)
        torch.cuda.synchronize(self.device)  # our own kernels end within timeout_s: every wait is bounded
        missing = _group_setup.meet_peers(group, self.rank, f"tpcomm/close/{self._group_key}/{self.serial}",
                                          timeout_s)
        if missing:
            self._release(self._lib.tpc_comm_abort, "abort")
            raise CollectiveTimeout(
                f"tpcomm: close: ranks {missing} did not arrive within {timeout_s:.1f} s; the communicator "
                "was aborted (its GPU memory is released when the process exits)")
        self._release(self._lib.tpc_comm_destroy, "destroy")

    def abort(self) -> None:
        """Stops this communicator now, on this rank only: never blocks, needs no peer. Ops queued on
        the GPU and graph replays exit (outputs NaN), peers' waits for this rank end at once with an
        error, and the id is retired. The registered GPU memory stays allocated until the process exits
        (a kernel may still run on it). Use it when a peer died; close() is the orderly, collective way."""
        if self._mark_closed() is not None and self._comm is not None:
            self._release(self._lib.tpc_comm_abort, "abort")

    def _mark_closed(self):
        """None when it already was; else closes it to callers, to the group-name ops and to AITER, and
        lets go of the process group (docs/design.md, Teardown), which it returns."""
        if self._closed:
            return None
        self._closed = True
        _registry.unregister(self)
        group, self.group, self._nccl, self._agreement = self.group, None, None, None
        for memo in self._memo.values():  # its runs are bound to the fallback, which holds the group
            memo.clear()
        aiter_backend, self._aiter = self._aiter, None
        if aiter_backend is not None:
            aiter_backend.close()
        return group

    def _release(self, fn, what):
        comm, self._comm, self.comm_id, self._caps = self._comm, None, 0, None
        _lib.check(self._lib, comm, fn(comm), what)

    def _check_open(self):
        if self._closed:
            raise CommunicatorClosed(f"tpcomm: the communicator (comm_id {self._last_comm_id}) is closed")
