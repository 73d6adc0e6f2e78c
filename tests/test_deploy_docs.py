"""The docs cannot drift from the code: the settings tables are the generated ones."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from powerbatch.cli.main import build_parser
from powerbatch.cli.settings import SERVE
from powerbatch.settings import Surface, reference_markdown

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "vllm"))
from powerbatch_vllm.config import PLUGIN  # noqa: E402

OPERATIONS = ROOT / "docs" / "operations.md"
PLUGIN_DOC = ROOT / "docs" / "vllm-plugin.md"
BEGIN = re.compile(r"<!-- BEGIN config-reference[^>]*-->\n")
END = "<!-- END config-reference -->"


def documented_table(doc: Path = OPERATIONS) -> str:
    text = doc.read_text()
    begin = BEGIN.search(text)
    assert begin, f"{doc.name} lacks the config-reference markers"
    end = text.index(END, begin.end())
    return text[begin.end() : end]


@pytest.mark.parametrize(("doc", "surface"), [(OPERATIONS, SERVE), (PLUGIN_DOC, PLUGIN)])
def test_config_reference_in_docs_equals_the_generated_one(doc: Path, surface: Surface) -> None:
    assert documented_table(doc) == reference_markdown(surface), (
        f"docs/{doc.name} is stale: run `python scripts/update_config_reference.py`"
    )


def test_config_reference_covers_every_serve_flag() -> None:
    table = documented_table()
    for f in SERVE.fields:
        assert f"`{SERVE.flag(f)}`" in table and f"`{SERVE.env(f)}`" in table
    assert "POWERBATCH_CONFIG" in OPERATIONS.read_text()


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[name]
            assert isinstance(sub, argparse.ArgumentParser)
            return sub
    raise AssertionError("no subcommands")


def test_operations_doc_names_every_sim_flag() -> None:
    text = OPERATIONS.read_text()
    for action in _subparser("sim")._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}`" in text, f"docs/operations.md lacks sim flag {option}"
