"""powerbatch inside vLLM: the proxy's controller, applied by the engine's own scheduler.

Importing this package never imports vLLM; only `powerbatch_vllm.scheduler` does, so the pure
parts (configuration, limit mapping, version check) are usable and testable without it.
"""

from powerbatch_vllm.compat import SUPPORTED_VLLM, UnsupportedVllmVersion, check_vllm_version
from powerbatch_vllm.config import PluginConfig, load_config

__all__ = [
    "SUPPORTED_VLLM",
    "PluginConfig",
    "UnsupportedVllmVersion",
    "check_vllm_version",
    "load_config",
]
__version__ = "0.1.0"
