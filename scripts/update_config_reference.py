"""Regenerate the settings tables in docs/operations.md and docs/vllm-plugin.md from the code."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "plugins" / "vllm"))

from powerbatch_vllm.config import PLUGIN  # noqa: E402

from powerbatch.cli.settings import SERVE  # noqa: E402
from powerbatch.settings import reference_markdown  # noqa: E402

PATTERN = r"(<!-- BEGIN config-reference[^\n]*-->\n).*?(<!-- END config-reference -->)"
for name, surface in (("operations.md", SERVE), ("vllm-plugin.md", PLUGIN)):
    doc = ROOT / "docs" / name
    table = reference_markdown(surface)
    doc.write_text(re.sub(PATTERN, lambda m, t=table: m[1] + t + m[2], doc.read_text(), flags=re.S))
