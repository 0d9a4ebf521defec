"""tpcomm.routing without a GPU: the table's bands, the kernels a call falls
back to where a band's kernel cannot take it, the communicator's caps, world
sizes 2..8, and the Communicator's route_* methods over it (a Communicator
whose set-up is skipped, given routes and caps as an open one has)."""
import itertools

import pytest
import torch

import tpcomm
from tpcomm import Config, routing, routing_table
from tpcomm import _constants as C
from routing_only import FALLBACK

KiB = 1024
MiB = 1024 * KiB

# An explicit table, so these tests do not move when the shipped one is re-tuned.
TABLE = {"routes": {op: {"2": {"*": [[256 * KiB, "packet"], [16 * MiB, "bulk"]]},
                         "*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}}
                    for op in ("all_reduce", "all_gather")}}
LINE_TABLE = {"routes": {op: {"*": {"*": [[4 * KiB, "packet"], [1 * MiB, "line"], [16 * MiB, "bulk"]]}}
                         for op in ("all_reduce", "all_gather")}}


def _routes(table=TABLE, world_size=2, force=None, forbid=()):
    return routing_table.effective_routes(routing_table.load_table(table), world_size, force, forbid)


def _comm(world_size=2, max_bytes=16 * MiB, packet_max_bytes=1 * MiB, table=TABLE, force=None, forbid=(),
          platform=C.TPC_PLATFORM_CUDA, enabled=True):
    comm = object.__new__(tpcomm.Communicator)
    comm.config, comm.world_size = Config(), world_size
    comm._routes = _routes(table, world_size, force, forbid)
    comm._caps = routing.Caps(world_size, max_bytes, packet_max_bytes, platform) if enabled else None
    comm._nccl, comm._fallback = FALLBACK, FALLBACK.backend
    return comm


def _t(nbytes, dtype=torch.float32, shape=None):
    esize = torch.empty((), dtype=dtype).element_size()
    return torch.empty(shape or (nbytes // esize,), dtype=dtype, device="meta")


def test_choose_takes_the_first_band_that_holds_the_size():
    bands = [(100, "bulk"), (200, "packet"), (300, "bulk")]
    assert [routing.choose(bands, n) for n in (0, 100, 101, 200, 201, 300, 301)] == \
        ["bulk", "bulk", "packet", "packet", "bulk", "bulk", "nccl"]
    assert routing.choose([], 16) == "nccl"


def test_route_all_reduce():
    c = _comm()
    assert c.route_all_reduce(_t(16)) == "packet"
    assert c.route_all_reduce(_t(256 * KiB)) == "packet"
    assert c.route_all_reduce(_t(256 * KiB + 16)) == "bulk"
    assert c.route_all_reduce(_t(16 * MiB)) == "bulk"
    assert c.route_all_reduce(_t(16 * MiB + 16)) == "nccl"
    assert c.route_all_reduce(_t(1024, torch.bfloat16)) == "packet"
    assert c.route_all_reduce(_t(1024, torch.float16)) == "packet"
    # dtypes the kernels do not reduce, sizes they do not take
    assert c.route_all_reduce(_t(1024, torch.int64)) == "nccl"
    assert c.route_all_reduce(_t(1024, torch.float64)) == "nccl"
    assert c.route_all_reduce(_t(20)) == "nccl"
    assert c.route_all_reduce(_t(0)) == "nccl"
    # the caps of this communicator win over the table
    c = _comm(max_bytes=1 * MiB, packet_max_bytes=64 * KiB)
    assert c.route_all_reduce(_t(64 * KiB)) == "packet"
    assert c.route_all_reduce(_t(128 * KiB)) == "bulk"  # table says packet, over the packet cap
    assert c.route_all_reduce(_t(1 * MiB)) == "bulk"
    assert c.route_all_reduce(_t(1 * MiB + 16)) == "nccl"
    # world size 4 uses the "*" rows
    c = _comm(world_size=4)
    assert c.route_all_reduce(_t(64 * KiB)) == "packet"
    assert c.route_all_reduce(_t(64 * KiB + 16)) == "bulk"
    # custom path off (or closed): always NCCL
    assert _comm(enabled=False).route_all_reduce(_t(16)) == "nccl"


def test_route_all_gather():
    c = _comm()
    assert c.route_all_gather(_t(1024, shape=(64, 4)), 0) == "packet"
    assert c.route_all_gather(_t(1024, shape=(64, 4)), 1) == "packet"
    big = (64 * KiB, 2)  # 512 KiB of fp32; rows of 8 bytes along dim 1
    assert c.route_all_gather(_t(0, shape=big), 0) == "bulk"
    assert c.route_all_gather(_t(0, shape=big), -1) == "packet"  # 8-byte rows: no bulk
    assert c.route_all_gather(_t(0, shape=(32 * KiB, 4)), 1) == "bulk"  # 16-byte rows
    # sizes or rows that are not a multiple of 4 bytes: NCCL
    assert c.route_all_gather(_t(6, torch.uint8), 0) == "nccl"
    assert c.route_all_gather(_t(0, torch.float16, shape=(4, 3)), 1) == "nccl"  # 6-byte rows
    assert c.route_all_gather(_t(0, torch.float16, shape=(4, 3)), 0) == "packet"  # 24 bytes
    assert c.route_all_gather(_t(0, torch.float16, shape=(0, 8)), 0) == "nccl"
    # over the packet cap and bulk impossible: NCCL
    c = _comm(packet_max_bytes=64 * KiB)
    assert c.route_all_gather(_t(0, shape=big), -1) == "nccl"
    assert c.route_all_gather(_t(0, shape=big), 0) == "bulk"
    # bulk output over max_bytes
    c = _comm(max_bytes=1 * MiB)
    assert c.route_all_gather(_t(512 * KiB), 0) == "bulk"  # 2 x 512 KiB out: fits exactly
    assert c.route_all_gather(_t(512 * KiB + 16), 0) == "packet"  # output too large: within the packet cap
    c = _comm(max_bytes=1 * MiB, packet_max_bytes=256 * KiB)
    assert c.route_all_gather(_t(512 * KiB + 16), 0) == "nccl"  # neither kernel takes it
    assert _comm(enabled=False).route_all_gather(_t(1024), 0) == "nccl"


def test_route_line_kernels():
    """The line kernels take their bands where they can run (16-byte sizes,
    and rows for all_gather; up to the packet cap; CUDA builds); the packet
    kernel takes what they cannot, bulk what is over the cap."""
    c = _comm(table=LINE_TABLE, packet_max_bytes=512 * KiB)
    assert c.route_all_reduce(_t(4 * KiB)) == "packet"
    assert c.route_all_reduce(_t(4 * KiB + 16)) == "line"
    assert c.route_all_reduce(_t(512 * KiB)) == "line"
    assert c.route_all_reduce(_t(512 * KiB + 16)) == "bulk"  # over the packet cap: lines live in packet slots
    assert c.route_all_gather(_t(64 * KiB), 0) == "line"
    assert c.route_all_gather(_t(64 * KiB, shape=(8192, 2)), 1) == "packet"  # 8-byte rows
    assert c.route_all_gather(_t(64 * KiB, shape=(1024, 16)), 1) == "line"  # 64-byte rows
    assert c.route_all_gather(_t(64 * KiB + 4), 0) == "packet"
    assert c.route_all_gather(_t(1 * MiB), 0) == "bulk"
    rocm = _comm(table=LINE_TABLE, platform=C.TPC_PLATFORM_ROCM)
    assert rocm.route_all_reduce(_t(64 * KiB)) == "packet"
    assert rocm.route_all_gather(_t(64 * KiB), 0) == "packet"
    assert _comm(table=LINE_TABLE, forbid=("line",)).route_all_reduce(_t(64 * KiB)) == "nccl"
    with pytest.raises(ValueError, match="reduce_scatter has no two_shot kernel"):
        tpcomm.Config(force=(("reduce_scatter", "two_shot"),)).checked()
    tpcomm.Config(force=(("reduce_scatter", "line"),)).checked()


def test_route_reduce_scatter():
    """Bands by input bytes per rank; the packet cap applies to one part."""
    table = {"routes": {"reduce_scatter": {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}}}}
    c = _comm(table=table, packet_max_bytes=16 * KiB)
    assert c.route_reduce_scatter(_t(32)) == "packet"            # 2 parts of 16 bytes
    assert c.route_reduce_scatter(_t(32 * KiB)) == "packet"      # parts of 16 KiB: at the packet cap
    assert c.route_reduce_scatter(_t(32 * KiB + 32)) == "bulk"   # over the packet cap per part
    assert c.route_reduce_scatter(_t(64 * KiB + 32)) == "bulk"
    assert c.route_reduce_scatter(_t(16 * MiB + 32)) == "nccl"   # over max_bytes
    assert c.route_reduce_scatter(_t(48)) == "nccl"              # parts of 24 bytes
    assert c.route_reduce_scatter(_t(1024, torch.int32)) == "nccl"
    assert _comm(table=table, enabled=False).route_reduce_scatter(_t(32)) == "nccl"


def test_two_shot_and_line_reduce_scatter_bands():
    """two_shot takes an all_reduce band from one warp step of lines per rank
    on (more than 448 * (world - 1) bytes), the line kernel below that;
    reduce_scatter's line band caps one part; builds without line kernels
    fall back to the packet kernel."""
    table = {"routes": {"all_reduce": {"*": {"*": [[1 * MiB, "two_shot"], [16 * MiB, "bulk"]]}},
                        "reduce_scatter": {"*": {"*": [[1 * MiB, "line"], [16 * MiB, "bulk"]]}}}}
    c = _comm(world_size=4, table=table, packet_max_bytes=256 * KiB)
    assert c.route_all_reduce(_t(1360)) == "two_shot"
    assert c.route_all_reduce(_t(1344)) == "line"
    assert c.route_all_reduce(_t(256 * KiB)) == "two_shot"
    assert c.route_all_reduce(_t(256 * KiB + 16)) == "bulk"  # lines live in the packet slots
    assert _comm(world_size=2, table=table).route_all_reduce(_t(464)) == "two_shot"
    assert c.route_reduce_scatter(_t(64)) == "line"  # parts of 16 bytes
    assert c.route_reduce_scatter(_t(4 * 256 * KiB)) == "line"
    assert c.route_reduce_scatter(_t(4 * (256 * KiB + 16))) == "bulk"
    rocm = _comm(world_size=4, table=table, packet_max_bytes=256 * KiB, platform=C.TPC_PLATFORM_ROCM)
    assert rocm.route_all_reduce(_t(64 * KiB)) == "packet"
    assert rocm.route_reduce_scatter(_t(64 * KiB)) == "packet"
    assert _comm(world_size=4, table=table, forbid=("two_shot",)).route_all_reduce(_t(64 * KiB)) == "nccl"


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_reduce_scatter_parts_at_every_world_size(world_size):
    """A part is 1/world of the input: it must be a whole positive multiple
    of 16 bytes (any world size, not only powers of two), and the packet cap
    is on the part."""
    table = {"routes": {"reduce_scatter": {"*": {"*": [[1 * MiB, "packet"], [16 * MiB, "bulk"]]}}}}
    c = _comm(world_size=world_size, table=table, packet_max_bytes=64 * KiB)
    for part in (16, 48, 4096, 64 * KiB):
        assert c.route_reduce_scatter(_t(part * world_size)) == "packet", part
    assert c.route_reduce_scatter(_t((64 * KiB + 16) * world_size)) == "bulk"  # a part over the packet cap
    assert c.route_reduce_scatter(_t(8 * world_size)) == "nccl"  # 8-byte parts
    if world_size not in (2, 4, 8):  # 16 * 2^k bytes do not split into whole parts
        assert c.route_reduce_scatter(_t(4096)) == "nccl"


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_all_gather_output_cap_scales_with_the_world(world_size):
    """Bulk all_gather writes world_size inputs into its buffer: the output,
    not the input, is held to max_bytes; the packet kernel takes what fits
    its cap."""
    table = {"routes": {"all_gather": {"*": {"*": [[16, "packet"], [16 * MiB, "bulk"]]}}}}
    c = _comm(world_size=world_size, table=table, max_bytes=1 * MiB, packet_max_bytes=4 * KiB)
    fits = 1 * MiB // world_size // 16 * 16
    assert c.route_all_gather(_t(fits), 0) == "bulk"
    assert c.route_all_gather(_t(fits + 16), 0) == "nccl"  # output too large, input over the packet cap
    assert c.route_all_gather(_t(32), 0) == "bulk"
    assert c.route_all_gather(_t(24), 0) == "packet"  # 24 bytes: no 16-byte units for bulk


def test_fallback_order_for_every_band():
    """Where a band's kernel cannot take a call, the kernels it falls back
    to are tried in order: line -> packet -> bulk, packet -> bulk, bulk ->
    packet; NCCL when none can."""
    caps = routing.Caps(2, 1 * MiB, 64 * KiB, C.TPC_PLATFORM_CUDA)
    for band, size, expected in [
            ("line", 64 * KiB, "line"),
            ("line", 32 * KiB + 4, "packet"),         # not 16-byte units: no line, packet takes it
            ("line", 128 * KiB, "bulk"),              # over the packet cap
            ("line", 128 * KiB + 4, "nccl"),          # bulk cannot (4-byte units) nor packet (cap)
            ("packet", 64 * KiB + 16, "bulk"),
            ("bulk", 20, "packet"),                   # bulk needs 16-byte units
            ("bulk", 512 * KiB + 16, "nccl"),         # output over max_bytes, input over the packet cap
            ("nccl", 64, "nccl")]:
        routes = {"all_gather": {"*": [(16 * MiB, band)]}}
        assert routing.route(routes, caps, "all_gather", torch.float32, size, size) == expected, (band, size)


def test_caps_take_a_platform_not_a_flag():
    assert routing.Caps(2, MiB, KiB, C.TPC_PLATFORM_ROCM).platform == C.TPC_PLATFORM_ROCM
    for bad in (True, False, 2, None):
        with pytest.raises(ValueError, match="Caps.platform"):
            routing.Caps(2, MiB, KiB, bad)


def test_refusal_names_why():
    """The C core's sentence (tpc_kernel_check), naming the rule and numbers."""
    caps = routing.Caps(4, 1 * MiB, 64 * KiB, C.TPC_PLATFORM_ROCM)
    f32 = torch.float32
    assert routing.refusal("all_reduce", "packet", caps, f32, 1024) is None
    assert "the line kernel is not in this build (CUDA only)" in routing.refusal("all_reduce", "line", caps, f32, 1024)
    lines = caps._replace(platform=C.TPC_PLATFORM_CUDA)
    assert routing.refusal("reduce_scatter", "line", lines, f32, 1024) is None
    assert "the two_shot kernel is not in this build" in routing.refusal("all_reduce", "two_shot", caps, f32, 2048)
    assert "all_gather has no two_shot kernel" in routing.refusal("all_gather", "two_shot", lines, f32, 2048, 2048)
    assert "reduce_scatter has no two_shot kernel" in routing.refusal("reduce_scatter", "two_shot", lines, f32, 2048)
    # a warp step of lines (448 bytes) for each rank: more than 448 * 3 bytes at 4 ranks
    assert "more than 1344 bytes" in routing.refusal("all_reduce", "two_shot", lines, f32, 1344)
    assert routing.refusal("all_reduce", "two_shot", lines, f32, 1360) is None
    assert routing.refusal("all_reduce", "two_shot", lines._replace(world_size=2), f32, 464) is None
    assert "65552 bytes is over the packet cap of 65536" in routing.refusal("all_reduce", "two_shot", lines, f32,
                                                                             64 * KiB + 16)
    assert "over the packet cap of 65536" in routing.refusal("all_reduce", "packet", caps, f32, 128 * KiB)
    assert "all_reduce of 2097152 bytes is over max_bytes 1048576" in routing.refusal("all_reduce", "bulk", caps, f32,
                                                                                      2 * MiB)
    why = routing.refusal("all_reduce", "bulk", caps, torch.int32, 64)
    assert "torch.int32" in why and "is not float32, float16 or bfloat16" in why
    assert "a positive multiple of 16 is needed" in routing.refusal("reduce_scatter", "bulk", caps, f32, 4 * 20)
    assert "all_gather output of 4 x 524288 bytes is over max_bytes 1048576" in routing.refusal(
        "all_gather", "bulk", caps, f32, 512 * KiB, 512 * KiB)
    assert "a positive multiple of 4 is needed" in routing.refusal("all_gather", "packet", caps, torch.uint8, 6, 6)
    assert routing.refusal("all_gather", "packet", None, f32, 64, 64) == "the custom path is off"
    with pytest.raises(ValueError, match="no 'fast' kernel"):
        routing.refusal("all_reduce", "fast", caps, f32, 64)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8])
