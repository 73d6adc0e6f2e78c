"""Dependencies point one way: each package imports (at module level) only from layers below it.

Imports inside functions and under `if TYPE_CHECKING:` are not counted: they are how a layer
reaches up lazily or for types alone. Top-level modules (errors, settings, sse) are the bottom.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "base" is the top-level modules (errors, settings, sse). The tools: sim (a GPU that telemetry
# reads, itself a power source) sits just above telemetry, load (a client) beside proxy.
LAYERS = [
    {"base"},
    {"telemetry", "estimate"},
    {"sim"},
    {"control"},
    {"admission", "shape", "energy", "fleet"},
    {"proxy", "plugin", "load"},
    {"cli"},
]
RANK = {pkg: rank for rank, layer in enumerate(LAYERS) for pkg in layer}


def package(module: str) -> str | None:
    """`powerbatch.control.loop` -> control; the plugin is one package, `python -m` is cli's."""
    parts = module.split(".")
    if parts[0] == "powerbatch_vllm":
        return "plugin"
    if parts[0] != "powerbatch" or len(parts) == 1:
        return None
    if parts[1] == "__main__":
        return "cli"
    return "base" if (ROOT / "powerbatch" / f"{parts[1]}.py").exists() else parts[1]


def imports(tree: ast.AST, anchor: str) -> list[str]:
    """The modules `tree` imports when loaded; `anchor` is the package relative imports name."""
    out: list[str] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += [m for child in node.orelse for m in imports(child, anchor)]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = anchor.rsplit(".", node.level - 1)[0] + "." if node.level else ""
            name = base + (node.module or "")
            out += [f"{name}.{a.name}" for a in node.names] if name == "powerbatch" else [name]
        else:
            out += imports(node, anchor)
    return out


def edges() -> list[tuple[str, str]]:
    found = []
    for top in (ROOT / "powerbatch", ROOT / "plugins/vllm/powerbatch_vllm"):
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(top.parent).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            anchor = module if parts[-1] == "__init__" else module.rpartition(".")[0]
            found += [(module, m) for m in imports(ast.parse(path.read_text()), anchor)]
    return found


def test_every_import_points_down_a_layer_and_packages_have_no_cycles() -> None:
    bad: list[str] = []
    graph: dict[str, set[str]] = {}
    for module, target in edges():
        src, dst = package(module), package(target)
        if src is None or dst is None or src == dst:
            continue
        graph.setdefault(src, set()).add(dst)
        if RANK.get(dst, len(LAYERS)) >= RANK.get(src, -1):
            bad.append(f"{module} -> {target}  ({src} may not import {dst})")
    try:
        TopologicalSorter(graph).prepare()
        cycle = ""
    except CycleError as exc:
        cycle = "package cycle: " + " -> ".join(exc.args[1])
    assert not bad and not cycle, "\n".join([*bad, cycle])
