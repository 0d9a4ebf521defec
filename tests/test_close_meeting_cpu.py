"""close()'s host meeting (_group_setup.meet_peers) when the store's host
leaves at once: global rank 0 serves the default store (tcp:// init) and a
process that returns from close() may exit straight away, as a script's last
lines do. A peer still polling the store must not then find it gone and call
everyone missing (which aborts its communicator and raises)."""
import json
import os
import socket
import subprocess
import sys

RANK = r"""
import json, os, sys, time
import torch.distributed as dist
from tpcomm import _group_setup

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if rank == 0:
    time.sleep(0.5)  # the peer arrived first and now polls at its slowest
missing = _group_setup.meet_peers(dist.group.WORLD, rank, "tpcomm/test/leave-at-once", 30.0)
with open(out, "w") as f:
    json.dump(missing, f)
if rank == 0:
    os._exit(0)  # the store's server goes with the process, as at the end of a script
time.sleep(0.2)
os._exit(0)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_store_host_leaving_at_once_misses_nobody(tmp_path):
    port = str(_free_port())
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r]}"
    for r in range(2):
        assert json.loads(outs[r].read_text()) == [], f"rank {r}: {outs[r].read_text()}\n{logs[r]}"
