"""Every relative link in README.md and docs/*.md points at a file (or folder) that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and [label]: target; a target ends at whitespace or ')'.
_INLINE = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _targets(text: str) -> list[str]:
    text = _FENCE.sub("", text)  # code blocks are not links
    return _INLINE.findall(text) + _REFERENCE.findall(text)


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in _targets(doc.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL, mailto:, or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "dangling links:\n" + "\n".join(broken)


_SOURCE_DIRS = ("powerbatch", "plugins", "scripts", "tests", "docs", "deploy", "benchmarks")
_CODE_PATH = re.compile(r"`((?:" + "|".join(_SOURCE_DIRS) + r")/[\w./-]+\.\w+)`")


def test_repository_paths_named_in_docs_exist() -> None:
    """`powerbatch/...`, `docs/...` and the like, quoted as code, name files of this repository."""
    missing = []
    for doc in DOCS:
        for path in _CODE_PATH.findall(doc.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "docs name files that do not exist:\n" + "\n".join(missing)


_DOC_NAME = re.compile(r"(?<![\w/.-])docs/[\w-]+\.md")
# powerbatch/cli/options.py names docs/configuration.md (its reference is docs/operations.md);
# the lead, who owns that file, fixes it: drop the entry then.
_PENDING: set[tuple[str, str]] = set()


def test_docs_named_in_code_exist() -> None:
    """Code, scripts and build files that point readers at docs/<page>.md point at a real page."""
    files = [ROOT / "Makefile", ROOT / "Dockerfile", ROOT / "docker-compose.yml"]
    for top in ("powerbatch", "plugins", "scripts", "benchmarks", "load_tests", "deploy"):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh", ".toml", ".yml")]
    missing = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for name in set(_DOC_NAME.findall(path.read_text(errors="replace"))):
            if not (ROOT / name).exists() and (rel, name) not in _PENDING:
                missing.append(f"{rel}: {name}")
    assert not missing, "references to docs that do not exist:\n" + "\n".join(missing)
