"""The `cli` extra: rich (live view, tables) and matplotlib (plots), for demo, bench and report.

They stay out of the base install, so that `powerbatch serve` and the vLLM plugin (which depends
on powerbatch) do not pull them into every server environment. Commands that need them check
first and fail with an install hint rather than an ImportError halfway through a run.
"""

from __future__ import annotations

import importlib
from typing import Any

from powerbatch.errors import MissingExtra

CLI_MODULES = ("rich", "matplotlib")


def require_cli_extra(purpose: str, modules: tuple[str, ...] = CLI_MODULES) -> None:
    """Raise MissingExtra naming `purpose` unless every one of `modules` imports."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingExtra(
            f"{purpose} needs {' and '.join(missing)}, which powerbatch's `cli` extra installs: "
            "pip install 'powerbatch[cli]'"
        )


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: plots go to files, never to a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
