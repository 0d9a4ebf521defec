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


def _run_two_ranks(script, outs):
    """`script` as ranks 0 and 1 of a gloo group over tcp:// (so rank 0 serves
    the store), each given its rank, the port and its entry of `outs`; the
    processes, after they exit, and their output."""
    port = str(_free_port())
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), port, str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    return procs, [p.communicate(timeout=120)[0] for p in procs]


def test_store_host_leaving_at_once_misses_nobody(tmp_path):
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs, logs = _run_two_ranks(RANK, outs)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r]}"
    for r in range(2):
        assert json.loads(outs[r].read_text()) == [], f"rank {r}: {outs[r].read_text()}\n{logs[r]}"


SILENT_PEER = r"""
import json, sys, time
import torch.distributed as dist
from tpcomm import _group_setup

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
prefix = "tpcomm/test/silent-peer"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
store = dist.distributed_c10d._get_default_store()
if rank == 1:  # arrives, then never says it saw rank 0 arrive (it died there)
    store.set(f"{prefix}/1", b"1")
    while not store.check([out]):
        time.sleep(0.05)
else:
    _group_setup.SEEN_WAIT_S = 0.5
    start = time.monotonic()
    missing = _group_setup.meet_peers(dist.group.WORLD, rank, prefix, 30.0)
    took = time.monotonic() - start
    store.set(out, b"1")
    with open(out, "w") as f:
        json.dump([missing, took], f)
"""


def test_store_host_waits_for_a_silent_peer_a_bounded_time(tmp_path):
    """Rank 0 leaves after SEEN_WAIT_S when a peer that arrived never says
    it saw every arrival, and does not call it missing."""
    out = tmp_path / "rank0.json"
    procs, logs = _run_two_ranks(SILENT_PEER, [out, out])
    assert procs[0].returncode == 0, logs[0]
    missing, took = json.loads(out.read_text())
    assert missing == [], missing
    assert 0.5 <= took < 5.0, took
