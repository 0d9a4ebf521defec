"""A Communicator's configuration: caps, timeout, routing table, and
backends forced or forbidden. Read once, at init, from the arguments and the
TPCOMM_* variables; every bad value raises ValueError naming it. Every
TPCOMM_* variable tpcomm reads is parsed here, and every one is in this table:

    variable                 default          meaning
    TPCOMM_DISABLE           0                1: the custom path off (every call to torch.distributed)
    TPCOMM_TIMEOUT_S         10               bound in seconds on every device-side wait for a peer
    TPCOMM_MAX_BYTES         16777216         cap on the output bytes of one op on tpcomm's kernels
    TPCOMM_PACKET_MAX_BYTES  1048576          cap on the input bytes per rank of the packet and
                                              line kernels (reduce_scatter: of one rank's part)
    TPCOMM_TABLE             the shipped one  routing table file (default: tpcomm/tables/<GPU model>.json,
                                              else h200.json; python -m tpcomm.tune writes one)
    TPCOMM_FORCE             none             op=backend pairs, e.g. all_reduce=nccl: one backend
                                              for every size of that op
    TPCOMM_FORBID            none             kernels never used, e.g. bulk,line (their sizes go to NCCL)
    TPCOMM_AITER             1                0: AMD AITER's all-reduce off (tried first on ROCm
                                              where it imports)
    TPCOMM_FUSED_KERNEL      1                0: all_reduce_add_rms_norm and every fusion pattern
                                              never on the fused kernel family
    TPCOMM_QUANTIZE          none             fp8, int8 or int4: float16/bfloat16 all_reduces from the
                                              table's quantized_min_bytes on send quantized values (not
                                              exact: docs/design.md bounds the error)
    TPCOMM_FALLBACK_CHECK    on for gloo,     1: before a call runs on torch.distributed, the ranks
                             off for NCCL     compare op, dtype, shape and dim (tpcomm._agreement)

Booleans take 1/true/yes/on and 0/false/no/off. Every rank of a group must
end with the same configuration: the ranks compare it at init. A Config is
checked when it is made, from arguments or variables alike. Any other
TPCOMM_* variable that is set is warned of once (logger "tpcomm"), naming the
closest known one: a misspelt variable would otherwise change nothing
silently.
"""
import dataclasses
import difflib
import logging
import os

from . import _constants as C
from . import routing
from ._log import log_once

KiB = 1024
MiB = 1024 * KiB
# The variables of the table above: what from_env reads.
VARIABLES = ("TPCOMM_DISABLE", "TPCOMM_TIMEOUT_S", "TPCOMM_MAX_BYTES", "TPCOMM_PACKET_MAX_BYTES", "TPCOMM_TABLE",
             "TPCOMM_FORCE", "TPCOMM_FORBID", "TPCOMM_AITER", "TPCOMM_FUSED_KERNEL", "TPCOMM_QUANTIZE",
             "TPCOMM_FALLBACK_CHECK")
# Read outside the package, never warned of: by the build (setup.py), CI
# (.ci/) and the test harness (docs/testing.md), whose own variables are all
# TPCOMM_TEST_* besides TPCOMM_SHARE_GPU.
OTHER_VARIABLES = ("TPCOMM_CUDA_CLANG", "TPCOMM_VERSION_LABEL", "TPCOMM_CI_WHEELS", "TPCOMM_CI_KEEP_VENVS",
                   "TPCOMM_CI_WHEELS_PREBUILT", "TPCOMM_CI_ROCM_TIMEOUT_S", "TPCOMM_SHARE_GPU")
TEST_PREFIX = "TPCOMM_TEST_"
_TIMEOUT_MAX_S = (2**64 - 1) / 1e9  # the C core holds the timeout in nanoseconds, in 64 bits


