"""The power model learns plants it was not written for, and its upper bound means what it says."""

from __future__ import annotations

import numpy as np

from powerbatch.estimate import Features, PowerModel, PowerPrior


def _point(n: float, prefill: float = 0.0) -> Features:
    return Features(n, 900.0 * n, prefill, 35.0 * n)


def _plants() -> dict[str, object]:
    # Three shapes none of which is the simulator's: linear, square-root, saturating exponential.
    return {
        "linear": lambda n, pf: 120 + 3.2 * n + 0.012 * pf,
        "sqrt": lambda n, pf: 90 + 40 * np.sqrt(n) + 0.02 * pf,
        "saturating": lambda n, pf: 300 + 500 * (1 - np.exp(-n / 40)) + 0.015 * pf,
    }


def test_prior_alone_rises_with_batch_and_is_wide() -> None:
    model = PowerModel(PowerPrior.from_ceiling(500.0, 256))
    pred = model.predict([_point(n) for n in (1, 16, 64, 256)])
    assert np.all(np.diff(pred.mean_w) > 0)
    assert np.all(pred.upper_w - pred.mean_w > 20)  # no data yet: honest about it


def test_learns_each_plant_and_upper_bound_covers_fresh_readings() -> None:
    rng = np.random.default_rng(7)
    for name, plant in _plants().items():
        model = PowerModel(PowerPrior.from_ceiling(600.0, 256), confidence=0.95)
        for i in range(800):
            n = float(rng.integers(1, 129))
            pf = float(rng.uniform(0, 8000))
            model.observe(i * 0.2, _point(n, pf), plant(n, pf) + rng.normal(0, 12))  # type: ignore[operator]
        ns = rng.integers(1, 129, 400).astype(float)
        pfs = rng.uniform(0, 8000, 400)
        pred = model.predict([_point(n, pf) for n, pf in zip(ns, pfs, strict=True)])
        truth = np.array([plant(n, pf) for n, pf in zip(ns, pfs, strict=True)])  # type: ignore[operator]
        fresh = truth + rng.normal(0, 12, len(truth))
        error = np.abs(pred.mean_w - truth)
        assert np.median(error) < 15, (name, np.median(error))
        coverage = float(np.mean(fresh <= pred.upper_w))
        assert 0.85 <= coverage <= 0.995, (name, coverage)


def test_forgets_an_old_plant() -> None:
    rng = np.random.default_rng(3)
    model = PowerModel(PowerPrior.from_ceiling(600.0, 256), half_life_s=10.0)
    t = 0.0
    for offset in (0.0, 120.0):  # the plant draws 120 W more after, say, a model swap
        for _ in range(400):
            n = float(rng.integers(1, 100))
            model.observe(t, _point(n), 200 + 3 * n + offset + rng.normal(0, 8))
            t += 0.2
    mean_w, _ = model.predict_one(_point(50))
    assert abs(mean_w - (200 + 150 + 120)) < 20


def test_prefill_raises_prediction_once_learned() -> None:
    rng = np.random.default_rng(5)
    model = PowerModel(PowerPrior.from_ceiling(600.0, 256))
    for i in range(600):
        n, pf = float(rng.integers(4, 64)), float(rng.uniform(0, 10_000))
        model.observe(i * 0.2, _point(n, pf), 250 + 2 * n + 0.02 * pf + rng.normal(0, 10))
    low, _ = model.predict_one(_point(32, 0))
    high, _ = model.predict_one(_point(32, 10_000))
    assert 150 < high - low < 250
