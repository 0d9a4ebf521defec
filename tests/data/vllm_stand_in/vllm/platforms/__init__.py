"""vLLM's platform choice: the built-in CUDA detection, then at most one
out-of-tree platform plugin whose function returns a class name wins."""
import importlib

from vllm.plugins import PLATFORM_PLUGINS_GROUP, load_plugins_by_group

CUDA_FOUND = True  # what the stand-in's CUDA detection answers (tests change it)


def cuda_platform_plugin():
    return "vllm.platforms.cuda.CudaPlatform" if CUDA_FOUND else None


def resolve_current_platform_cls_qualname():
    platform_plugins = load_plugins_by_group(PLATFORM_PLUGINS_GROUP)
    activated = {name: qualname for name, func in platform_plugins.items() if (qualname := func()) is not None}
    if len(activated) >= 2:
        raise RuntimeError(f"Only one platform plugin can be activated, but got: {sorted(activated)}")
    if activated:
        return next(iter(activated.values()))
    return cuda_platform_plugin() or "vllm.platforms.interface.UnspecifiedPlatform"


def resolve_obj_by_qualname(qualname):
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)
