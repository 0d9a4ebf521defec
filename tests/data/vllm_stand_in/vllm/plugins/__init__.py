"""vLLM's plugin loading: every entry point of a group, filtered by VLLM_PLUGINS when it is set."""
import logging
from importlib.metadata import entry_points

import vllm.envs as envs

logger = logging.getLogger(__name__)

PLATFORM_PLUGINS_GROUP = "vllm.platform_plugins"


def load_plugins_by_group(group):
    allowed_plugins = envs.VLLM_PLUGINS
    plugins = {}
    for plugin in entry_points(group=group):
        if allowed_plugins is None or plugin.name in allowed_plugins:
            try:
                plugins[plugin.name] = plugin.load()
            except Exception:
                logger.exception("Failed to load plugin %s", plugin.name)
    return plugins
