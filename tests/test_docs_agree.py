"""Numbers the operator docs state that the code decides: each is read from the doc and compared."""

from __future__ import annotations

import re
from pathlib import Path

from powerbatch.control import ControlConfig

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
