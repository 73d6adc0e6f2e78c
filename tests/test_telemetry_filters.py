"""Property tests for the Hampel filter and the time-aware EWMA."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerbatch.errors import ConfigError
from powerbatch.telemetry.filters import Ewma, HampelFilter, ewma_step, half_life_alpha

power = st.floats(min_value=0.0, max_value=5000.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(power, min_size=1, max_size=60), st.integers(min_value=3, max_value=11))
def test_hampel_output_within_window_range(values: list[float], window: int) -> None:
    hampel = HampelFilter(window=window)
    for i, x in enumerate(values):
        out = hampel.update(x)
        recent = values[max(0, i - window + 1) : i + 1]
        assert min(recent) <= out <= max(recent)
        assert not math.isnan(out)


@settings(max_examples=200, deadline=None)
@given(
    level=st.floats(min_value=0.0, max_value=1000.0),
    spike=st.floats(min_value=-1e12, max_value=1e12).filter(lambda d: d != 0),
    before=st.integers(min_value=7, max_value=20),
    after=st.integers(min_value=0, max_value=10),
)
def test_hampel_removes_single_spike_in_flat_series(
    level: float, spike: float, before: int, after: int
) -> None:
    hampel = HampelFilter(window=7)
    series = [level] * before + [level + spike] + [level] * after
    assert all(hampel.update(x) == level for x in series)


def test_hampel_passes_noise_and_accepts_a_real_step() -> None:
    hampel = HampelFilter(window=7)
    noisy = [500.0, 510.0, 495.0, 505.0, 498.0, 507.0, 502.0, 499.0, 503.0]
    assert [hampel.update(x) for x in noisy] == noisy
    outputs = [hampel.update(700.0) for _ in range(6)]
    assert outputs[0] != 700.0  # one high sample is suspicious
    assert outputs[-1] == 700.0  # a sustained level is real


def test_hampel_warm_up_passes_values_and_rejects_nan() -> None:
    hampel = HampelFilter(window=5)
    assert [hampel.update(x) for x in (1.0, 1000.0, 2.0)] == [1.0, 1000.0, 2.0]
    assert hampel.update(math.nan) == 2.0  # median of the window, never NaN
    with pytest.raises(ValueError):
        HampelFilter().update(math.inf)
    with pytest.raises(ConfigError):
        HampelFilter(window=2)


@settings(max_examples=200, deadline=None)
@given(
    c=power,
    half_life_s=st.floats(min_value=0.01, max_value=10.0),
    dts=st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=1, max_size=30),
)
def test_ewma_of_constant_is_constant(c: float, half_life_s: float, dts: list[float]) -> None:
    ewma = Ewma(half_life_s)
    t_s = 0.0
    assert ewma.update(c, t_s) == c
    for dt in dts:
        t_s += dt
        assert ewma.update(c, t_s) == c
    assert ewma.value == c


@settings(max_examples=200, deadline=None)
@given(
    start=power,
    end=power,
    half_life_s=st.floats(min_value=0.01, max_value=10.0),
    dts=st.lists(st.floats(min_value=0.001, max_value=5.0), min_size=1, max_size=30),
)
def test_ewma_moves_monotonically_toward_a_step(
    start: float, end: float, half_life_s: float, dts: list[float]
) -> None:
    ewma = Ewma(half_life_s)
    previous = ewma.update(start, 0.0)
    t_s = 0.0
    for dt in dts:
        t_s += dt
        value = ewma.update(end, t_s)
        assert min(start, end) <= value <= max(start, end)
        assert abs(end - value) <= abs(end - previous)
        previous = value


def test_ewma_half_life_is_time_based() -> None:
    ewma = Ewma(half_life_s=1.0)
    ewma.update(0.0, 0.0)
    assert ewma.update(100.0, 1.0) == pytest.approx(50.0)
    # Two half-lives in one step forget as much as two one-half-life steps.
    other = Ewma(half_life_s=1.0)
    other.update(0.0, 0.0)
    assert other.update(100.0, 2.0) == pytest.approx(75.0)
    assert Ewma(0.5).value is None
    with pytest.raises(ConfigError):
        Ewma(0.0)


def test_ewma_step_and_half_life_alpha() -> None:
    assert ewma_step(None, 5.0, 0.2) == 5.0
    assert ewma_step(10.0, 20.0, 0.2) == pytest.approx(12.0)
    assert ewma_step(10.0, 20.0, 1.5) == 20.0  # never past the sample
    assert half_life_alpha(2.0, 2.0) == pytest.approx(0.5)
    assert half_life_alpha(0.0, 2.0) == 0.0
