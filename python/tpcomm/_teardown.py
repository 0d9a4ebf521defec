"""What tpcomm does so that dist.destroy_process_group() really ends a
gloo group before interpreter exit (docs/design.md, Teardown).

A gloo process group runs worker threads that release each finished
collective's work, and with it the work's tensors, after the caller's wait
has returned. A release that comes after the interpreter started finalising
needs the GIL, which a finalising interpreter refuses by ending the thread
inside a C++ destructor: `terminate called without an active exception`.
Only the ProcessGroup's destructor joins those threads, and it runs when
the last reference to the group goes, which destroy_process_group() alone
does not ensure: a closed Communicator lets go of its group
(Communicator._mark_closed), and torch.distributed.nn.functional, which
torch._dynamo imports (torch.compile, functional collectives), evaluates
group.WORLD as default arguments when it is first imported. Imported after
init_process_group, those defaults keep the world group until the
interpreter is finalised; imported before any group exists, they hold None.
"""
import torch.distributed as dist


def bind_torch_defaults_before_any_group():
    """Imports torch.distributed.nn.functional now, while no process group
    exists (where one does, importing it would pin that group: it is left
    to be imported as it would be without tpcomm)."""
    if dist.is_available() and not dist.is_initialized():
        try:
            import torch.distributed.nn.functional  # noqa: F401 - for its default arguments' binding
        except ImportError:  # a torch without it has no defaults to bind
            pass