def test_route_only_ever_picks_a_kernel_that_takes_the_call(world_size):
    """Over sizes, dtypes, caps and layouts: a kernel route is one refusal()
    accepts, and NCCL means the band said so or no kernel in its fallback
    order can take the call."""
    table = {"routes": {op: {"*": {"*": [[256, "packet"], [4 * KiB, "line"], [64 * KiB, "bulk"], [256 * KiB, "packet"],
                                      [1 * MiB, "nccl"], [4 * MiB, "bulk"]]}} for op in ("all_reduce", "all_gather")}}
    table["routes"]["reduce_scatter"] = {"*": {"*": [[4 * KiB, "packet"], [4 * MiB, "bulk"]]}}
    routes = _routes(table, world_size)
    sizes = sorted({16 * k * world_size for k in (1, 3, 16, 100, 1024, 5000, 20000)} | {4, 20, 100, 4096, 65540})
    for caps in (routing.Caps(world_size, 1 * MiB, 16 * KiB, C.TPC_PLATFORM_CUDA), routing.Caps(world_size, 4 * MiB, 1 * MiB, C.TPC_PLATFORM_ROCM)):
        for op, dtype, nbytes, row_div in itertools.product(routing.OPS, (torch.float32, torch.bfloat16, torch.int8),
                                                            sizes, (1, 4)):
            row = nbytes // row_div
            got = routing.route(routes, caps, op, dtype, nbytes, row)
            if got in routing.KERNELS:
                assert routing.refusal(op, got, caps, dtype, nbytes, row) is None, (op, dtype, nbytes, got)
                continue
            band = routing.choose(routes[op]["*"], nbytes)
            assert band == "nccl" or all(routing.refusal(op, k, caps, dtype, nbytes, row)
                                         for k in routing.FALLBACKS[band]), (op, dtype, nbytes, band)


