"""Power limiters (NVML, zeusd, none), the crash-recovery file and the LimitActuator.

zeusd is a fake daemon over real HTTP on 127.0.0.1 with zeusd's paths, parameters and JSON (Zeus
repository, docs/zeusd/api.md); it refuses a limit outside the constraints with a 400 as zeusd
does, so a limiter that forgot to clamp fails here. NVML is the fake pynvml of
test_telemetry_nvml.py, which refuses out-of-range limits with INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from aiohttp import web
from conftest import run, serve
from test_telemetry_nvml import FakeGpu, fake_nvml

from powerbatch.control.device import DeviceLimit
from powerbatch.control.loop import ControlLoop
from powerbatch.errors import (
    ConfigError,
    LimiterPermissionDenied,
    LimiterTimeout,
    LimiterUnavailable,
    PowerLimitError,
    SensorReadError,
    SensorUnavailable,
)
from powerbatch.settings import flat
from powerbatch.telemetry.base import PowerSource
from powerbatch.telemetry.factory import limiter_kind, make_limiter
from powerbatch.telemetry.limiter import (
    LimitActuator,
    NoLimiter,
    NvmlLimiter,
    PowerLimiter,
    ZeusdLimiter,
    split_total_w,
)
from powerbatch.telemetry.nvml import holds_cap_sys_admin
from powerbatch.telemetry.settings import LimiterSettings
from powerbatch.telemetry.state import default_state_dir
from powerbatch.telemetry.zeusd import ZeusdPowerSource

# ---- a fake zeusd ---------------------------------------------------------------------------


@dataclass
class Gpu:
    limit_mw: int = 700_000
    min_mw: int = 200_000
    max_mw: int = 700_000
    power_mw: int = 300_000
    energy_mj: int | None = 5_000_000  # None: no trustworthy counter


@dataclass
class FakeZeusd:
    gpus: list[Gpu] = field(default_factory=lambda: [Gpu(), Gpu()])
    token: str | None = None
    set_status: int | None = None  # answer every set_power_limit with this status
    hang_s: float = 0.0  # sleep this long in set_power_limit
    groups: tuple[str, ...] = ("gpu-control", "gpu-read")
    sets: list[tuple[list[int], int]] = field(default_factory=list)  # every accepted set

    def app(self) -> web.Application:
        def ids(request: web.Request) -> list[int]:
            raw = request.query.get("gpu_ids")
            return list(range(len(self.gpus))) if raw is None else [int(x) for x in raw.split(",")]

        def auth(request: web.Request) -> None:
            if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
                raise web.HTTPUnauthorized(text="invalid token")

        async def discover(request: web.Request) -> web.StreamResponse:
            gpus = [
                {
                    "id": i,
                    "name": "NVIDIA H100 80GB HBM3",
                    "pci_address": f"0000:{i:02x}:00.0",
                    "cumulative_energy_available": g.energy_mj is not None,
                }
                for i, g in enumerate(self.gpus)
            ]
            return web.json_response(
                {
                    "gpus": gpus,
                    "cpus": [],
                    "enabled_api_groups": list(self.groups),
                    "auth_required": self.token is not None,
                }
            )

        async def get_limit(request: web.Request) -> web.StreamResponse:
            auth(request)
            return web.json_response(
                {str(i): {"power_limit_mw": self.gpus[i].limit_mw} for i in ids(request)}
            )

        async def constraints(request: web.Request) -> web.StreamResponse:
            auth(request)
            return web.json_response(
                {
                    str(i): {
                        "min_power_limit_mw": self.gpus[i].min_mw,
                        "max_power_limit_mw": self.gpus[i].max_mw,
                    }
                    for i in ids(request)
                }
            )

        async def set_limit(request: web.Request) -> web.StreamResponse:
            auth(request)
            assert request.query["block"] == "true"
            if self.hang_s:
                await asyncio.sleep(self.hang_s)
            if self.set_status is not None:
                return web.json_response(
                    {"errors": {"0": "NVML error: Unknown"}}, status=self.set_status
                )
            mw = int(request.query["power_limit_mw"])
            errors = {
                str(i): "NVML error: the argument is invalid"
                for i in ids(request)
                if not self.gpus[i].min_mw <= mw <= self.gpus[i].max_mw
            }
            if errors:
                return web.json_response({"errors": errors}, status=400)
            for i in ids(request):
                self.gpus[i].limit_mw = mw
            self.sets.append((ids(request), mw))
            return web.Response()

        async def power(request: web.Request) -> web.StreamResponse:
            auth(request)
            return web.json_response(
                {
                    "timestamp_ms": 1,
                    "power_mw": {str(i): self.gpus[i].power_mw for i in ids(request)},
                }
            )

        async def energy(request: web.Request) -> web.StreamResponse:
            auth(request)
            if any(self.gpus[i].energy_mj is None for i in ids(request)):
                raise web.HTTPBadRequest(text="no trustworthy energy counter")
            return web.json_response(
                {str(i): {"energy_mj": self.gpus[i].energy_mj} for i in ids(request)}
            )

        app = web.Application()
        app.router.add_get("/discover", discover)
        app.router.add_get("/gpu/get_power_limit", get_limit)
        app.router.add_get("/gpu/get_power_limit_constraints", constraints)
        app.router.add_post("/gpu/set_power_limit", set_limit)
        app.router.add_get("/gpu/get_power", power)
        app.router.add_get("/gpu/get_cumulative_energy", energy)
        return app


def with_zeusd(fake: FakeZeusd, body: Callable[[str], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        runner, url = await serve(fake.app())
        try:
            return await body(url)
        finally:
            await runner.cleanup()

    return run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- splitting and clamping -----------------------------------------------------------------


def test_split_is_even_and_clamped_per_gpu() -> None:
    constraints = [(200.0, 700.0), (200.0, 400.0)]
    assert split_total_w(1000.0, constraints) == [500.0, 400.0]
    assert split_total_w(100.0, constraints) == [200.0, 200.0]
    assert split_total_w(5000.0, constraints) == [700.0, 400.0]
    for bad in (0.0, -5.0, math.nan, math.inf):
        with pytest.raises(PowerLimitError):
            split_total_w(bad, constraints)


def test_zeusd_limiter_never_sets_outside_the_constraints(tmp_path: Path) -> None:
    fake = FakeZeusd(gpus=[Gpu(), Gpu(max_mw=400_000, limit_mw=400_000)])

    async def body(url: str) -> list[float]:
        limiter = ZeusdLimiter(url, [0, 1], state_dir=tmp_path)
        assert isinstance(limiter, PowerLimiter)
        await limiter.start()
        assert limiter.constraints_w() == [(200.0, 700.0), (200.0, 400.0)]
        in_force = [await limiter.set_total_w(w) for w in (5000.0, 100.0, 900.0)]
        await limiter.close()
        return in_force

    assert with_zeusd(fake, body) == [1100.0, 400.0, 850.0]
    for _, mw in fake.sets:
        assert 200_000 <= mw <= 700_000
    assert ([1], 400_000) in fake.sets and ([0, 1], 200_000) in fake.sets


def test_nvml_limiter_clamps_and_restores_the_device_default(tmp_path: Path) -> None:
    # GPU 1's limit was lowered by someone else before we started: restore goes to the default.
    gpus = [FakeGpu(), FakeGpu(limit_mw=500_000, max_mw=600_000, default_mw=600_000)]

    async def body() -> None:
        limiter = NvmlLimiter([0, 1], state_dir=tmp_path, nvml=fake_nvml(gpus))
        await limiter.start()
        assert limiter.default_w() == [700.0, 600.0]
        assert await limiter.set_total_w(2000.0) == pytest.approx(1300.0)  # 700 + clamped 600
        assert await limiter.set_total_w(10.0) == pytest.approx(400.0)  # both raised to 200
        assert limiter.state_file.exists()
        await limiter.restore()
        assert not limiter.state_file.exists()
        assert await limiter.limits_w() == [700.0, 600.0]
        assert limiter.changes_total == 3
        await limiter.close()

    run(body())


def test_nvml_start_under_a_lowered_limit_restores_the_device_default(tmp_path: Path) -> None:
    # No state file, and a lowered limit in force (left by a run whose state file was lost).
    gpus = [FakeGpu(limit_mw=300_000, default_mw=700_000)]

    async def body() -> None:
        limiter = NvmlLimiter([0], state_dir=tmp_path, nvml=fake_nvml(gpus))
        await limiter.start()
        assert not limiter.recovered and gpus[0].limit_mw == 300_000
        assert limiter.default_w() == [700.0]
        await limiter.set_total_w(400.0)
        await limiter.restore()
        assert gpus[0].limit_mw == 700_000
        await limiter.close()

    run(body())


def test_zeusd_crash_recovery_restores_the_device_default_not_a_recorded_cap(
    tmp_path: Path,
) -> None:
    # A state file written by a run that started under a lowered cap (and took it for the
    # default, as an older powerbatch did): recovery puts the device's default back.
    fake = FakeZeusd(gpus=[Gpu(limit_mw=250_000)])

    async def body(url: str) -> None:
        limiter = ZeusdLimiter(url, [0], state_dir=tmp_path)
        limiter.state_file.write({"backend": "zeusd", "gpu_ids": [0], "restore_w": [300.0]})
        await limiter.start()
        assert limiter.recovered and fake.gpus[0].limit_mw == 700_000
        assert limiter.default_w() == [700.0]
        await limiter.close()

    with_zeusd(fake, body)


# ---- crash recovery -------------------------------------------------------------------------


def test_zeusd_crash_recovery_restores_the_original_limits_first(tmp_path: Path) -> None:
    fake = FakeZeusd()

    async def body(url: str) -> None:
        crashed = ZeusdLimiter(url, [0, 1], state_dir=tmp_path)
        await crashed.start()
        await crashed.set_total_w(600.0)
        await crashed.close()  # dies without restore()
        assert [g.limit_mw for g in fake.gpus] == [300_000, 300_000]
        record = json.loads(crashed.state_file.path.read_text())
        assert record["restore_w"] == [700.0, 700.0] and record["gpu_ids"] == [0, 1]
        assert os.stat(crashed.state_file.path).st_mode & 0o077 == 0

        fresh = ZeusdLimiter(url, [0, 1], state_dir=tmp_path)
        await fresh.start()
        assert fresh.recovered
        assert [g.limit_mw for g in fake.gpus] == [700_000, 700_000]
        assert not fresh.state_file.exists()
        assert fresh.default_w() == [700.0, 700.0]  # the original, not the lowered limit
        await fresh.close()

    with_zeusd(fake, body)


def test_nvml_crash_recovery_restores_the_device_default(tmp_path: Path) -> None:
    gpus = [FakeGpu(default_mw=650_000, limit_mw=650_000)]

    async def body() -> None:
        crashed = NvmlLimiter([0], state_dir=tmp_path, nvml=fake_nvml(gpus))
        await crashed.start()
        await crashed.set_total_w(250.0)
        assert gpus[0].limit_mw == 250_000
        fresh = NvmlLimiter([0], state_dir=tmp_path, nvml=fake_nvml(gpus))
        await fresh.start()
        assert fresh.recovered and gpus[0].limit_mw == 650_000
        assert not fresh.state_file.exists()
        await fresh.restore()  # nothing changed since: no write
        assert fresh.changes_total == 1

    run(body())


def test_nvml_limiter_can_restore_the_previous_limits_after_a_crash_too(tmp_path: Path) -> None:
    # serve's hardware backstop: what was set before it, not the default, goes back.
    gpus = [FakeGpu(limit_mw=650_000, default_mw=700_000), FakeGpu(limit_mw=600_000)]

    async def body() -> None:
        limiter = NvmlLimiter(
            [0, 1], state_dir=tmp_path, nvml=fake_nvml(gpus), restore_to="previous"
        )
        await limiter.start()
        assert limiter.default_w() == [650.0, 600.0]
        await limiter.restore()  # nothing set yet: nothing written
        assert limiter.changes_total == 0
        await limiter.set_total_w(800.0)
        assert [g.limit_mw for g in gpus] == [400_000, 400_000]
        await limiter.restore()
        assert [g.limit_mw for g in gpus] == [650_000, 600_000]
        await limiter.set_total_w(500.0)
        await limiter.close()  # dies without restore()
        fresh = NvmlLimiter([0, 1], state_dir=tmp_path, nvml=fake_nvml(gpus), restore_to="previous")
        await fresh.start()
        assert fresh.recovered and [g.limit_mw for g in gpus] == [650_000, 600_000]
        assert fresh.default_w() == [650.0, 600.0]  # the recorded limits, not the 250 W left

    run(body())


def test_a_clean_start_changes_nothing(tmp_path: Path) -> None:
    fake = FakeZeusd(gpus=[Gpu(limit_mw=450_000)])

    async def body(url: str) -> None:
        limiter = ZeusdLimiter(url, [0], state_dir=tmp_path)
        await limiter.start()
        await limiter.restore()
        assert not limiter.recovered and limiter.changes_total == 0
        await limiter.close()

    with_zeusd(fake, body)
    assert fake.sets == [] and fake.gpus[0].limit_mw == 450_000


def test_no_change_without_a_writable_state_file(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    gpus = [FakeGpu()]

    async def body() -> None:
        limiter = NvmlLimiter([0], state_dir=blocker, nvml=fake_nvml(gpus))
        await limiter.start()
        with pytest.raises(PowerLimitError, match="state file"):
            await limiter.set_total_w(300.0)

    run(body())
    assert gpus[0].limit_mw == 700_000


def test_a_corrupt_state_file_stops_start(tmp_path: Path) -> None:
    gpus = [FakeGpu()]
    limiter = NvmlLimiter([0], state_dir=tmp_path, nvml=fake_nvml(gpus))
    limiter.state_file.path.write_text("{not json")
    with pytest.raises(PowerLimitError, match="corrupt"):
        run(limiter.start())


def test_state_dir_defaults_to_the_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert default_state_dir() == Path("/run/user/1234/powerbatch")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_state_dir().name == f"powerbatch-{os.getuid()}"
    limiter = NvmlLimiter([0, 2])
    assert limiter.state_file.path.name == "limits-nvml-0_2.json"


# ---- errors ---------------------------------------------------------------------------------


def test_zeusd_unreachable_is_unavailable(tmp_path: Path) -> None:
    limiter = ZeusdLimiter(f"http://127.0.0.1:{free_port()}", state_dir=tmp_path)
    with pytest.raises(LimiterUnavailable):
        run(limiter.start())
    run(limiter.close())


@pytest.mark.parametrize(
    ("fake", "token", "error", "match"),
    [
        (FakeZeusd(token="s3cret"), None, LimiterPermissionDenied, "requires a token"),
        (FakeZeusd(token="s3cret"), "wrong", LimiterPermissionDenied, "401"),
        (FakeZeusd(groups=("gpu-read",)), None, LimiterUnavailable, "gpu-control"),
        (FakeZeusd(gpus=[Gpu()]), None, LimiterUnavailable, r"no GPU \[1\]"),
    ],
)
def test_zeusd_start_errors(
    tmp_path: Path, fake: FakeZeusd, token: str | None, error: type[Exception], match: str
) -> None:
    async def body(url: str) -> None:
        limiter = ZeusdLimiter(url, [0, 1], token=token, state_dir=tmp_path)
        try:
            with pytest.raises(error, match=match):
                await limiter.start()
        finally:
            await limiter.close()

    with_zeusd(fake, body)


@pytest.mark.parametrize(
    ("status", "hang_s", "error"),
    [(403, 0.0, LimiterPermissionDenied), (500, 0.0, PowerLimitError), (200, 5.0, LimiterTimeout)],
)
def test_zeusd_set_errors(
    tmp_path: Path, status: int, hang_s: float, error: type[Exception]
) -> None:
    fake = FakeZeusd(token="s3cret")

    async def body(url: str) -> None:
        limiter = ZeusdLimiter(url, [0, 1], token="s3cret", timeout_s=0.3, state_dir=tmp_path)
        await limiter.start()
        fake.set_status, fake.hang_s = (None if status == 200 else status), hang_s
        with pytest.raises(error) as info:
            await limiter.set_total_w(800.0)
        if error is PowerLimitError:  # a daemon failure is not mistaken for a config problem
            assert type(info.value) is PowerLimitError
        assert limiter.state_file.exists()  # the change may have happened: keep the record
        await limiter.close()

    with_zeusd(fake, body)


def test_nvml_no_permission_is_permission_denied(tmp_path: Path) -> None:
    gpu = FakeGpu(fail={"nvmlDeviceSetPowerManagementLimit": pynvml.NVML_ERROR_NO_PERMISSION})

    async def body() -> None:
        limiter = NvmlLimiter([0], state_dir=tmp_path, nvml=fake_nvml([gpu]))
        await limiter.start()
        with pytest.raises(LimiterPermissionDenied, match="CAP_SYS_ADMIN"):
            await limiter.set_total_w(300.0)

    run(body())
    with pytest.raises(LimiterUnavailable):
        run(NvmlLimiter([3], state_dir=tmp_path, nvml=fake_nvml([FakeGpu()])).start())


def test_calls_before_start_are_refused(tmp_path: Path) -> None:
    limiter = NvmlLimiter([0], state_dir=tmp_path, nvml=fake_nvml([FakeGpu()]))
    with pytest.raises(LimiterUnavailable, match="start"):
        limiter.constraints_w()
    with pytest.raises(LimiterUnavailable, match="start"):
        run(limiter.set_total_w(300.0))


def test_no_limiter_changes_nothing() -> None:
    limiter = NoLimiter()
    assert isinstance(limiter, PowerLimiter) and not limiter.controls_device
    assert run(limiter.set_total_w(300.0)) == math.inf
    actuator = LimitActuator(limiter)
    assert run(actuator.apply(300.0)) is None
    assert actuator.changes_total == 0 and not actuator.degraded


# ---- the zeusd power source -----------------------------------------------------------------


def test_zeusd_power_source_sums_power_and_energy() -> None:
    fake = FakeZeusd(gpus=[Gpu(power_mw=301_000, energy_mj=1_000), Gpu(power_mw=299_500)])

    async def body(url: str) -> Any:
        source = ZeusdPowerSource(url, [0, 1])
        assert isinstance(source, PowerSource)
        sample = await source.read()
        fake.gpus[1].energy_mj = None  # discovery is read once: energy stays expected
        with pytest.raises(SensorReadError):
            await source.read()
        await source.close()
        return sample

    sample = with_zeusd(fake, body)
    assert sample.power_w == pytest.approx(600.5)
    assert sample.energy_j == pytest.approx(5_001.0)


def test_zeusd_power_source_without_energy_counter_and_errors() -> None:
    fake = FakeZeusd(gpus=[Gpu(energy_mj=None), Gpu()], token="t")

    async def body(url: str) -> None:
        source = ZeusdPowerSource(url, [0, 1], token="t")
        assert (await source.read()).energy_j is None
        await source.close()
        wrong = ZeusdPowerSource(url, [0, 1], token="nope")
        with pytest.raises(SensorUnavailable, match="401"):
            await wrong.read()
        await wrong.close()

    with_zeusd(fake, body)
    dead = ZeusdPowerSource(f"http://127.0.0.1:{free_port()}", [0])
    with pytest.raises(SensorUnavailable):
        run(dead.read())
    run(dead.close())


# ---- the actuator: dead band, pacing, degraded ----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t_s = 100.0

    def __call__(self) -> float:
        return self.t_s


def actuator_run(
    fake: FakeZeusd,
    tmp_path: Path,
    script: Callable[[LimitActuator, Clock], Awaitable[None]],
    **kwargs: Any,
) -> None:
    async def body(url: str) -> None:
        limiter = ZeusdLimiter(url, [0, 1], token=fake.token, timeout_s=0.3, state_dir=tmp_path)
        clock = Clock()
        actuator = LimitActuator(limiter, clock=clock, **kwargs)
        try:
            await script(actuator, clock)
        finally:
            await limiter.close()

    with_zeusd(fake, body)


def test_actuator_dead_band_and_pacing(tmp_path: Path) -> None:
    fake = FakeZeusd()

    async def script(a: LimitActuator, clock: Clock) -> None:
        assert await a.apply(1000.0) == 1000.0  # first: unknown in force, applied
        assert a.decide(1008.0, clock()) == "dead_band"  # a raise within the band
        assert a.decide(1008.0, clock(), paced=False) == "apply"  # granted watts: however few
        assert await a.apply(1000.3) == 1000.0 and len(fake.sets) == 1  # the same total
        # a cut however small: a limit left over a fleet share that fell is no limit under it
        assert await a.apply(992.0) == 992.0 and len(fake.sets) == 2
        clock.t_s += 1.0
        assert a.decide(1100.0, clock()) == "too_soon"  # a raise waits min_interval_s
        assert await a.apply(1100.0) == 992.0 and len(fake.sets) == 2
        assert await a.apply(800.0) == 800.0  # a cut goes at once
        clock.t_s += 1.5
        assert await a.apply(1100.0) == 800.0  # 1.5 s after the cut: still too soon
        clock.t_s += 0.6
        assert await a.apply(1100.0) == 1100.0
        assert await a.apply(99_999.0) == 1100.0  # too soon; then clamped to the set's max
        clock.t_s += 2.0
        assert await a.apply(99_999.0) == 1400.0
        assert a.decide(99_999.0, clock.t_s + 10) == "dead_band"  # already at the max
        assert a.changes_total == 5 and a.limiter.changes_total == 5
        assert not a.degraded

    actuator_run(fake, tmp_path, script, dead_band_w=10.0, min_interval_s=2.0)
    assert [mw for _, mw in fake.sets] == [500_000, 496_000, 400_000, 550_000, 700_000]


@pytest.mark.parametrize(
    ("status", "hang_s", "token", "reason"),
    [
        (500, 0.0, "t", "PowerLimitError"),
        (None, 2.0, "t", "LimiterTimeout"),
        (401, 0.0, "t", "LimiterPermissionDenied"),
    ],
)
def test_actuator_degrades_backs_off_and_recovers(
    tmp_path: Path, status: int | None, hang_s: float, token: str, reason: str
) -> None:
    fake = FakeZeusd(token=token)

    async def script(a: LimitActuator, clock: Clock) -> None:
        assert await a.apply(1000.0) == 1000.0
        if status == 401:
            fake.token = "rotated"  # the daemon's key changed under us
        else:
            fake.set_status, fake.hang_s = status, hang_s
        assert await a.apply(600.0) is None
        assert a.degraded and a.degraded_reason is not None
        assert a.degraded_reason.startswith(reason)
        assert a.failures_total == 1 and a.in_force_w is None
        assert a.status()["degraded"] is True
        clock.t_s += 0.5
        assert a.decide(600.0, clock()) == "backoff"  # no hammering a failing daemon
        assert await a.apply(600.0) is None and a.failures_total == 1
        clock.t_s += 0.6  # past the 1 s backoff: retry, fails again, backoff doubles
        assert await a.apply(600.0) is None and a.failures_total == 2
        clock.t_s += 1.5
        assert a.decide(600.0, clock()) == "backoff"
        fake.set_status, fake.hang_s, fake.token = None, 0.0, token  # healed
        clock.t_s += 0.6
        assert await a.apply(600.0) == 600.0
        assert not a.degraded and a.degraded_reason is None
        assert a.changes_total == 2

    actuator_run(fake, tmp_path, script, backoff_initial_s=1.0, timeout_s=0.5)


def test_actuator_start_failure_is_degraded_not_raised(tmp_path: Path) -> None:
    async def main() -> None:
        limiter = ZeusdLimiter(f"http://127.0.0.1:{free_port()}", state_dir=tmp_path)
        actuator = LimitActuator(limiter)
        assert await actuator.apply(500.0) is None
        assert actuator.degraded and "LimiterUnavailable" in (actuator.degraded_reason or "")
        await limiter.close()

    run(main())


# ---- settings -------------------------------------------------------------------------------


def test_limiter_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="zeusd_url"):
        LimiterSettings(power_limiter="zeusd")
    with pytest.raises(ConfigError, match="zeusd_url"):
        LimiterSettings(zeusd_url="localhost:4938")
    with pytest.raises(ConfigError):
        LimiterSettings(limit_dead_band_w=-1.0)
    s = LimiterSettings(
        power_limiter="zeusd",
        zeusd_url="unix:///run/zeusd/zeusd.sock",
        zeusd_token="s3cret",
        limit_state_dir=str(tmp_path),
    )
    assert "s3cret" not in repr(s) and flat(s)["zeusd_token"] == "s3cret"
    limiter = make_limiter(s, [0, 1])
    assert isinstance(limiter, ZeusdLimiter)
    assert limiter.name == "zeusd:/run/zeusd/zeusd.sock:0,1"
    assert limiter.state_file.path.parent == tmp_path
    assert isinstance(make_limiter(LimiterSettings(power_limiter="none"), [0]), NoLimiter)
    nvml = make_limiter(dataclasses.replace(s, power_limiter="nvml"), [0])
    assert isinstance(nvml, NvmlLimiter)


def _status(tmp_path: Path, cap_eff: str) -> str:
    path = tmp_path / f"status-{cap_eff}"
    path.write_text(f"Name:\tpowerbatch\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    return str(path)


def test_cap_sys_admin_is_read_from_the_effective_set(tmp_path: Path) -> None:
    assert holds_cap_sys_admin(_status(tmp_path, "000001ffffffffff"))  # root, all caps
    assert holds_cap_sys_admin(_status(tmp_path, "0000000000200000"))  # SYS_ADMIN alone
    # Root in a container without SYS_ADMIN (Docker's default set): NVML refuses it a limit.
    assert not holds_cap_sys_admin(_status(tmp_path, "00000000a80425fb"))


def test_auto_takes_the_limiter_the_host_offers(monkeypatch: pytest.MonkeyPatch) -> None:
    """zeusd where a daemon is named, NVML where the process may set it, else admission alone;
    never over an explicit choice, and never beside the hardware backstop."""
    monkeypatch.setattr("powerbatch.telemetry.factory.may_set_power_limit", lambda nvml: False)
    auto = LimiterSettings()
    assert auto.power_limiter == "auto"
    assert limiter_kind(auto) == "none"
    with_zeusd = LimiterSettings(zeusd_url="http://127.0.0.1:4938")
    assert limiter_kind(with_zeusd) == "zeusd"
    assert limiter_kind(with_zeusd, backstop=True) == "none"
    assert limiter_kind(dataclasses.replace(with_zeusd, power_limiter="none")) == "none"
    monkeypatch.setattr("powerbatch.telemetry.factory.may_set_power_limit", lambda nvml: True)
    assert limiter_kind(auto) == "nvml"
    assert limiter_kind(with_zeusd) == "zeusd"
    assert limiter_kind(auto, backstop=True) == "none"


def test_zeusd_over_a_unix_socket(tmp_path: Path) -> None:
    fake = FakeZeusd()
    sock = tmp_path / "zeusd.sock"

    async def main() -> float:
        runner = web.AppRunner(fake.app(), access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(sock)).start()
        try:
            limiter = ZeusdLimiter(f"unix://{sock}", [0, 1], state_dir=tmp_path)
            await limiter.start()
            in_force = await limiter.set_total_w(900.0)
            await limiter.restore()
            await limiter.close()
            return in_force
        finally:
            await runner.cleanup()

    assert run(main()) == 900.0
    assert [mw for _, mw in fake.sets] == [450_000, 700_000]


def test_a_fleet_share_that_rose_is_set_at_once_and_the_loops_own_raise_waits(
    tmp_path: Path,
) -> None:
    """Cut to a lower share, then granted a higher one within the pace: the watts are the
    member's (the leader paid them from the pool), so the raise goes at once; a raise under a
    ceiling that has not risen (the controller's own, after a cut) still waits the pace."""
    fake = FakeZeusd()

    async def script(a: LimitActuator, clock: Clock) -> None:
        dev = DeviceLimit(a)
        dev.request(1000.0, ceiling_w=1010.0)
        await dev._applying  # type: ignore[misc]
        clock.t_s += 0.5
        dev.request(700.0, ceiling_w=707.0)  # the share fell: a cut, at once
        await dev._applying  # type: ignore[misc]
        clock.t_s += 0.5
        dev.request(900.0, ceiling_w=707.0)  # the same share: the loop's raise waits
        await dev._applying  # type: ignore[misc]
        assert a.in_force_w == 700.0
        dev.request(900.0, ceiling_w=909.0)  # the share rose: at once
        await dev._applying  # type: ignore[misc]
        assert a.in_force_w == 900.0
        clock.t_s += 0.5
        dev.request(950.0, ceiling_w=909.0)  # nothing rose since that change: paced again
        await dev._applying  # type: ignore[misc]
        assert a.in_force_w == 900.0 and len(fake.sets) == 3

    actuator_run(fake, tmp_path, script, dead_band_w=10.0, min_interval_s=2.0)


def test_a_share_that_fell_and_came_back_is_set_at_once(tmp_path: Path) -> None:
    """A share falls 490 -> 412 W while the meter holds the ceiling shown at 490 W, then comes
    back to 490 W within the limit's pace: the limit goes back up at once (the watts were
    granted). Bounded by the ceiling shown, the raise read as no rise and waited 2 s while
    a burst's prompts queued under 204 W of 245 (bursts case, stop 44)."""

    class Source:
        def __init__(self) -> None:
            self.below: float | None = None

        def ceiling_w(self, t_s: float) -> float | None:
            return 490.0

        def device_limit_w(self, t_s: float) -> float | None:
            return self.below

    src = Source()
    host = SimpleNamespace(ceiling=src)
    fake = FakeZeusd()

    def ask(dev: DeviceLimit, limit_w: float) -> None:
        req = ControlLoop._limit_request_w(host, limit_w, 490.0, 0.0)  # type: ignore[arg-type]
        dev.request(*req)

    async def script(a: LimitActuator, clock: Clock) -> None:
        dev = DeviceLimit(a)
        ask(dev, 485.0)
        await dev._applying  # type: ignore[misc]
        clock.t_s += 0.5
        src.below = 408.0  # the share falls: its member asks for the lower limit
        ask(dev, 485.0)
        await dev._applying  # type: ignore[misc]
        assert a.in_force_w == 408.0
        clock.t_s += 0.5
        src.below = None  # the share is back
        ask(dev, 485.0)
        await dev._applying  # type: ignore[misc]
        assert a.in_force_w == 485.0

    actuator_run(fake, tmp_path, script, dead_band_w=2.0, min_interval_s=2.0)
