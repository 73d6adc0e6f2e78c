"""What the users need from the server before they start: its key, its model, its context.

Kept free of locust (which monkey-patches the process with gevent on import) so tests can run
it in-process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import requests


class StartupError(RuntimeError):
    """The server cannot be used as configured; the message says which setting to change."""


def auth_headers(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`Authorization: Bearer $PB_API_KEY` when PB_API_KEY is set (a proxy with --api-keys, or
    vLLM with --api-key, answers 401 without it)."""
    key = env.get("PB_API_KEY", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def discover(host: str, env: Mapping[str, str] = os.environ) -> tuple[str, int]:
    """(model, max_model_len) from PB_MODEL / PB_MAX_MODEL_LEN, else from the server's
    /v1/models (the proxy passes it on). A 401 or 403 is reported as what it is, naming
    PB_API_KEY, not as a missing model name."""
    model = env.get("PB_MODEL")
    max_len = env.get("PB_MAX_MODEL_LEN")
    if model and max_len:
        return model, int(max_len)
    url = host.rstrip("/") + "/v1/models"
    try:
        resp = requests.get(url, headers=auth_headers(env), timeout=10)
    except requests.RequestException as exc:
        raise StartupError(f"cannot reach {url}: {exc}") from exc
    if resp.status_code in (401, 403):
        given = "the key in PB_API_KEY was refused" if auth_headers(env) else "PB_API_KEY is unset"
        raise StartupError(
            f"{url} answered {resp.status_code}: the server wants an API key and {given}; "
            "set PB_API_KEY to a key it accepts"
        )
    try:
        resp.raise_for_status()
        data = resp.json()["data"][0]
        model = model or str(data["id"])
        max_len = max_len or str(data.get("max_model_len") or 8192)
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as exc:
        raise StartupError(f"cannot read the model from {url}; set PB_MODEL: {exc}") from exc
    return model, int(max_len)
