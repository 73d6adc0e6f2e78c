"""docs/operations.md cannot drift from the code: the settings table is the generated one."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from powerbatch.cli.main import build_parser
from powerbatch.cli.options import SERVE_OPTIONS, reference_markdown

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BEGIN = re.compile(r"<!-- BEGIN config-reference[^>]*-->\n")
END = "<!-- END config-reference -->"


def documented_table() -> str:
    text = OPERATIONS.read_text()
    begin = BEGIN.search(text)
    assert begin, "docs/operations.md lacks the config-reference markers"
    end = text.index(END, begin.end())
    return text[begin.end() : end]


def test_config_reference_in_docs_equals_the_generated_one() -> None:
    assert documented_table() == reference_markdown(), (
        "docs/operations.md is stale: replace the table between the config-reference markers "
        "with the output of `powerbatch config-reference`"
    )


def test_config_reference_covers_every_serve_flag() -> None:
    table = documented_table()
    for opt in SERVE_OPTIONS:
        assert f"`{opt.flag}`" in table and f"`{opt.env}`" in table and f"`{opt.name}`" in table
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
