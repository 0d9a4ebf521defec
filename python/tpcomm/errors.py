"""tpcomm's exceptions. Every one is a RuntimeError, so code that catches
RuntimeError around a collective keeps working.

    TpcommError            anything tpcomm's C core or kernels reported
    ├── CollectiveTimeout  a peer did not arrive within timeout_s (or a peer
    │                      gave up waiting for this rank)
    ├── CollectiveMismatch peers called different ops: the message names the
    │                      field that differs (op, size, algorithm)
    ├── CommunicatorClosed the communicator was closed or aborted, or a CUDA
    │                      graph captured on it was replayed after close()
    │                      (also: a group-name op on a group whose
    │                      Communicator was closed)
    └── UnknownGroup       a group-name op names a group with no open
                           Communicator in this process (the message lists
                           the open ones)

tpcomm.TableError (tpcomm.routing_table) is a ValueError: a routing table that
cannot be read or names what does not exist.
"""


class TpcommError(RuntimeError):
    """An error reported by tpcomm (the message says why); `code` is the C
    core's tpc_result, or None where the error was found in Python."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


class CollectiveTimeout(TpcommError):
    """A peer did not arrive within the communicator's timeout."""


class CollectiveMismatch(TpcommError):
    """Peers called different ops, sizes or algorithms at the same point."""


class CommunicatorClosed(TpcommError):
    """The communicator is closed or aborted (or a graph outlived it)."""


class UnknownGroup(TpcommError):
    """A group-name op (torch.ops.tpcomm.custom_*) names a group that has no
    open Communicator in this process."""
