"""vLLM's CUDA platform: the hooks the plugin uses."""


class CudaPlatformBase:
    device_name = "cuda"

    @classmethod
    def is_cuda(cls) -> bool:
        return True

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"


class NvmlCudaPlatform(CudaPlatformBase):
    pass


CudaPlatform = NvmlCudaPlatform
