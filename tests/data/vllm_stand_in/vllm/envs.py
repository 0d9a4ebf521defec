"""vLLM's environment variables, read lazily on attribute access (as vllm.envs)."""
import os
from collections.abc import Callable
from typing import Any

environment_variables: dict[str, Callable[[], Any]] = {
    "VLLM_PLUGINS": lambda: None if "VLLM_PLUGINS" not in os.environ else os.environ["VLLM_PLUGINS"].split(","),
    "VLLM_BATCH_INVARIANT": lambda: bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0"))),
}


def __getattr__(name: str):
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
