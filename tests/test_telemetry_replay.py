"""ReplayPowerSource against traces written with the shared trace format."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from powerbatch.errors import ReplayError
from powerbatch.telemetry import PowerSource, ReplayPowerSource, TraceRow, write_trace
from powerbatch.telemetry.replay import TraceExhausted

ROWS = [
    TraceRow(t_s=10.0, power_w=480.5, energy_j=1000.0),
    TraceRow(t_s=10.1, power_w=512.0, energy_j=1050.0, requests_in_flight=8),
    TraceRow(t_s=10.2, power_w=530.25),
]


def test_replays_rows_in_order_then_exhausts(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    assert write_trace(path, ROWS) == 3
    source = ReplayPowerSource(path)
    assert isinstance(source, PowerSource)

    async def run() -> list[tuple[float, float, float | None]]:
        out = []
        for _ in range(3):
            s = await source.read()
            out.append((s.t_s, s.power_w, s.energy_j))
        with pytest.raises(TraceExhausted, match="trace exhausted"):
            await source.read()
        with pytest.raises(ReplayError):  # a subclass: callers can catch either
            await source.read()
        await source.close()
        return out

    assert asyncio.run(run()) == [
        (10.0, 480.5, 1000.0),
        (10.1, 512.0, 1050.0),
        (10.2, 530.25, None),
    ]


def test_wall_clock_stamps_with_monotonic_time() -> None:
    source = ReplayPowerSource(ROWS, clock="wall")
    before = time.monotonic()
    sample = asyncio.run(source.read())
    assert before <= sample.t_s <= time.monotonic()
    assert sample.power_w == 480.5
    assert source.remaining == 2


@pytest.mark.parametrize(
    "text",
    [
        "t_s,power_w\n0.0,100\n0.1,abc\n",  # not a number
        "t_s,energy_j\n0.0,1\n",  # no power column
        "t_s,power_w\n,100\n",  # empty time
        "t_s,power_w\n0.0,nan\n",  # non-finite power
        "t_s,power_w\n1.0,100\n0.5,100\n",  # time goes backwards
    ],
)
def test_malformed_csv_raises_replay_error_at_construction(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ReplayError):
        ReplayPowerSource(path)


def test_rows_without_power_are_skipped(tmp_path: Path) -> None:
    """A tick recorded while failed closed has no power: nothing to replay, not an error."""
    path = tmp_path / "trace.csv"
    path.write_text("t_s,power_w\n0.0,100\n0.1,\n0.2,120\n")
    source = ReplayPowerSource(path)
    assert len(source) == 2
    assert asyncio.run(source.read()).power_w == 100.0
    assert asyncio.run(source.read()).power_w == 120.0


def test_missing_file_raises_replay_error(tmp_path: Path) -> None:
    with pytest.raises(ReplayError):
        ReplayPowerSource(tmp_path / "nope.csv")
