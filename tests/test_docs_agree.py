"""Numbers the operator docs state that the code decides: each is read from the doc and compared."""

from __future__ import annotations

import re
from pathlib import Path

from powerbatch.control import ControlConfig
from powerbatch.sim.gpu_model import DEFAULT_PROFILE, PROFILES, steady_state

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"


def test_operations_doc_states_the_codes_default_margin() -> None:
    text = OPERATIONS.read_text()
    stated = [
        float(x)
        for x in re.findall(r"`margin_w` defaults to ([\d.]+) %", text)
        + re.findall(r"`ceiling − margin_w` \(([\d.]+) % by default\)", text)
    ]
    assert len(stated) == 2, "the doc's two statements of the default margin moved"
    code_pct = 100 * ControlConfig(ceiling_w=1000.0).margin / 1000.0
    assert stated == [code_pct, code_pct]


def test_load_tests_readme_ceiling_is_one_the_simulator_can_hold() -> None:
    """A ceiling under the simulated GPU's power at small batches binds forever: every run
    would sit at --min-batch with queues growing (docs/operations.md, "Never below the floor")."""
    text = (ROOT / "load_tests" / "README.md").read_text()
    sim = re.search(r"^powerbatch sim\b(.*)$", text, re.M)
    serve = re.search(r"^powerbatch serve\b.*--ceiling-w ([\d.]+)", text, re.M)
    assert sim and serve, "the README's sim and serve commands moved"
    profile = re.search(r"--profile (\S+)", sim.group(1))
    gpu = PROFILES[profile.group(1) if profile else DEFAULT_PROFILE]
    ceiling_w = float(serve.group(1))
    assert ceiling_w > steady_state(gpu, 8).power_w
    assert ceiling_w >= 1.1 * steady_state(gpu, 1).power_w
