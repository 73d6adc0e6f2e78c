"""Dependencies: what is imported is declared, and the server paths stay free of the `cli` extra.

rich and matplotlib (the `cli` extra) are only for demo, bench and their plots. The proxy and
the vLLM plugin, which every vLLM environment installs, must not import them, or they would have
to be installed there too.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_EXTRA = ("rich", "matplotlib")
# Modules the server side imports: the proxy (through the CLI's parser, as `powerbatch serve`
# runs), the controller, and every plugin module that imports without vLLM.
SERVER_SIDE = (
    "powerbatch.cli.serve",
    "powerbatch.control",
    "powerbatch.cli.main",
    "powerbatch_vllm",
    "powerbatch_vllm.compat",
    "powerbatch_vllm.config",
    "powerbatch_vllm.control",
    "powerbatch_vllm.engine",
    "powerbatch_vllm.metrics",
    "powerbatch_vllm.plugin",
)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_server_side_imports_neither_rich_nor_matplotlib() -> None:
    code = f"""
import importlib, json, sys
for name in {SERVER_SIDE!r}:
    importlib.import_module(name)
import powerbatch.cli.main
powerbatch.cli.main.build_parser()  # what `powerbatch serve` runs first
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {CLI_EXTRA!r})))
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_demo_and_bench_without_the_cli_extra_say_what_to_install() -> None:
    for command in ("demo", "bench"):
        code = f"""
import sys
sys.modules["rich"] = None  # as if not installed
sys.modules["matplotlib"] = None
from powerbatch.cli.main import main
sys.exit(main([{command!r}, "--duration-s", "1", "--out", "/nonexistent/should-not-be-made"]))
"""
        out = _python(code)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "pip install 'powerbatch[cli]'" in out.stderr
        assert "rich and matplotlib" in out.stderr and "Traceback" not in out.stderr


def _top_level_imports(path: Path) -> set[str]:
    """Top-level packages imported at module level (not in functions or TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("-", "_") for r in reqs}


def test_module_level_imports_are_base_dependencies() -> None:
    """Eagerly imported third-party packages must be in the base install (scipy was not)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"])
    dist_of = {"prometheus_client": "prometheus_client", "pynvml": "nvidia_ml_py"}
    stdlib = set(sys.stdlib_module_names) | {"__future__", "powerbatch"}
    undeclared = {}
    for path in sorted((ROOT / "powerbatch").rglob("*.py")):
        for module in _top_level_imports(path) - stdlib:
            if dist_of.get(module, module) not in declared:
                undeclared[module] = str(path.relative_to(ROOT))
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"
    assert not (_requirement_names(project["dependencies"]) & set(CLI_EXTRA))
    assert set(CLI_EXTRA) <= _requirement_names(project["optional-dependencies"]["cli"])
