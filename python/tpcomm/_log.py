"""tpcomm's logger ("tpcomm") and messages said once per process: a server
that creates a communicator per group (or per restart of a group) is told
why the custom path is off, or how calls are routed, once, not every time."""
import logging
import threading

logger = logging.getLogger("tpcomm")

_said = set()
_said_lock = threading.Lock()


def log_once(level, message):
    """Logs `message` at `level` the first time it is seen; returns whether it did."""
    with _said_lock:
        if message in _said:
            return False
        _said.add(message)
    logger.log(level, message)
    return True
