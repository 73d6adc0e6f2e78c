"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts.

Nothing needs registering for `--scheduler-cls` (vLLM imports the class by name); what this does
is fail fast, in the API server before the engine starts, on an unsupported vLLM or bad settings,
and only when the powerbatch scheduler is actually in use.
"""

from __future__ import annotations

import logging
import os
import sys

from powerbatch_vllm.compat import check_vllm_version, installed_vllm_version
from powerbatch_vllm.config import ENV_PREFIX, load_config

log = logging.getLogger("vllm.powerbatch")


def _in_use(argv: list[str], environ: dict[str, str]) -> bool:
    """True when a powerbatch scheduler is named on the command line or settings are set."""
    if any(a.startswith("powerbatch_vllm.") for a in argv):
        return True
    return any(k.startswith(ENV_PREFIX) for k in environ)


def register() -> None:
    """Validate early; a no-op in processes and servers that do not use the plugin."""
    if not _in_use(sys.argv, dict(os.environ)):
        return
    check_vllm_version(installed_vllm_version())
    cfg = load_config()
    log.info(
        "powerbatch-vllm ready: ceiling %.0f W, power source %s, mode %s",
        cfg.control.ceiling_w,
        cfg.power.power_source,
        cfg.control.mode,
    )
