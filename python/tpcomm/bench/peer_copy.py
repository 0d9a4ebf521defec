"""The peer-copy bandwidth a results file records (the scale its
bandwidth columns are read against): Tensor.copy_ from cuda:0 into cuda:1."""
import statistics

import torch

from .cases import describe
from .vocabulary import human_bytes

PEER_COPY_BYTES = 256 << 20


def measure_peer_copy(nbytes=PEER_COPY_BYTES, reps=5):
    """Rank 0: GB/s of Tensor.copy_ from cuda:0 into cuda:1 (median of reps)."""
    try:
        if torch.cuda.device_count() < 2:
            return {"peer_copy_gbps": None, "peer_copy": "not measured: rank 0 sees one GPU"}
        if not torch.cuda.can_device_access_peer(0, 1):
            return {"peer_copy_gbps": None, "peer_copy": "not measured: cuda:0 cannot access cuda:1 as a peer"}
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        times = []
        with torch.cuda.device(0):
            for _ in range(2):
                dst.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            torch.cuda.synchronize(1)
        ms = statistics.median(times)
        del src, dst
        torch.cuda.empty_cache()
        return {"peer_copy_gbps": round(nbytes / (ms * 1e-3) / 1e9, 1),
                "peer_copy": f"rank 0, Tensor.copy_ of {human_bytes(nbytes)} cuda:0 -> cuda:1, "
                             f"median of {reps} after 2 warm-ups ({ms:.3f} ms)"}
    except Exception as e:  # noqa: BLE001
        return {"peer_copy_gbps": None, "peer_copy": f"failed: {describe(e)}"}
