"""vLLM's CustomAllreduce contract on the Communicator: tpcomm's kernel or
None, never torch.distributed. Serving code that routes itself (vLLM's
CudaCommunicator, tpcomm's vLLM plugin) asks these first and takes None as
"use your own backend".

A call reads the Communicator's route memo once, the dispatcher's own (the
routing is walked only on the first call of a dtype and size, or shape and
dim, declines included), and runs and counts what the memo's route says
where that is one of tpcomm's kernels. Bad arguments raise as the
dispatcher's ops raise, on every path: also where the answer is None
because the communicator is closed or its group has one rank."""
from ._shapes import check_int_dim, check_tensor, checked_dim


class KernelOnly:
    """The kernel-or-None methods of tpcomm.Communicator (its base): they
    use its `_closed`, `world_size`, `_check_input`, `_entry`, `_run` and
    `_scatter`."""

    def should_custom_ar(self, x) -> bool:
        """Would custom_all_reduce(x) run tpcomm's kernel (the quantized one
        too, where Config.quantize sends x there)? False when closed, off
        (disabled_reason), on a group of one, or when the dtype, size or
        layout is not one a kernel takes (route_all_reduce(x) names the
        fallback)."""
        return self._takes(x, "all_reduce") and self._entry("all_reduce", x)[2]

    def custom_all_reduce(self, x):
        """Sum of x over the group on tpcomm's kernel (a new tensor), or None
        when the kernels decline it (see should_custom_ar)."""
        return self._run("all_reduce", x, 0, True, None) if self._takes(x, "all_reduce") else None

    def custom_all_gather(self, x, dim: int = 0):
        """all_gather(x, dim) on tpcomm's kernel, or None when the kernels
        decline it (closed, off, or route_all_gather(x, dim) names the
        fallback). A bad dim raises as all_gather does."""
        if not self._takes(x, "custom_all_gather", dim):
            return None
        dim %= x.dim()
        return self._run("all_gather", x, dim, True, dim)

    def custom_reduce_scatter(self, x, dim: int = 0):
        """reduce_scatter(x, dim) on tpcomm's kernel, or None when the kernels
        decline it (closed, off, or route_reduce_scatter(x) names the
        fallback). A bad dim raises as reduce_scatter does; one that does not
        divide by the world size too, where a kernel would take x."""
        if not self._takes(x, "custom_reduce_scatter", dim):
            return None
        return self._scatter(x, dim % x.dim(), True)

    def _takes(self, x, op, *dim):
        """Raises for what `op` (given its dim, where it takes one) raises
        for; then whether a kernel may take x: False when closed, on a group
        of one, or for a non-contiguous x."""
        if dim:
            check_int_dim(dim[0], op)
        if self._closed:
            check_tensor(x, "input")
        else:
            self._check_input(x, "input")
        if dim:
            checked_dim(x, dim[0], op)
        return not self._closed and self.world_size > 1 and x.is_contiguous()
