"""The routing the doctor reports: the table in force for this machine and
world size, and the size bands each op really takes after the caps and the
kernels' own limits (routing.route asked at every size where a rule changes)."""
from .report import size_text


def routing_facts(report, world_size, config):
    report.section(f"routing (world size {world_size})")
    import torch

    from .. import _group_setup, routing, routing_table
    source = getattr(config, "table", None) if config is not None else None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    path = _group_setup.table_source(source, torch.device("cuda", 0) if gpu else torch.device("cpu"))
    try:
        table = routing_table.load_table(path)
    except Exception as e:  # noqa: BLE001 - a bad table is a finding
        report.problem("table", str(e))
        return
    report.line("table", source or f"{path} (shipped, for {routing_table.gpu_model(gpu) if gpu else 'no GPU'})")
    about = table.get("about", "")
    if about:
        report.line("measured on", about.split(":", 1)[1].split(",", 2)[0].strip() if ":" in about else about[:120])
    force = dict(getattr(config, "force", ()) or ())
    forbid = getattr(config, "forbid", ()) or ()
    routes = routing_table.effective_routes(table, world_size, force, forbid)
    from ..communicator import Communicator
    from ..config import Config

    defaults = Config()
    caps = routing.Caps(world_size, getattr(config, "max_bytes", defaults.max_bytes),
                        getattr(config, "packet_max_bytes", defaults.packet_max_bytes), Communicator.platform)
    report.line("caps", f"max_bytes {size_text(caps.max_bytes)}, packet_max_bytes {size_text(caps.packet_max_bytes)} "
                        "(TPCOMM_MAX_BYTES, TPCOMM_PACKET_MAX_BYTES)")
    largest, source = routes["all_reduce"]["fused_norm"][0]
    origin = "cost-model default, not measured" if source == routing.FUSED_NORM_MODELLED else "from the table"
    report.line("fused norm", f"fused kernel family up to {size_text(min(largest, caps.packet_max_bytes))} per rank, "
                              f"larger: split or unfused ({origin})")
    for op, by_dtype in routes.items():
        row = "own row" if str(world_size) in table["routes"][op] else "'*' row"
        try:
            routed = routed_bands(routes, caps, op)
        except ImportError as e:  # the kernels' limits come from the extension
            report.problem(f"{op} ({row})", f"no routed sizes without the extension: {e}")
            continue
        bands = ", ".join(f"<= {size_text(limit)} {backend}" for limit, backend in routed)
        report.line(f"{op} ({row})", f"{bands}, larger: nccl" if bands else "nccl at every size")


def routed_bands(routes, caps, op, dtype=None):
    """[(limit, backend)] of what a call of `op` really takes, size by size
    (bytes per rank of well-aligned input): the table's bands after the caps
    (max_bytes, packet_max_bytes) and each kernel's own limits, by asking
    routing.route at every size where some rule changes its answer. The last
    band is the largest size a kernel takes; larger ones go to NCCL. dtype:
    a torch dtype (default bfloat16, the reducing ops' usual one)."""
    import torch

    from .. import routing

    dtype = dtype or torch.bfloat16
    # the kernels' own edges (limits.c), in input bytes per rank: a
    # reduce_scatter's limits are per part, one of world
    per_part = caps.world_size if op == "reduce_scatter" else 1
    kernel_limits = [routing.limits(caps)[op, kernel].limits for kernel in routing.KERNELS]
    align = max(lim.multiple for lim in kernel_limits) * per_part
    edges = {limit for bands in routes[op].values() for limit, _ in bands if limit < 1 << 40}
    edges |= {value * per_part for lim in kernel_limits for value in (lim.more_than, lim.packet_cap, lim.cap)
              if value < 1 << 40}
    points = sorted({t - t % align for t in edges if t >= align})
    bands = []
    for t in points:
        backend = routing.route(routes, caps, op, dtype, t, t)
        if bands and bands[-1][1] == backend:
            bands[-1] = (t, backend)
        else:
            bands.append((t, backend))
    while bands and bands[-1][1] == "nccl":
        bands.pop()
    return bands