@dataclasses.dataclass(frozen=True)
class Config:
    max_bytes: int = 16 * MiB
    packet_max_bytes: int = 1 * MiB
    timeout_s: float = 10.0
    table: str = None          # path of a routing table file; None: the shipped one
    force: tuple = ()          # ((op, backend), ...)
    forbid: tuple = ()         # (backend, ...)
    disable: bool = False
    aiter: bool = True         # AITER's all-reduce tried first on ROCm, where it imports
    fused_kernel: bool = True  # the fusion patterns on the fused kernel family where it takes the call
    quantize: str = None       # None, "fp8", "int8" or "int4": the quantized all_reduce (opt-in)
    fallback_check: bool = None  # the ranks' agreement before a fallback call; None: on where it is gloo

    def __post_init__(self):
        self.checked()

    @classmethod
    def from_env(cls):
        """The defaults, overridden by whichever TPCOMM_* variables are set;
        warns once of each set TPCOMM_* variable tpcomm does not know."""
        env = os.environ
        for name, closest in unknown_variables(env):
            hint = f"did you mean {closest}?" if closest else f"tpcomm reads {', '.join(VARIABLES)}"
            log_once(logging.WARNING, f"tpcomm: {name} is not a tpcomm variable and is ignored ({hint})")
        fields = {"disable": env_flag("TPCOMM_DISABLE"),
                  "timeout_s": env_positive_float("TPCOMM_TIMEOUT_S", cls.timeout_s)}
        for name, field in (("TPCOMM_MAX_BYTES", "max_bytes"), ("TPCOMM_PACKET_MAX_BYTES", "packet_max_bytes")):
            raw = env.get(name, "").strip()
            if raw:
                try:
                    fields[field] = int(raw, 0)
                except ValueError:
                    raise ValueError(f"{name}={raw!r} is not an integer") from None
        if env.get("TPCOMM_TABLE", "").strip():
            fields["table"] = env["TPCOMM_TABLE"].strip()
        if env.get("TPCOMM_FORCE", "").strip():
            fields["force"] = _parse_force(env["TPCOMM_FORCE"], "TPCOMM_FORCE")
        if env.get("TPCOMM_AITER", "").strip():
            fields["aiter"] = env_flag("TPCOMM_AITER")
        if env.get("TPCOMM_FUSED_KERNEL", "").strip():
            fields["fused_kernel"] = env_flag("TPCOMM_FUSED_KERNEL")
        if env.get("TPCOMM_FALLBACK_CHECK", "").strip():
            fields["fallback_check"] = env_flag("TPCOMM_FALLBACK_CHECK")
        if env.get("TPCOMM_QUANTIZE", "").strip():
            fields["quantize"] = env["TPCOMM_QUANTIZE"].strip().lower()
        if env.get("TPCOMM_FORBID", "").strip():
            fields["forbid"] = tuple(b.strip() for b in env["TPCOMM_FORBID"].split(",") if b.strip())
        try:
            return cls(**fields).checked()
        except ValueError as e:
            raise ValueError(f"{e} (from the TPCOMM_* variables)") from None

    def replace(self, **changes):
        """A copy with the fields that are not None in `changes` replaced, checked."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None}).checked()

    def checked(self):
        _check_kinds(self)
        for name, limit in (("max_bytes", C.TPC_MAX_BYTES_LIMIT), ("packet_max_bytes", C.TPC_PACKET_MAX_BYTES_LIMIT)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 16:
                raise ValueError(f"tpcomm: {name}={value!r} must be a positive multiple of 16")
            if value > limit:  # the C core's cap (csrc/tpcomm.h says why)
                raise ValueError(f"tpcomm: {name}={value} is over the largest the kernels take, {limit}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 < timeout <= _TIMEOUT_MAX_S):
            raise ValueError(f"tpcomm: timeout_s={self.timeout_s!r} must be positive and at most {_TIMEOUT_MAX_S:.3g}")
        for op, backend in self.force:
            if op not in routing.OPS or backend not in routing.BACKENDS:
                raise ValueError(f"tpcomm: force {op}={backend}: ops are {routing.OPS}, backends {routing.BACKENDS}")
            if op not in routing.KERNEL_OPS.get(backend, routing.OPS):
                raise ValueError(f"tpcomm: force {op}={backend}: {op} has no {backend} kernel")
        if self.quantize is not None and self.quantize not in routing.QUANTIZE_MODES:
            raise ValueError(f"tpcomm: quantize={self.quantize!r} must be None or one of {routing.QUANTIZE_MODES}")
        if self.fallback_check is not None and not isinstance(self.fallback_check, bool):
            raise ValueError(f"tpcomm: fallback_check={self.fallback_check!r} must be None, True or False")
        for backend in self.forbid:
            if backend not in routing.KERNELS:
                raise ValueError(f"tpcomm: forbid {backend!r}: only tpcomm's kernels {routing.KERNELS} can be forbidden")
        return self

    def describe(self):
        """The fields the ranks must agree on, as flat strings."""
        return {"max_bytes": str(self.max_bytes), "packet_max_bytes": str(self.packet_max_bytes),
                "timeout_s": repr(float(self.timeout_s)), "disable": str(self.disable), "aiter": str(self.aiter),
                "fused_kernel": str(self.fused_kernel), "quantize": str(self.quantize),
                "fallback_check": str(self.fallback_check)}


def _check_kinds(config):
    """ValueError naming a field of the wrong kind: one the range checks
    would take silently (a str as a flag, a str as forbid) or fail on
    obscurely."""
    for name in ("disable", "aiter", "fused_kernel"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"tpcomm: {name}={getattr(config, name)!r} must be True or False")
    if config.table is not None and not isinstance(config.table, (str, os.PathLike)):
        raise ValueError(f"tpcomm: table={config.table!r} must be a path or None")
    if not (isinstance(config.force, tuple)
            and all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in config.force)):
        raise ValueError(f"tpcomm: force={config.force!r} must be a tuple of (op, backend) pairs, "
                         "e.g. (('all_reduce', 'nccl'),)")
    if not (isinstance(config.forbid, tuple) and all(isinstance(b, str) for b in config.forbid)):
        raise ValueError(f"tpcomm: forbid={config.forbid!r} must be a tuple of kernel names, e.g. ('bulk',)")


def unknown_variables(environ=os.environ):
    """[(name, closest known name or None)] of the TPCOMM_* variables set in
    `environ` that tpcomm does not read (VARIABLES, OTHER_VARIABLES, and
    the tests' TPCOMM_TEST_*), sorted."""
    known = VARIABLES + OTHER_VARIABLES
    return [(name, next(iter(difflib.get_close_matches(name, known, n=1)), None))
            for name in sorted(environ) if name.startswith("TPCOMM_") and name not in known
            and not name.startswith(TEST_PREFIX)]


def _parse_force(text, name):
    pairs = []
    for item in text.split(","):
        if not item.strip():
            continue
        op, sep, backend = item.partition("=")
        if not sep:
            raise ValueError(f"{name}={text!r}: expected op=backend pairs, e.g. all_reduce=nccl")
        pairs.append((op.strip(), backend.strip()))
    return tuple(pairs)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(name, environ=os.environ):
    """A boolean variable (unset: False); any other value raises, naming it."""
    raw = environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off")


def env_positive_float(name, default):
    """A positive number from a variable (default when unset); a bad value
    raises, naming the variable."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value
