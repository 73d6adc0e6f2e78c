"""powerbatch.errors holds the exception tree: every exception class of the package is in it.

Walks every module of powerbatch (and of the vLLM plugin, where vLLM is not needed to import it),
finds the Exception subclasses defined there, and checks each one derives from PowerbatchError
and stands in errors.py's docstring tree under its nearest PowerbatchError base.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from types import ModuleType

import powerbatch_vllm

import powerbatch
from powerbatch import errors
from powerbatch.errors import PowerbatchError

# Import only inside vLLM (they subclass its scheduler); they define no exception.
NEEDS_VLLM = {"powerbatch_vllm.scheduler"}
_TREE_LINE = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>_?[A-Z]\w*)\b")


def _modules(package: ModuleType) -> list[ModuleType]:
    out = [package]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith(".__main__") or info.name in NEEDS_VLLM:
            continue  # __main__ runs the CLI
        out.append(importlib.import_module(info.name))
    return out


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in _modules(powerbatch) + _modules(powerbatch_vllm):
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                found[name] = obj
    return found


def _tree() -> dict[str, str | None]:
    """Each class named in the docstring's tree -> the class it hangs under (None: the root)."""
    doc = errors.__doc__ or ""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        line = line[4:] if line.startswith("    ") else line
        m = _TREE_LINE.match(line)
        if not m or not (set(m.group("indent")) <= set(" │├└─")):
            continue
        if m.group("indent") == "" and m.group("name") != "PowerbatchError":
            continue  # prose, not the tree
        depth = len(m.group("indent"))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[m.group("name")] = stack[-1][1] if stack else None
        stack.append((depth, m.group("name")))
    return parents


def test_every_exception_is_a_powerbatch_error_in_the_tree() -> None:
    classes = _exception_classes()
    assert {"Rejected", "BadRequest", "ApiError", "ConfigError"} <= set(classes)
    outside = sorted(n for n, c in classes.items() if not issubclass(c, PowerbatchError))
    assert not outside, f"exceptions outside the PowerbatchError tree: {outside}"
    tree = _tree()
    missing = sorted(set(classes) - set(tree))
    assert not missing, f"errors.py's docstring tree lacks {missing}"
    for name, cls in classes.items():
        if cls is PowerbatchError:
            continue
        (base,) = [b for b in cls.__bases__ if issubclass(b, PowerbatchError)]
        assert tree[name] == base.__name__, f"{name} hangs under {tree[name]}, not {base}"
    stale = sorted(set(tree) - set(classes))
    assert not stale, f"errors.py's tree names classes that do not exist: {stale}"
