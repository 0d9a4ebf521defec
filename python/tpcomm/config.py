"""A Communicator's configuration: caps, timeout, routing table, and
backends forced or forbidden. Read once, at init, from the arguments and
the TPCOMM_* variables; every bad value raises ValueError naming it.

    TPCOMM_DISABLE=1                    the custom path off (every call to NCCL)
    TPCOMM_TIMEOUT_S=10                 bound on every device-side wait for a peer
    TPCOMM_MAX_BYTES=16777216           cap on the output bytes of one custom op
    TPCOMM_PACKET_MAX_BYTES=1048576     cap on the per-rank input of the packet kernels
    TPCOMM_TABLE=path.json              routing table (default: tpcomm/tables/h200x2.json)
    TPCOMM_FORCE=all_reduce=nccl,...    one backend for every size of an op
    TPCOMM_FORBID=bulk,...              backends never used (their sizes go to NCCL)
    TPCOMM_AITER=0                      AMD AITER's all-reduce off (on by default where it
                                        imports: ROCm only)
    TPCOMM_FUSED_KERNEL=0               all_reduce_add_rms_norm never on the fused kernel
    TPCOMM_SHARE_GPU=1                  for testing kernels on a one-GPU machine: ranks that
                                        share a GPU keep the custom path (their kernels
                                        time-slice, so an op takes milliseconds; never for serving)
"""
import dataclasses
import os

from . import policy, topology

KiB = 1024
MiB = 1024 * KiB


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
    fused_kernel: bool = True  # all_reduce_add_rms_norm on the fused kernel where it takes the call
    share_gpu: bool = False    # ranks on one GPU keep the custom path: kernel tests on one GPU only

    @classmethod
    def from_env(cls):
        """The defaults, overridden by whichever TPCOMM_* variables are set."""
        env = os.environ
        fields = {"disable": topology.env_flag("TPCOMM_DISABLE"),
                  "timeout_s": topology.env_positive_float("TPCOMM_TIMEOUT_S", cls.timeout_s)}
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
            fields["aiter"] = topology.env_flag("TPCOMM_AITER")
        if env.get("TPCOMM_FUSED_KERNEL", "").strip():
            fields["fused_kernel"] = topology.env_flag("TPCOMM_FUSED_KERNEL")
        if env.get("TPCOMM_SHARE_GPU", "").strip():
            fields["share_gpu"] = topology.env_flag("TPCOMM_SHARE_GPU")
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
        for name in ("max_bytes", "packet_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 16:
                raise ValueError(f"tpcomm: {name}={value!r} must be a positive multiple of 16")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"tpcomm: timeout_s={self.timeout_s!r} must be positive")
        for op, backend in self.force:
            if op not in policy.OPS or backend not in policy.BACKENDS:
                raise ValueError(f"tpcomm: force {op}={backend}: ops are {policy.OPS}, backends {policy.BACKENDS}")
            if backend == "line" and op in policy.NO_LINE:
                raise ValueError(f"tpcomm: force {op}={backend}: {op} has no line kernel")
        for backend in self.forbid:
            if backend not in policy.KERNELS:
                raise ValueError(f"tpcomm: forbid {backend!r}: only tpcomm's kernels {policy.KERNELS} can be forbidden")
        return self

    def describe(self):
        """The fields the ranks must agree on, as flat strings."""
        return {"max_bytes": str(self.max_bytes), "packet_max_bytes": str(self.packet_max_bytes),
                "timeout_s": repr(float(self.timeout_s)), "disable": str(self.disable), "aiter": str(self.aiter),
                "fused_kernel": str(self.fused_kernel), "share_gpu": str(self.share_gpu)}


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
