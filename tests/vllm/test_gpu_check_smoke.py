"""scripts/gpu_check.py in smoke mode: the code path a lent GPU will run once, on a CPU.

Device time is too scarce to find a typo there, so both halves run here: the CLI end to end
(tiny Llama on the CPU, no NVML) as a subprocess, and the NVML half in process against a fake
pynvml (the real one's constants and error class, fake calls), as tests/test_telemetry_nvml.py
does. Lives in tests/vllm because only .venv-vllm has torch and transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
FAKE_W = 300.0


def _run_smoke(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    args = ["--out", str(out), "--device", "cpu", "--tiny", *extra]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _decode_rows(report: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    return [r for r in report["rows"] if r["kind"] == "decode" and r["mode"] == mode]


def test_smoke_mode_writes_the_table(tmp_path: Path) -> None:
    proc = _run_smoke(tmp_path, "--no-nvml")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| decode-b4-eager | ok |" in proc.stdout

    report = json.loads((tmp_path / "power_vs_batch.json").read_text())
    assert report["meta"]["cache_mode"] == "fixed"
    assert report["checks"]["fixed_context_cache"]["ok"] is True
    eager = _decode_rows(report, "eager")
    assert [r["batch"] for r in eager] == [1, 4]
    for row in eager:
        assert row["status"] == "ok", row
        assert row["steps"] > 0 and row["seconds"] > 0
        assert row["tok_s"] > 0 and row["steps_per_s"] > 0
        assert row["step_ms_p50"] > 0
        assert row["power_w_mean"] is None and row["energy_j"] is None
    (prefill,) = [r for r in report["rows"] if r["kind"] == "prefill"]
    assert prefill["status"] == "ok" and prefill["tok_s"] > 0
    graph = _decode_rows(report, "graph")
    assert [r["status"] for r in graph] == ["skipped", "skipped"]
    names = {c["name"] for c in report["comparison"]}
    assert {"decode-b1-eager", "decode-b4-eager", prefill["name"]} <= names
    for entry in report["comparison"]:
        assert entry["h200-decode-light_w"] > 0 and entry["h100-llama8b_w"] > 0

    nvml = json.loads((tmp_path / "gpu_check.json").read_text())
    assert nvml["nvml"]["available"] is False
    assert "| row |" in (tmp_path / "power_vs_batch.md").read_text()
    assert len(list(tmp_path.iterdir())) <= 8  # what comes back from the device


def test_budget_stops_the_sweep_and_says_so(tmp_path: Path) -> None:
    proc = _run_smoke(tmp_path, "--no-nvml", "--batches", "1,2,4", "--total-budget-s", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "power_vs_batch.json").read_text())
    eager = _decode_rows(report, "eager")
    assert [r["status"] for r in eager] == ["skipped"] * 3
    assert all("budget" in r["note"] for r in eager)


def _fake_nvml() -> Any:
    """pynvml's constants and NVMLError; fake calls at a steady FAKE_W, energy to match."""
    import pynvml

    module: Any = types.ModuleType("fake_pynvml")
    for name in dir(pynvml):
        if name.startswith(("NVML_", "NVMLError")):
            setattr(module, name, getattr(pynvml, name))
    t0 = time.monotonic()

    def field_values(handle: object, ids: list[tuple[int, int]]) -> Any:
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for i, (field_id, scope) in enumerate(ids):
            values[i].fieldId, values[i].scopeId = field_id, scope
            values[i].nvmlReturn = pynvml.NVML_SUCCESS
            values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            values[i].value.uiVal = int(FAKE_W * 1000)
        return values

    module.nvmlInit = module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda index: object()
    module.nvmlDeviceGetFieldValues = field_values
    module.nvmlDeviceGetPowerUsage = lambda h: int((FAKE_W - 10) * 1000)
    module.nvmlDeviceGetTotalEnergyConsumption = lambda h: int(
        5e6 + FAKE_W * 1000 * (time.monotonic() - t0)
    )
    module.nvmlDeviceGetPowerManagementLimitConstraints = lambda h: [200_000, 700_000]
    module.nvmlDeviceGetPowerManagementDefaultLimit = lambda h: 700_000
    module.nvmlDeviceGetPowerManagementLimit = lambda h: 700_000
    module.nvmlDeviceGetEnforcedPowerLimit = lambda h: 650_000
    return module


def test_nvml_half_against_a_fake_pynvml(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check
    try:
        spec.loader.exec_module(gpu_check)
        argv = ["--out", str(tmp_path), "--device", "cpu", "--tiny", "--batches", "2"]
        argv += ["--seconds-per-batch", "0.6", "--prefill-seconds", "0.3", "--no-cuda-graphs"]
        assert gpu_check.main(argv, nvml=_fake_nvml()) == 0
    finally:
        del sys.modules[spec.name]

    nvml = json.loads((tmp_path / "gpu_check.json").read_text())["nvml"]
    assert nvml["available"] is True
    assert nvml["instant_field_186_in_use"] is True
    assert nvml["averaged_source_uses_field_186"] is False
    assert nvml["first_reading"]["instant_w"] == FAKE_W
    assert nvml["first_reading"]["averaged_w"] == FAKE_W - 10
    for kind in ("instant", "averaged"):
        latency = nvml["read_latency"][kind]
        assert latency["n"] == 20 and 0 < latency["p50_us"] <= latency["p99_us"]
    idle = nvml["idle_energy_check"]
    assert idle["n_samples"] >= 3 and idle["power_w_mean"] == FAKE_W
    assert idle["energy_to_power_x_time"] == pytest.approx(1.0, abs=0.05)
    assert nvml["limits_w"]["constraints_max"] == 700.0
    assert nvml["limits_w"]["enforced"] == 650.0

    report = json.loads((tmp_path / "power_vs_batch.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["idle-no-cuda"]["power_w_mean"] == FAKE_W
    decode = rows["decode-b2-eager"]
    assert decode["status"] == "ok" and decode["n_samples"] >= 3
    assert decode["power_w_p5"] == decode["power_w_p95"] == FAKE_W
    assert decode["power_avg_api_w_mean"] == FAKE_W - 10
    assert decode["energy_to_power_x_time"] == pytest.approx(1.0, abs=0.05)
    expected_j_per_token = decode["energy_j"] / (2 * decode["steps"])
    assert decode["j_per_token"] == pytest.approx(expected_j_per_token, rel=1e-3)
    comparison = {c["name"]: c for c in report["comparison"]}
    assert comparison["decode-b2-eager"]["ratio_h200-decode-light"] > 0
    samples = (tmp_path / "power_samples.csv").read_text().splitlines()
    assert samples[0] == "t_s,tag,instant_w,averaged_w,energy_j"
    assert any(",decode-b2-eager:measure," in line for line in samples)
