"""The routing table, kept as data: reading and checking table files, and
the effective bands once a Config is applied. tpcomm.routing, the only
routing module, decides each call from those bands.

A table file maps op x world size x dtype to bands of (largest input bytes
per rank, backend), tried in order; sizes past the last band go to NCCL. One
file per GPU model, with rows per world size: tables/<model>.json is shipped
for the models measured (tables/h200.json), and a Communicator without a table
of its own loads the one of its GPU's model, else h200.json (table_for_device).
`python -m tpcomm.tune` writes or extends such a file for a machine. An op a
table has no routes for takes the shipped table's. "*" stands for any world
size or dtype without a row of its own. Backends:
"packet", "line", "two_shot" and "bulk" are tpcomm's kernels (csrc/kernels;
"two_shot" is all_reduce only), "nccl" is torch.distributed on the same group.

The Communicator turns the table and its Config (forced or forbidden
backends) into the effective bands once, at init (effective_routes); the
ranks compare them before any op runs, since ranks that route differently
deadlock."""
import json
import os
import re

from . import _constants as C
from ._dtypes import NAMES as DTYPES  # the dtypes a table may name for the reducing ops
from .routing import BACKENDS, FUSED_NORM_MODELLED, KERNEL_OPS, OPS

REDUCING = ("all_reduce", "reduce_scatter")  # ops whose tables may have rows per dtype
# The smallest all_reduce the quantized kernel takes where Config.quantize is
# on and the table has no "quantized_min_bytes" for the world size: the cost
# model's break-even (docs/design.md, "Quantized all-reduce").
QUANTIZED_MIN_BYTES = 1 << 20
# The largest input (bytes per rank) the fused norm kernel family takes where
# the table has no "fused_norm_max_bytes" for the world size, the cost model
# of docs/design.md ("Routing of the fused norm"): the fused kernel sends
# (n - 1) B per rank, the split route 3 (n - 1) / n B and pays a fixed delta
# more (launches, barriers), so the fused kernel wins up to
# B* = delta * W * n / ((n - 1) (n - 3)): at every size up to 3 ranks.
FUSED_NORM_FIXED_BYTES = 3 << 19  # delta * W, 1.5 MiB: B* = 2 MiB at 4 ranks (delta about 5 us at W = 310 GB/s)
FUSED_NORM_UNLIMITED = C.TPC_MAX_BYTES_LIMIT  # no input is larger: the packet cap alone bounds the kernel
TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables")
DEFAULT_TABLE = os.path.join(TABLES, "h200.json")  # for GPU models without a table of their own


class TableError(ValueError):
    """A routing table that cannot be used; the message names the entry."""


