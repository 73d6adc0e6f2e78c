"""`-m vllm` tests need the CPU build of vLLM from scripts/setup_vllm_cpu.sh; elsewhere they skip.

Helpers live in vllm_harness.py (imported by name: this folder has no __init__.py on purpose,
so that it can never shadow the real `vllm` package).
"""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm.v1") is not None:
        return
    skip = pytest.mark.skip(
        reason="needs vLLM: run scripts/setup_vllm_cpu.sh, then .venv-vllm/bin/pytest -m vllm"
    )
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
