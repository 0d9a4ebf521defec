"""vLLM's GroupCoordinator: builds the device communicator named by the
platform, by keyword, and sends the ops to it."""
import vllm.platforms
from vllm.platforms import resolve_obj_by_qualname

_ENABLE_CUSTOM_ALL_REDUCE = True


class GroupCoordinator:
    def __init__(self, cpu_group, device_group, device, group_name):
        self.unique_name = f"{group_name}:0"
        current_platform = resolve_obj_by_qualname(vllm.platforms.resolve_current_platform_cls_qualname())()
        device_comm_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
        self.device_communicator = device_comm_cls(
            cpu_group=cpu_group,
            device=device,
            device_group=device_group,
            unique_name=self.unique_name,
            use_all2all=False,
        )

    def _all_reduce_out_place(self, input_):
        return self.device_communicator.all_reduce(input_)

    def _all_gather_out_place(self, input_, dim):
        return self.device_communicator.all_gather(input_, dim)

    def _reduce_scatter_out_place(self, input_, dim):
        return self.device_communicator.reduce_scatter(input_, dim)

    def destroy(self):
        self.device_communicator.destroy()


def initialize_model_parallel(cpu_group, device_group, device):
    return GroupCoordinator(cpu_group, device_group, device, group_name="tp")
