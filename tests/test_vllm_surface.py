"""The source check of the scheduler hooks (powerbatch_vllm.surface): it reads a wheel without
installing it and fails when a hook the plugin overrides, wraps or reads changes."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
from powerbatch_vllm.surface import BASELINE, differences, main, surface

_SCHED = """
class Scheduler(SchedulerInterface):
    def __init__(self, vllm_config: VllmConfig, block_size: int) -> None:
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.max_num_active_reqs = 8
        self.max_num_scheduled_tokens: int = 2048
        self.kv_cache_manager = KVCacheManager()
        self.running: list[Request] = []
        self.requests = {}
        self.block_size = block_size
        self.num_spec_tokens = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        budget = self.max_num_scheduled_tokens
        if len(self.running) >= self.max_num_active_reqs:
            return None
        for request in self.waiting:
            self.kv_cache_manager.allocate_slots(request, budget, num_lookahead_tokens=0)

    def update_from_output(self, scheduler_output, model_runner_output) -> dict:
        return {}

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), 0

    def shutdown(self) -> None:
        pass
"""
_FILES = {
    "vllm/v1/core/sched/scheduler.py": _SCHED,
    "vllm/v1/core/sched/async_scheduler.py": (
        "class AsyncScheduler(Scheduler):\n"
        "    def __init__(self, *args, **kwargs) -> None:\n"
        "        super().__init__(*args, **kwargs)\n"
    ),
    "vllm/v1/core/sched/output.py": (
        "@dataclass\nclass NewRequestData:\n    req_id: str\n\n"
        "@dataclass\nclass SchedulerOutput:\n    scheduled_new_reqs: list\n"
        "    num_scheduled_tokens: dict[str, int]\n    finished_req_ids: set[str]\n"
    ),
    "vllm/v1/core/kv_cache_manager.py": (
        "class KVCacheManager:\n    def __init__(self):\n        self.block_pool = BlockPool()\n"
        "    def allocate_slots(self, request: Request, num_new_tokens: int, "
        "num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:\n        return None\n"
    ),
    "vllm/v1/core/block_pool.py": (
        "class BlockPool:\n    def __init__(self, num_gpu_blocks: int):\n"
        "        self.num_gpu_blocks = num_gpu_blocks\n"
        "    def get_num_free_blocks(self) -> int:\n        return 0\n"
    ),
    "vllm/v1/request.py": (
        "class Request:\n    def __init__(self, request_id, priority=0):\n"
        "        self.request_id = request_id\n        self.priority = priority\n"
        "        self.status = RequestStatus.WAITING\n        self.arrival_time = 0.0\n"
        "        self.num_prompt_tokens = 1\n        self.max_tokens = 1\n"
        "        self.num_computed_tokens = 0\n"
        "    @property\n    def num_output_tokens(self) -> int:\n        return 0\n"
        "    def is_finished(self) -> bool:\n        return False\n\n"
        "class RequestStatus(enum.IntEnum):\n    WAITING = enum.auto()\n"
        "    RUNNING = enum.auto()\n    PREEMPTED = enum.auto()\n"
    ),
}


def _wheel(tmp_path: Path, name: str, **changed: str) -> Path:
    path = tmp_path / f"{name}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for file, text in {**_FILES, **changed}.items():
            z.writestr(file, text)
    return path


def test_an_unchanged_release_passes_and_every_changed_hook_is_named(tmp_path: Path) -> None:
    base = tmp_path / "surface.json"
    assert main([str(_wheel(tmp_path, "tested")), "--write", "--baseline", str(base)]) == 0
    want = json.loads(base.read_text())
    assert want["schedule_reads"] == [
        "self.max_num_active_reqs",
        "self.max_num_scheduled_tokens",
        "self.kv_cache_manager.allocate_slots(request, ...)",
    ]
    cosmetic = _SCHED.replace("return {}", "return {'x': 1}")  # a body edit is no hook change
    assert main([str(_wheel(tmp_path, "same", **{_key(): cosmetic})), "--baseline", str(base)]) == 0

    sched = "vllm/v1/core/sched/scheduler.py"
    cases = {
        "add_request": {
            sched: _SCHED.replace(
                "add_request(self, request: Request)",
                "add_request(self, request: Request, arrival: float)",
            )
        },
        "max_num_active_reqs": {
            sched: _SCHED.replace("self.max_num_active_reqs = 8", "self.max_active = 8")
        },
        "schedule_reads": {
            sched: _SCHED.replace(
                "if len(self.running) >= self.max_num_active_reqs",
                "if len(self.running) >= self.limit",
            )
        },
        "allocate_slots": {
            sched: _SCHED.replace(
                "allocate_slots(request, budget", "allocate_slots(budget, request"
            )
        },
        "async_scheduler": {
            "vllm/v1/core/sched/async_scheduler.py": _FILES["vllm/v1/core/sched/async_scheduler.py"]
            + "    def schedule(self) -> SchedulerOutput:\n        return None\n"
        },
        "PREEMPTED": {
            "vllm/v1/request.py": _FILES["vllm/v1/request.py"].replace("PREEMPTED", "SWAPPED")
        },
        "finished_req_ids": {
            "vllm/v1/core/sched/output.py": _FILES["vllm/v1/core/sched/output.py"].replace(
                "finished_req_ids", "finished_ids"
            )
        },
    }
    for what, change in cases.items():
        got = surface(_wheel(tmp_path, what, **change))
        lines = differences(got, want)
        assert lines and any(what in line for line in lines), (what, lines)
        assert main([str(_wheel(tmp_path, what, **change)), "--baseline", str(base)]) == 1


def test_a_wheel_without_the_scheduler_is_no_pass(tmp_path: Path) -> None:
    path = tmp_path / "empty.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
    assert main([str(path)]) == 2


def _key() -> str:
    return "vllm/v1/core/sched/scheduler.py"


def _real_sources() -> list[Path]:
    """A vLLM wheel named by POWERBATCH_VLLM_WHEEL (CI downloads one), and the CPU build's
    tree where `make vllm-setup` made it."""
    out = []
    wheel = os.environ.get("POWERBATCH_VLLM_WHEEL")
    if wheel:
        out.append(Path(wheel))
    for venv in (Path(".venv-vllm"), Path(__file__).parents[1] / ".venv-vllm"):
        out += sorted(venv.glob("lib/python3*/site-packages"))
    found = [p.resolve() for p in out if p.exists() and (p.is_file() or (p / "vllm").is_dir())]
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("source", _real_sources() or [None])
def test_the_real_vllm_has_the_tested_surface(source: Path | None) -> None:
    if source is None:
        pytest.skip("no vLLM wheel or tree here (CI sets POWERBATCH_VLLM_WHEEL)")
    assert differences(surface(source), json.loads(BASELINE.read_text())) == []
