"""torch SymmetricMemory all-reduce: torch.ops.symm_mem.one_shot_all_reduce
(returns a new tensor) and two_shot_all_reduce_ (in place), on a buffer from
symm_mem.empty rendezvoused on the group, with the "CUDA" backend: peer to
peer over NVLink, never multicast (TORCH_SYMM_MEM_DISABLE_MULTICAST=1). The
ops run on views at offset 0 of that buffer; a caller's data must be copied
in. All-reduce only; fp32 and bf16 in torch 2.11 (fp16 raises).

Set-up: allocate() is local, rendezvous() collective."""
import torch

from ..backends import Unavailable

KINDS = ("one_shot", "two_shot")


class SymmMem:
    name = "symm_mem"

    def __init__(self, group, device, nbytes):
        self.group, self.device = group, device
        self.nbytes = (int(nbytes) + (1 << 16) - 1) // (1 << 16) * (1 << 16)
        self.group_name = group.group_name
        self.buf = self.handle = None
        self.note = None  # what set_backend said, if it failed

    def allocate(self):
        import torch.distributed._symmetric_memory as symm_mem

        for name in ("one_shot_all_reduce", "two_shot_all_reduce_"):
            getattr(torch.ops.symm_mem, name)  # raises when this torch lacks the op
        try:
            symm_mem.set_backend("CUDA")
        except Exception as e:  # noqa: BLE001 - keep torch's default backend
            self.note = f"set_backend('CUDA') failed: {type(e).__name__}: {e}"
        self.buf = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.buf.zero_()
        torch.cuda.synchronize(self.device)

    def rendezvous(self):
        import torch.distributed._symmetric_memory as symm_mem

        self.handle = symm_mem.rendezvous(self.buf, self.group_name)
        torch.cuda.synchronize(self.device)

    def backend_name(self):
        import torch.distributed._symmetric_memory as symm_mem

        return str(symm_mem.get_backend(self.device))

    def view(self, dtype, numel):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.buf.numel():
            raise Unavailable(f"{nbytes} bytes are over the symmetric buffer's {self.buf.numel()}")
        return self.buf[:nbytes].view(dtype)

    def all_reduce(self, x, kind):
        """x: a view from view(). one_shot returns a new tensor, two_shot x."""
        if kind == "one_shot":
            return torch.ops.symm_mem.one_shot_all_reduce(x, "sum", self.group_name)
        return torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", self.group_name)
