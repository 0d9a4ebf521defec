"""vLLM's CudaCommunicator on gloo: its TP test, its ops with vLLM's layouts
(reduce_scatter's movedim(0, dim) included), and a count of the calls each
op received (`calls`), so a test sees which calls reached it."""
import collections

import torch
import torch.distributed as dist

from .base_device_communicator import DeviceCommunicatorBase


class CudaCommunicator(DeviceCommunicatorBase):
    def __init__(self, cpu_group, device=None, device_group=None, unique_name="", global_ranks=None,
                 global_world_size=None, tcp_store_group=None, use_all2all=False):
        super().__init__(cpu_group, device, device_group, unique_name, global_ranks, global_world_size,
                         use_all2all=use_all2all)
        if unique_name.split(":")[0] != "tp":
            use_custom_allreduce = False
        else:
            from vllm.distributed.parallel_state import _ENABLE_CUSTOM_ALL_REDUCE

            use_custom_allreduce = _ENABLE_CUSTOM_ALL_REDUCE
        self.use_custom_allreduce = use_custom_allreduce
        self.calls = collections.Counter()
        self.destroyed = False

    def all_reduce(self, input_):
        self.calls["all_reduce"] += 1
        out = input_.clone()
        dist.all_reduce(out, group=self.device_group)
        return out

    def all_gather(self, input_, dim=-1):
        self.calls["all_gather"] += 1
        if dim < 0:
            dim += input_.dim()
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_.contiguous(), group=self.device_group)
        return torch.cat(parts, dim)

    def reduce_scatter(self, input_, dim=-1):
        self.calls["reduce_scatter"] += 1
        if dim < 0:
            dim += input_.dim()
        input_tensor = input_.movedim(0, dim).contiguous()
        assert input_tensor.shape[0] % self.world_size == 0
        total = input_tensor.clone()
        dist.all_reduce(total, group=self.device_group)
        output = total.chunk(self.world_size)[self.rank]
        return output.movedim(0, dim).contiguous()

    def destroy(self):
        self.destroyed = True