def test_shipped_bands_past_max_bytes_apply_only_to_a_larger_communicator():
    """The shipped table's last bulk band reaches 64 MiB; a communicator's
    max_bytes still sends anything larger than it to NCCL."""
    default = _comm(table=None)
    large = _comm(table=None, max_bytes=128 * MiB)
    assert default.route_all_reduce(_t(64 * MiB)) == "nccl"
    assert large.route_all_reduce(_t(64 * MiB)) == "bulk"
    assert large.route_all_reduce(_t(64 * MiB + 16)) == "nccl"  # past the last band


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8])
def test_route_default_tables(world_size):
    """With the shipped table, a size the table gives to a kernel goes to
    that kernel (on a communicator whose caps hold it), and past the table to
    NCCL."""
    shipped = routing_table.load_table()
    c = _comm(world_size=world_size, table=None, max_bytes=64 * MiB)
    for dtype in (torch.float32, torch.bfloat16):
        rows = routing_table.bands_for(shipped, "all_reduce", world_size, str(dtype).split(".")[1])
        for limit, backend in rows:
            assert c.route_all_reduce(_t(limit, dtype)) == backend
        assert c.route_all_reduce(_t(rows[-1][0] + 16, dtype)) == "nccl"


def test_route_per_dtype_forced_and_forbidden():
    """A dtype row of the table, a forced backend and a forbidden one."""
    table = {"routes": {"all_reduce": {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]],
                                              "bfloat16": [[4 * KiB, "packet"], [16 * MiB, "bulk"]]}},
                        "all_gather": {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}}}}
    c = _comm(table=table)
    assert c.route_all_reduce(_t(8 * KiB, torch.float32)) == "packet"
    assert c.route_all_reduce(_t(8 * KiB, torch.bfloat16)) == "bulk"
    assert c.route_all_reduce(_t(8 * KiB, torch.float16)) == "packet"  # no row of its own: "*"
    c = _comm(table=table, force={"all_reduce": "nccl"})
    assert c.route_all_reduce(_t(64)) == "nccl"
    assert c.route_all_gather(_t(64), 0) == "packet"  # only all_reduce was forced
    c = _comm(table=table, force={"all_gather": "bulk"})
    assert c.route_all_gather(_t(64), 0) == "bulk"
    assert c.route_all_gather(_t(12), 0) == "packet"  # bulk cannot take 12 bytes: the kernel that can
    c = _comm(table=table, forbid=("packet",))
    assert c.route_all_reduce(_t(1024)) == "nccl"
    assert c.route_all_reduce(_t(1 * MiB)) == "bulk"


