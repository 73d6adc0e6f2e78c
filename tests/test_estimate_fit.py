"""The power model's incremental fit equals a full statsmodels WLS refit on the same window.

`PowerModel` keeps X'WX and X'Wy up to date sample by sample (forgetting, eviction, and an exact
rebuild once a window) and solves the normal equations; the reference below is the statsmodels
fit it replaced, run from scratch on the rows the window holds at each checkpoint.
"""

from __future__ import annotations

import math
import warnings
from collections import deque

import numpy as np
import pytest
import statsmodels.api as sm
from scipy import stats
from statsmodels.tools.sm_exceptions import SingularMatrixWarning

from powerbatch.estimate import Features, PowerModel, PowerPrior
from powerbatch.estimate.features import REGRESSORS, design_matrix, design_ray

Row = tuple[float, Features, float, float]  # time, features, watts, the sample's weight


def _reference(
    model: PowerModel, rows: list[Row], x_new: np.ndarray
) -> dict[str, np.ndarray | float]:
    """The statsmodels WLS fit and bound that PowerModel computed before it went incremental;
    a sample's weight multiplies its recency weight, and counts as that many samples."""
    t = np.array([r[0] for r in rows])
    xs = design_matrix([r[1] for r in rows])
    ys = np.array([r[2] for r in rows])
    m = np.array([r[3] for r in rows])
    w = m * np.exp2(-(t[-1] - t) / model.half_life_s) if rows else np.empty(0)
    x = np.vstack([model._prior_x, xs])
    y = np.concatenate([model._prior_y, ys])
    weights = np.concatenate([model._prior_w, w])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SingularMatrixWarning)
        result = sm.WLS(y, x, weights=weights).fit()
    noise_var, noise_df = float(result.scale), float(result.df_resid)
    resid = np.abs(ys - np.asarray(result.predict(xs))) if rows else ys
    n_eff = w.sum() ** 2 / (w * w / m).sum() if rows else 0.0
    df = n_eff - result.df_model - 1
    if rows and df >= 3:
        order = np.argsort(resid)
        cum = np.cumsum(w[order])
        mad = float(resid[order][np.searchsorted(cum, 0.5 * cum[-1])])
        var = (1.4826 * mad) ** 2 * n_eff / df
        k, prior_var = model.prior.noise_samples, model.prior.noise_w**2
        var = (df * var + k * prior_var) / (df + k)
        noise_var, noise_df = max(var, 1e-6), df + k
    quantile = float(stats.t.ppf(model.confidence, noise_df))
    pred = result.get_prediction(x_new, weights=1.0)
    mean = np.asarray(pred.predicted_mean)
    se_mean = np.asarray(pred.se_mean) * math.sqrt(noise_var / max(result.scale, 1e-12))
    upper = mean + quantile * np.sqrt(se_mean**2 + noise_var)
    return {
        "params": np.asarray(result.params),
        "mean": mean,
        "upper": upper,
        "noise_q": quantile * math.sqrt(noise_var),
    }


def _check(model: PowerModel, rows: deque[Row], x: np.ndarray) -> None:
    ref = _reference(model, list(rows), x)
    pred = model.predict_design(x)
    params = np.array([model.coefficients()[name] for name in REGRESSORS])
    # Predictions in watts agree to well under a milliwatt; coefficients to 1e-6 relative.
    np.testing.assert_allclose(params, ref["params"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pred.mean_w, ref["mean"], rtol=1e-9, atol=1e-4)
    np.testing.assert_allclose(pred.upper_w, ref["upper"], rtol=1e-9, atol=1e-4)
    assert model.noise_quantile_w() == pytest.approx(ref["noise_q"], rel=1e-7)


@pytest.mark.parametrize(("half_life_s", "weighted"), [(20.0, False), (1e6, False), (20.0, True)])
def test_incremental_fit_matches_statsmodels_wls_on_the_window(
    half_life_s: float, weighted: bool
) -> None:
    """Through the window's filling, evictions, rebuilds, a load step and a clock stall; with
    `weighted`, readings that each stand for 1-5 ticks (an exporter's held collections)."""
    rng = np.random.default_rng(11)
    window = 240
    model = PowerModel(PowerPrior.from_ceiling(600.0, 256), window=window, half_life_s=half_life_s)
    rows: deque[Row] = deque(maxlen=window)
    x = design_ray(Features(1.0, 900.0, 150.0, 35.0), np.arange(1, 257, dtype=float))
    _check(model, rows, x)  # the prior alone
    t = 0.0
    for i in range(1_000):
        t += 0.2 if i % 97 else 3.0  # now and then a gap in the readings
        n = float(rng.integers(1, 129))
        pf = float(rng.uniform(0, 8_000))
        f = Features(n, 900.0 * n * rng.uniform(0.8, 1.2), pf, 35.0 * n)
        power = 150 + 3 * n + 0.015 * pf + (80.0 if i > 600 else 0.0) + rng.normal(0, 10)
        weight = float(rng.integers(1, 6)) if weighted else 1.0
        model.observe(t, f, power, weight)
        rows.append((t, f, power, weight))
        if i in (0, 2, 30, 239, 240, 241, 400, 479, 480, 601, 650, 999):
            _check(model, rows, x)


def test_rank_deficient_design_matches_statsmodels() -> None:
    """kv and decode rate exactly proportional to batch, and a prior with no slopes' ridge:
    the min-norm solution, as statsmodels' pinv gives, predicts the same along the data."""
    rng = np.random.default_rng(2)
    prior = PowerPrior(idle_w=70.0, max_w=700.0, max_batch=256, slope_weight=0.0)
    model = PowerModel(prior, window=100, half_life_s=30.0)
    rows: deque[Row] = deque(maxlen=100)
    for i in range(150):
        n = float(rng.integers(1, 100))
        f = Features(n, 1_000.0 * n, 0.0, 30.0 * n)
        power = 100 + 2 * n + rng.normal(0, 5)
        model.observe(i * 0.2, f, power)
        rows.append((i * 0.2, f, power, 1.0))
    x = design_ray(Features(1.0, 1_000.0, 0.0, 30.0), np.arange(1, 101, dtype=float))
    ref = _reference(model, list(rows), x)
    pred = model.predict_design(x)
    np.testing.assert_allclose(pred.mean_w, ref["mean"], rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(pred.upper_w, ref["upper"], rtol=1e-6, atol=1e-3)


def test_non_finite_inputs_are_ignored() -> None:
    model = PowerModel(PowerPrior.from_ceiling(600.0, 256), window=50)
    model.observe(0.0, Features(4.0, 4_000.0, 0.0, 120.0), 200.0)
    model.observe(0.2, Features(math.nan, 0.0, 0.0, 0.0), 200.0)
    model.observe(0.4, Features(4.0, 4_000.0, 0.0, 120.0), math.inf)
    assert model.n_samples == 1
    mean_w, upper_w = model.predict_one(Features(4.0, 4_000.0, 0.0, 120.0))
    assert math.isfinite(mean_w) and upper_w > mean_w
