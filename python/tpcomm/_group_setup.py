"""A Communicator's collective set-up: its device, the ranks' agreement on
whether the custom path can run, the opening of the C communicator (IPC
handles exchanged, every peer opened, a real P2P write checked), and the
bounded host barrier of close().

Every function that exchanges something is collective over the group, and
every rank leaves it with the same verdict: a rank that cannot use the custom
path turns it off for all, or its peers would wait for it in their kernels.
A verdict names the rank it comes from; a rank that has a reason of its own
names itself, the others the first rank that has one."""
import collections
import ctypes
import itertools
import time

import torch
import torch.distributed as dist

from . import _lib, _testing, routing_table, topology

# Communicators created so far on each group (keyed by group_key): every rank
# of a group must create them in the same order, whatever other groups (TP
# inside PP, DP replicas) it also belongs to; agree() compares the numbers.
serials = collections.defaultdict(itertools.count)


def group_key(group):
    """A name for `group` that every member computes alike."""
    name = getattr(group, "group_name", None)
    return name if name else tuple(dist.get_process_group_ranks(group))


def resolve_device(device):
    """The rank's device: `device`, the current CUDA device where CUDA is
    available and none is given, else the CPU (which always falls back)."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def table_source(table, device):
    """What a Communicator loads its routing table from: `table` (a path or
    a parsed dict) when given, else the shipped table of the device's GPU
    model (tpcomm.routing_table.table_for_device)."""
    if table is not None:
        return table
    return routing_table.table_for_device(torch.cuda.get_device_name(device) if device.type == "cuda" else None)


def open_group(group, rank, world_size, device, serial, config, routes, max_bytes, packet_max_bytes):
    """Collective: (the loaded C library or None, the C communicator or None,
    the group's verdict). The communicator is open on every rank, or the
    verdict (the same on every rank, see agree()) says why not."""
    reason, lib = local_reason(config, world_size, device)
    routing = {**routing_table.flatten(routes), **config.describe()}
    reason = agree(group, rank, world_size, device, serial, routing, reason)
    if reason is not None:
        return lib, None, reason
    comm, reason = open_custom(lib, group, rank, world_size, device, max_bytes, packet_max_bytes,
                               float(config.timeout_s))
    return lib, comm, reason


def gather(group, world_size, obj):
    """Every rank's `obj`, in rank order (collective)."""
    out = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def verdict(reasons, rank):
    """"rank r: why" from every rank's reason (or None): this rank's own when it
    has one, else the first rank's that has one; None when no rank has one."""
    if reasons[rank]:
        return f"rank {rank}: {reasons[rank]}"
    for r, reason in enumerate(reasons):
        if reason:
            return f"rank {r}: {reason}"
    return None


def agreed_error(group, rank, world_size, error):
    """Collective: every rank's error (or None) exchanged; the verdict."""
    return verdict(gather(group, world_size, error), rank)


def local_reason(config, world_size, device):
    """(why this rank cannot use the custom path or None, the loaded C library or None)."""
    if config.disable:
        return "disabled by TPCOMM_DISABLE (or Config.disable)", None
    if not 2 <= world_size <= _lib.MAX_RANKS:
        return f"world size {world_size} is outside 2..{_lib.MAX_RANKS}", None
    if device.type != "cuda":
        return f"device is {device.type}: the custom kernels need CUDA GPUs", None
    try:
        return None, _lib.load()
    except ImportError as e:
        return str(e), None


def raise_if_routing_differs(routings):
    """Every rank's effective routing (flattened) must be the same: raises
    ValueError on every rank alike, naming up to 8 differing keys."""
    keys = sorted(set().union(*routings))
    differ = [k for k in keys if len({r.get(k) for r in routings}) > 1]
    if differ:
        shown = "; ".join(f"{k}: " + ", ".join(f"rank {i}: {r.get(k, 'absent')}" for i, r in enumerate(routings))
                          for k in differ[:8])
        raise ValueError(f"tpcomm: the ranks would route differently (and deadlock): {len(differ)} keys differ: "
                         f"{shown}")


def agree(group, rank, world_size, device, serial, routing, reason):
    """Collective: the group's verdict on the custom path (None: it can run).
    Raises ValueError on every rank when their `routing` (flat strings)
    differs; ranks out of step, a communicator created in another order on
    some rank, another node, a GPU shared between ranks (unless every rank's
    tpcomm._testing allows it) or GPUs without NVLink turn it off."""
    facts = gather(group, world_size, {"rank": rank, "reason": reason, "serial": serial, "routing": routing,
                                       "shared_gpu_allowed": _testing.shared_gpu_allowed(),
                                       **topology.local_facts(device)})
    for i, f in enumerate(facts):
        if f["rank"] != i:
            return f"group rank {i} answered as rank {f['rank']}: groups out of step"
    raise_if_routing_differs([f["routing"] for f in facts])
    serials = [f["serial"] for f in facts]
    if len(set(serials)) != 1:
        return ("ranks created their communicators on this group in different orders "
                f"(creation numbers by rank: {serials})")
    found = verdict([f["reason"] for f in facts], rank)
    if found:
        return found
    n_nodes = topology.nodes(facts)
    if n_nodes > 1:
        return f"the group spans {n_nodes} nodes; the custom kernels are intra-node"
    uuids = [f["gpu_uuid"] for f in facts]
    shared_allowed = all(f["shared_gpu_allowed"] for f in facts)
    if None not in uuids and len(set(uuids)) < len(uuids) and not shared_allowed:
        return "two ranks share one GPU"
    distinct = sorted(set(uuids)) if None not in uuids else []
    if world_size > 2 and len(distinct) > 1:
        nvlink = topology.nvlink_between_all(distinct)
        if nvlink is False:
            return f"{world_size} GPUs without NVLink between every pair"
        if nvlink is None:
            return f"cannot tell whether {world_size} GPUs share NVLink (NVML unavailable)"
    return None


def open_custom(lib, group, rank, world_size, device, max_bytes, packet_max_bytes, timeout_s):
    """Collective: creates the C communicator, exchanges its IPC handles and
    opens every peer. Returns (the communicator as a ctypes pointer, None), or
    (None, the verdict) with nothing left allocated."""
    cfg = _lib.Config(rank, world_size, device.index, max_bytes, packet_max_bytes, int(timeout_s * 1e9))
    comm = ctypes.c_void_p()
    local_error = None
    handle = ctypes.create_string_buffer(_lib.IPC_HANDLE_BYTES)
    if lib.tpc_comm_create(ctypes.byref(cfg), ctypes.byref(comm)) != _lib.OK:
        local_error = "create: " + lib.tpc_comm_last_error(None).decode()
    elif lib.tpc_comm_export(comm, handle) != _lib.OK:
        local_error = "export: " + lib.tpc_comm_last_error(comm).decode()
    # Handles are gathered on this group, keyed by rank; agree() already
    # checked that the ranks agree on which communicator of the group this is.
    entries = gather(group, world_size, {"error": local_error, "handle": handle.raw if local_error is None else None})
    reason = verdict([e["error"] for e in entries], rank)
    if reason is None:
        reason = _open_peers(lib, comm, group, rank, world_size, [e["handle"] for e in entries])
    if reason is None:
        return comm, None
    if comm.value:
        lib.tpc_comm_destroy(comm)
    return None, reason


def _open_peers(lib, comm, group, rank, world_size, handles):
    """Opens every peer's handle, then checks P2P for real: every rank writes
    a token into every peer; after a host barrier (the exchange of errors)
    each checks that all tokens arrived. Collective; returns the verdict."""
    error = None
    for peer, peer_handle in enumerate(handles):
        if peer != rank and error is None and lib.tpc_comm_open_peer(comm, peer, peer_handle) != _lib.OK:
            error = lib.tpc_comm_last_error(comm).decode()
    if error is None and lib.tpc_comm_ready(comm) != _lib.OK:
        error = lib.tpc_comm_last_error(comm).decode()
    if error is None and lib.tpc_comm_probe_write(comm) != _lib.OK:
        error = "P2P probe: " + lib.tpc_comm_last_error(comm).decode()
    reason = agreed_error(group, rank, world_size, error)
    if reason is not None:
        return reason
    mask = ctypes.c_uint32()
    if lib.tpc_comm_probe_read(comm, ctypes.byref(mask)) != _lib.OK:
        error = "P2P probe: " + lib.tpc_comm_last_error(comm).decode()
    else:
        missing = [p for p in range(world_size) if p != rank and not mask.value >> p & 1]
        if missing:
            error = f"P2P probe: writes from ranks {missing} did not arrive"
    return agreed_error(group, rank, world_size, error)


SEEN_WAIT_S = 5.0  # meet_peers: how long global rank 0 waits for the peers to see every arrival


def meet_peers(group, rank, prefix, timeout_s):
    """Host-side barrier of close() through the default store, under keys
    that start with `prefix` (one per communicator), bounded: the group ranks
    that did not arrive within timeout_s (empty when all did). No peer may
    still write into our buffer once every rank has arrived here.

    The store's server lives in global rank 0 (init_process_group's tcp:// and
    env:// without torchrun's agent), which ends it on exit: a peer still
    polling then would find no store and call everyone missing. So each rank
    that saw every arrival says so, and global rank 0 leaves only once all
    have, or after SEEN_WAIT_S (a peer polls every 50 ms at most; one that
    died after arriving is not missing)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        store.set(f"{prefix}/{ranks[rank]}", b"1")
        deadline = time.monotonic() + timeout_s
        missing = _wait_for_keys(store, [f"{prefix}/{r}" for r in ranks], deadline)
        if missing:
            return missing
        store.set(f"{prefix}/seen/{ranks[rank]}", b"1")
    except Exception as e:  # noqa: BLE001 - a store whose host died: the peers are gone
        return [f"unknown ({type(e).__name__}: {e})"]
    if dist.get_rank() == 0:
        try:
            _wait_for_keys(store, [f"{prefix}/seen/{r}" for r in ranks], time.monotonic() + SEEN_WAIT_S)
        except Exception:  # noqa: BLE001 - every rank arrived: what follows cannot make one missing
            pass
    return []


def _wait_for_keys(store, keys, deadline):
    """Polls the store until every key exists or the deadline passes: the
    indices of the keys still missing."""
    pause = 1e-4
    while True:
        missing = [i for i, key in enumerate(keys) if not store.check([key])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