def test_route_never_depends_on_the_pointer():
    """A view at an odd offset on one rank only must take the same route as
    the aligned tensor its peers hold (the binding copies it into an aligned
    tensor), or one rank would run the kernel while the other calls NCCL."""
    c = _comm()
    base = torch.zeros(4096 + 3)
    for offset in (1, 2, 3):  # 4, 8 and 12 bytes past a 16-byte boundary
        x = base[offset:offset + 1024]
        assert x.is_contiguous() and x.data_ptr() % 16 == 4 * offset
        assert c.route_all_reduce(x) == c.route_all_reduce(torch.zeros(1024)) == "packet"
        g = base[offset:offset + 4096].view(64, 64)
        for dim in (0, 1):
            assert c.route_all_gather(g, dim) == c.route_all_gather(torch.zeros(64, 64), dim)


def test_summary_logged_at_init_names_every_band():
    text = routing.summary(_routes(), routing.Caps(2, 16 * MiB, 1 * MiB, C.TPC_PLATFORM_CUDA))
    assert "all_reduce: packet up to 262144 B, bulk up to 16777216 B, then nccl" in text
    assert "all_gather: packet up to 262144 B" in text and "caps: packet 1048576 B per rank" in text


def test_algo_codes_are_the_headers():
    header = {name[len("TPC_ALGO_"):].lower(): value for name, value in vars(C).items() if name.startswith("TPC_ALGO_")}
    # every algorithm of the header's tpc_algo is a kernel routing can name, under the header's name
    assert routing.ALGO_CODES == header
    assert set(routing.KERNELS) <= set(routing.ALGO_CODES)


def test_aiter_is_offered_every_all_reduce_and_dim0_all_gathers_that_fit():
    assert routing.aiter_first("all_reduce", 4, 1 * MiB, 64 * MiB)
    assert routing.aiter_first("all_gather", 4, 1 * MiB, 256 * 1024, dim=0)
    assert not routing.aiter_first("all_gather", 4, 1 * MiB, 256 * 1024 + 16, dim=0)  # output over max_bytes
    assert not routing.aiter_first("all_gather", 4, 1 * MiB, 1024, dim=1)  # not AITER's flat layout
    assert not routing.aiter_first("reduce_scatter", 4, 1 * MiB, 1024)