def load_table(source=None):
    """The table in `source` (a path, or an already parsed dict; default: the
    shipped one), checked: world sizes "*" or 2..8, dtypes "*" or one of
    DTYPES, bands with increasing positive limits and known backends, and a
    "*" row for every op (ops it lacks come from the shipped table)."""
    where = "(given as a dict)"
    if source is None or isinstance(source, (str, os.PathLike)):
        path = DEFAULT_TABLE if source is None else os.fspath(source)
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise TableError(f"routing table {path!r} cannot be read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise TableError(f"routing table {path!r} is not JSON: {e}") from None
        where = repr(path)
    else:
        data = source
    routes = data.get("routes") if isinstance(data, dict) else None
    if not isinstance(routes, dict):
        raise TableError(f"routing table {where} has no 'routes' object")
    table = {}
    missing = [op for op in OPS if op not in routes]
    if missing and path_is_default(source):
        raise TableError(f"the shipped routing table has no routes for {missing[0]}")
    if missing:  # a table written before these ops existed: the shipped rows
        shipped = load_table()["routes"]
        table.update({op: shipped[op] for op in missing})
    for op in OPS:
        if op in missing:
            continue
        if not isinstance(routes[op], dict):
            raise TableError(f"routing table {where}: routes for {op} must be an object")
        table[op] = {}
        for world, by_dtype in routes[op].items():
            if world != "*" and not (world.isdigit() and 2 <= int(world) <= 8):
                raise TableError(f"routing table {where}: {op}/{world}: world size must be '*' or 2..8")
            if not isinstance(by_dtype, dict) or "*" not in by_dtype:
                raise TableError(f"routing table {where}: {op}/{world} needs a '*' dtype row")
            table[op][world] = {}
            for dtype, bands in by_dtype.items():
                if dtype != "*" and dtype not in DTYPES:
                    raise TableError(f"routing table {where}: {op}/{world}/{dtype}: dtype must be '*' or one of {DTYPES}")
                what = f"routing table {where}: {op}/{world}/{dtype}"
                table[op][world][dtype] = _checked_bands(bands, what)
                for _, b in table[op][world][dtype]:
                    if b in KERNEL_OPS and op not in KERNEL_OPS[b]:
                        raise TableError(f"{what}: {op} has no {b} kernel")
        if "*" not in table[op]:
            raise TableError(f"routing table {where}: {op} needs a '*' world-size row")
    return {"about": str(data.get("about", "")), "routes": table,
            **{name: _checked_sizes(data.get(name, {}), where, name) for name in SIZE_FIELDS}}


# The table's sizes per world size, {world size or "*": bytes} (tpcomm.tune
# writes them from measurements): the smallest all_reduce input the quantized
# kernel takes, and the largest input the fused norm kernel family takes.
SIZE_FIELDS = ("quantized_min_bytes", "fused_norm_max_bytes")


def _checked_sizes(sizes, where, name):
    """One of SIZE_FIELDS, checked: an object of world size ('*' or 2..8): positive bytes."""
    if not isinstance(sizes, dict):
        raise TableError(f"routing table {where}: {name} must be an object of world size: bytes")
    for world, value in sizes.items():
        if world != "*" and not (world.isdigit() and 2 <= int(world) <= 8):
            raise TableError(f"routing table {where}: {name}/{world}: world size must be '*' or 2..8")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TableError(f"routing table {where}: {name}/{world} must be a positive integer, got {value!r}")
    return dict(sizes)


def quantized_min_bytes(table, world_size):
    """The smallest all_reduce the quantized kernel takes at this world size."""
    minimums = table.get("quantized_min_bytes", {})
    return minimums.get(str(world_size), minimums.get("*", QUANTIZED_MIN_BYTES))


def fused_norm_default(world_size):
    """The cost model's largest input for the fused norm kernel family
    (FUSED_NORM_FIXED_BYTES)."""
    n = world_size
    return FUSED_NORM_UNLIMITED if n <= 3 else FUSED_NORM_FIXED_BYTES * n // ((n - 1) * (n - 3))


def fused_norm_max_bytes(table, world_size):
    """(bytes, whether the table gave them): the largest input the fused norm
    kernel family takes at this world size, the table's entry for it or
    "*", else the cost model's (fused_norm_default)."""
    maxima = table.get("fused_norm_max_bytes", {})
    for key in (str(world_size), "*"):
        if key in maxima:
            return maxima[key], True
    return fused_norm_default(world_size), False


def gpu_model(device_name):
    """The table file stem for a GPU: its first word with a digit, lower case
    ("NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-80GB" -> "a100", "AMD Instinct
    MI300X" -> "mi300x")."""
    words = re.split(r"[\s_-]+", device_name.strip().lower())
    return next((w for w in words if any(c.isdigit() for c in w)), "-".join(w for w in words if w) or "gpu")


def table_for_device(device_name):
    """The shipped table for this GPU model, or DEFAULT_TABLE when there is
    none; device_name None (no GPU): DEFAULT_TABLE."""
    if device_name:
        path = os.path.join(TABLES, gpu_model(device_name) + ".json")
        if os.path.exists(path):
            return path
    return DEFAULT_TABLE


def path_is_default(source):
    return source is None or (isinstance(source, (str, os.PathLike)) and
                              os.path.abspath(os.fspath(source)) == DEFAULT_TABLE)


def _checked_bands(bands, what):
    if not isinstance(bands, list) or not bands:
        raise TableError(f"{what}: bands must be a non-empty list of [limit, backend]")
    checked, previous = [], 0
    for i, band in enumerate(bands):
        if not (isinstance(band, (list, tuple)) and len(band) == 2 and isinstance(band[0], int)
                and not isinstance(band[0], bool)):
            raise TableError(f"{what}: band {i} must be [limit bytes, backend], got {band!r}")
        limit, backend = band
        if backend not in BACKENDS:
            raise TableError(f"{what}: band {i}: backend {backend!r} is not one of {BACKENDS}")
        if limit <= previous:
            raise TableError(f"{what}: band {i}: limits must increase (got {limit} after {previous})")
        checked.append((limit, backend))
        previous = limit
    return checked


def bands_for(table, op, world_size, dtype="*"):
    """The table's bands for one op, world size and dtype name (with "*"
    standing in for what has no row of its own)."""
    by_world = table["routes"][op]
    by_dtype = by_world.get(str(world_size), by_world["*"])
    return by_dtype.get(dtype, by_dtype["*"])


def apply_config(bands, force=None, forbid=()):
    """The bands once a Config has forced a backend for the op (it takes
    every size) or forbidden some (their bands go to NCCL)."""
    if force:
        return [(1 << 62, force)]
    return [(limit, "nccl" if backend in forbid else backend) for limit, backend in bands]


def effective_routes(table, world_size, force=None, forbid=(), quantize=None):
    """{op: {dtype name or "*": bands}} for one world size, with the Config
    applied: what the Communicator routes by, and what the ranks compare.
    With Config.quantize (a mode) and all_reduce not forced, all_reduce also
    has a "quantized" row: [(smallest size, "quantized_<mode>")]
    (tpcomm.routing.quantized). all_reduce's "fused_norm" row,
    [(largest input, "fused" or routing.FUSED_NORM_MODELLED where it is the
    cost model's)], caps the fused norm kernel family
    (tpcomm.routing.add_rms_norm)."""
    force = dict(force or {})
    routes = {}
    for op in OPS:
        names = ("*",) + (DTYPES if op in REDUCING else ())
        routes[op] = {name: apply_config(bands_for(table, op, world_size, name), force.get(op), forbid)
                      for name in names}
    if quantize and "all_reduce" not in force:
        routes["all_reduce"]["quantized"] = [(quantized_min_bytes(table, world_size), f"quantized_{quantize}")]
    largest, from_table = fused_norm_max_bytes(table, world_size)
    routes["all_reduce"]["fused_norm"] = [(largest, "fused" if from_table else FUSED_NORM_MODELLED)]
    return routes


def flatten(routes):
    """{"all_reduce/bfloat16/0": "1048576 packet", ...}: the effective routes
    as flat keys, so that ranks that disagree can be told which key differs."""
    return {f"{op}/{dtype}/{i}": f"{limit} {backend}" for op, by_dtype in routes.items()
            for dtype, bands in by_dtype.items() for i, (limit, backend) in enumerate(bands)}
