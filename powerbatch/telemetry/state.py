"""Crash recovery for the device actuators: the state file that says a device setting is changed.

A power limit or a locked SM clock outlives the process that set it (until reset or a driver
reload: NVML's nvmlDeviceSetPowerManagementLimit and nvmlDeviceSetGpuLockedClocks). So before
its first change an actuator writes a record (atomically, owner-only); `restore()` puts the
device back and removes it; a process that dies leaves it, and the next start restores first.
The limiter (telemetry/limiter.py) and the clock (telemetry/clock.py) share this file's code and
its naming (`DeviceState`); what each restores, and what a corrupt record means, is theirs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from powerbatch.errors import PowerbatchError
from powerbatch.telemetry.gpu_ids import GpuId

__all__ = ["DeviceState", "StateFile", "default_state_dir"]


def default_state_dir() -> Path:
    """$XDG_RUNTIME_DIR/powerbatch (per user, cleared at logout or reboot, as limits are at driver
    reload), else /tmp/powerbatch-<uid>."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "powerbatch"
    return Path(tempfile.gettempdir()) / f"powerbatch-{os.getuid()}"


class StateFile:
    """The record: present exactly while a setting powerbatch changed may be in force. Every
    failure is raised as `error`, the owning actuator's error class."""

    def __init__(self, path: Path, error: type[PowerbatchError], corrupt_hint: str = "") -> None:
        self.path = path
        self.error = error
        self.corrupt_hint = corrupt_hint  # what an operator does about a corrupt record

    def exists(self) -> bool:
        return self.path.exists()

    def read(self) -> dict[str, Any] | None:
        """The record, None if there is none; `error` if it cannot be trusted."""
        try:
            text = self.path.read_text()
        except (FileNotFoundError, NotADirectoryError):  # nothing there, or nothing could be
            return None
        except OSError as exc:
            raise self.error(f"cannot read the state file {self.path}: {exc}") from exc
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise self.error(
                f"the state file {self.path} is corrupt ({exc}){self.corrupt_hint}"
            ) from exc
        if not isinstance(record, dict):
            raise self.error(f"the state file {self.path} is not a JSON object")
        return record

    def write(self, record: dict[str, Any]) -> None:
        """Atomically (rename), owner-only; a device is never changed without this record."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            raise self.error(
                f"cannot write the state file {self.path} ({exc}); refusing to change the device "
                "without a way to restore it after a crash (set limit_state_dir)"
            ) from exc

    def mark(self, **record: Any) -> None:
        """Write `record`, with this process's pid and the time, unless one is there already:
        the first change's record says what to restore."""
        if not self.exists():
            self.write({**record, "pid": os.getpid(), "written_unix_s": time.time()})

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class DeviceState:
    """One actuator's GPU set, its name (`tag:ids`) and its state file,
    `<state_dir>/<kind>-<tag>-<ids>.json`: the same GPUs and backend always find the same file."""

    def __init__(
        self,
        gpu_ids: Sequence[GpuId],
        *,
        kind: str,
        tag: str,
        state_dir: str | Path | None,
        error: type[PowerbatchError],
        corrupt_hint: str = "",
    ) -> None:
        if not gpu_ids:
            raise ValueError("gpu_ids must name at least one GPU")
        if len(set(gpu_ids)) != len(gpu_ids):
            raise ValueError(f"gpu_ids has duplicates: {list(gpu_ids)}")
        self.gpu_ids: tuple[GpuId, ...] = tuple(
            i if isinstance(i, str) else int(i) for i in gpu_ids
        )
        self.name = f"{tag}:{','.join(map(str, self.gpu_ids))}"
        directory = Path(state_dir) if state_dir is not None else default_state_dir()
        ids = "_".join(map(str, self.gpu_ids))
        clean = re.sub(r"[^A-Za-z0-9.]+", "_", tag).strip("_")
        self.file = StateFile(directory / f"{kind}-{clean}-{ids}.json", error, corrupt_hint)
