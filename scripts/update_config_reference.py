"""Regenerate the configuration table in docs/operations.md from the code."""

import re
from pathlib import Path

from powerbatch.cli.options import reference_markdown

doc = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
text = doc.read_text()
pattern = r"(<!-- BEGIN config-reference[^\n]*-->\n).*?(<!-- END config-reference -->)"
doc.write_text(re.sub(pattern, lambda m: m[1] + reference_markdown() + m[2], text, flags=re.S))
