"""vLLM's DeviceCommunicatorBase: the group facts it records."""
import torch
import torch.distributed as dist


class DeviceCommunicatorBase:
    def __init__(self, cpu_group, device=None, device_group=None, unique_name="", global_ranks=None,
                 global_world_size=None, use_all2all=False):
        self.device = device or torch.device("cpu")
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.unique_name = unique_name
        self.rank = dist.get_rank(cpu_group)
        self.world_size = dist.get_world_size(cpu_group)
        self.ranks = dist.get_process_group_ranks(cpu_group)
        self.use_all2all = use_all2all
