"""Online regression of measured power on the operating point, with an upper prediction bound.

Weighted least squares (statsmodels) over a sliding window whose weights halve every
`half_life_s`, so the model follows a plant that drifts (thermals, a new model, a new load mix)
and forgets what no longer holds. A weak prior, written as a few pseudo-observations, anchors
predictions before data arrives and where the data never went: it is generic (idle near 11% of the
power limit, concave growth with batch, prefill toward the limit) and is outweighed within seconds.
Nothing here knows the simulator's formulas; the controller trusts only what this model learns.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import statsmodels.api as sm
from numpy.typing import NDArray
from scipy import stats
from statsmodels.tools.sm_exceptions import SingularMatrixWarning

from powerbatch.estimate.features import REGRESSORS, Features, design_matrix, design_row

# Facts file: a safe default cap is about 70% of TDP; idle H200 draws about 78 W of 700 W.
_CEILING_OVER_TDP = 0.7
_IDLE_OVER_TDP = 0.11


@dataclass(frozen=True, slots=True)
class PowerPrior:
    """A generic guess at the plant, used only until data says otherwise."""

    idle_w: float
    max_w: float
    max_batch: int
    weight: float = 1.0  # total weight of the prior's level, in fresh samples
    slope_weight: float = 0.5  # ridge strength towards the prior's slopes
    noise_frac: float = 0.02  # prior sd of a 1-second reading, as a share of max_w
    noise_samples: float = 30.0  # how many readings that prior noise is worth
    kv_tokens_per_request: float = 1_000.0
    decode_tok_s_per_request: float = 30.0
    heavy_prefill_tok_s: float = 20_000.0
    slope_per_doubling: float = 0.05  # share of max_w per doubling of the batch

    @property
    def noise_w(self) -> float:
        return self.noise_frac * self.max_w

    @classmethod
    def from_ceiling(
        cls, ceiling_w: float, max_batch: int, max_w: float | None = None
    ) -> PowerPrior:
        tdp_w = max_w if max_w is not None else ceiling_w / _CEILING_OVER_TDP
        return cls(idle_w=_IDLE_OVER_TDP * tdp_w, max_w=tdp_w, max_batch=max_batch)

    def points(self) -> list[tuple[Features, float]]:
        out: list[tuple[Features, float]] = []
        for batch in sorted({0, 1, 4, 16, 64, self.max_batch}):
            # Busy power rises a few percent of the limit per doubling of the batch: the
            # facts file's curves give 3% (8B, H100), 3% (decode on H200) and 5% (70B, 4 GPUs).
            busy_w = self.max_w * (0.5 + self.slope_per_doubling * math.log2(1 + batch))
            base_w = self.idle_w if batch == 0 else busy_w
            for prefill in (0.0, self.heavy_prefill_tok_s):
                if batch == 0 and prefill:
                    continue
                # Additive, as the regression is: heavy prefill adds about half the limit.
                power_w = base_w + 0.5 * self.max_w * (prefill / self.heavy_prefill_tok_s)
                f = Features(
                    float(batch),
                    batch * self.kv_tokens_per_request,
                    prefill,
                    batch * self.decode_tok_s_per_request,
                )
                out.append((f, power_w))
        return out


@dataclass(frozen=True, slots=True)
class Prediction:
    mean_w: NDArray[np.float64]
    upper_w: NDArray[np.float64]


class PowerModel:
    """Sliding-window WLS of power on `Features`, refit lazily when asked to predict."""

    def __init__(
        self,
        prior: PowerPrior,
        *,
        window: int = 1_200,
        half_life_s: float = 60.0,
        confidence: float = 0.95,
    ) -> None:
        if not 0.5 < confidence < 1.0:
            raise ValueError("confidence must be in (0.5, 1)")
        self.prior = prior
        self.half_life_s = half_life_s
        self.confidence = confidence
        # Ring buffers: a fit reads them whole, in any order (weights carry recency).
        self._t = np.zeros(window)
        self._x = np.zeros((window, len(REGRESSORS)))
        self._y = np.zeros(window)
        self._n = 0
        self._next = 0
        self._t_last = 0.0
        # The prior enters twice: a few points that give a level before any data (weak: levels
        # differ by hundreds of watts between plants), and ridge rows that pull each slope
        # towards the prior's slope (stronger: it settles directions the data has not
        # explored, such as kv and decode rate, which move together with batch).
        prior_points = prior.points()
        px = design_matrix([f for f, _ in prior_points])
        py = np.array([p for _, p in prior_points])
        slopes = np.linalg.lstsq(px, py, rcond=None)[0]
        k = px.shape[1] - 1
        ridge_x = np.hstack([np.zeros((k, 1)), np.eye(k)])
        self._prior_x = np.vstack([px, ridge_x])
        self._prior_y = np.concatenate([py, slopes[1:]])
        self._prior_w = np.concatenate(
            [np.full(len(py), prior.weight / len(py)), np.full(k, prior.slope_weight)]
        )
        self._result: sm.regression.linear_model.RegressionResults | None = None
        self._noise_var = 0.0
        self._noise_df = 1.0
        self._quantile = 1.0
        self._dirty = True

    @property
    def n_samples(self) -> int:
        return self._n

    def observe(self, t_s: float, features: Features, power_w: float) -> None:
        if not math.isfinite(power_w):
            return
        i = self._next
        self._t[i], self._x[i], self._y[i] = t_s, design_row(features), power_w
        self._next = (i + 1) % len(self._y)
        self._n = min(self._n + 1, len(self._y))
        self._t_last = t_s
        self._dirty = True

    def _fit(self) -> sm.regression.linear_model.RegressionResults:
        if self._result is not None and not self._dirty:
            return self._result
        n = self._n
        if n:
            w = np.exp2(-(self._t_last - self._t[:n]) / self.half_life_s)
            xs, ys = self._x[:n], self._y[:n]
            x = np.vstack([self._prior_x, xs])
            y = np.concatenate([self._prior_y, ys])
            weights = np.concatenate([self._prior_w, w])
        else:
            x, y, weights = self._prior_x, self._prior_y, self._prior_w
        with warnings.catch_warnings():
            # Rank deficiency is expected (kv and decode move with batch); pinv copes with it.
            warnings.simplefilter("ignore", SingularMatrixWarning)
            self._result = result = sm.WLS(y, x, weights=weights).fit()
        self._noise_var, self._noise_df = float(result.scale), float(result.df_resid)
        if n:
            # The noise of a fresh reading comes from real readings only: the prior's misfit is
            # not sensor noise and would widen every bound. The scale is robust (a weighted
            # MAD, weights meaning recency): a start-up ramp or a load step leaves a few huge
            # residuals that say nothing about the steady noise the bound is for.
            resid = np.abs(ys - np.asarray(result.predict(xs)))
            n_eff = w.sum() ** 2 / (w**2).sum()
            df = n_eff - result.df_model - 1
            if df >= 3:
                order = np.argsort(resid)
                cum = np.cumsum(w[order])
                mad = float(resid[order][np.searchsorted(cum, 0.5 * cum[-1])])
                var = (1.4826 * mad) ** 2 * n_eff / df
                # Shrink towards a prior noise while the data are few, so that one early
                # transient cannot freeze (or loosen) every decision.
                k, prior_var = self.prior.noise_samples, self.prior.noise_w**2
                var = (df * var + k * prior_var) / (df + k)
                self._noise_var, self._noise_df = max(var, 1e-6), df + k
        self._quantile = float(stats.t.ppf(self.confidence, self._noise_df))
        self._dirty = False
        return result

    def predict(self, points: Sequence[Features]) -> Prediction:
        """Mean and one-sided upper bound (at `confidence`) for a fresh reading at each point."""
        return self.predict_design(design_matrix(list(points)))

    def predict_design(self, x: NDArray[np.float64]) -> Prediction:
        """`predict` for rows already in design form (see features.design_matrix)."""
        result = self._fit()
        pred = result.get_prediction(x, weights=1.0)  # a fresh reading: full weight
        mean = np.asarray(pred.predicted_mean)
        # statsmodels' parameter uncertainty, rescaled to the noise of real readings.
        se_mean = np.asarray(pred.se_mean) * math.sqrt(self._noise_var / max(result.scale, 1e-12))
        upper = mean + self._quantile * np.sqrt(se_mean**2 + self._noise_var)
        return Prediction(mean_w=mean, upper_w=upper)

    def predict_one(self, point: Features) -> tuple[float, float]:
        p = self.predict([point])
        return float(p.mean_w[0]), float(p.upper_w[0])

    def coefficients(self) -> dict[str, float]:
        """Fitted coefficients by regressor name (scaled units; for status and debugging)."""
        params = self._fit().params
        return {name: float(v) for name, v in zip(REGRESSORS, params, strict=True)}

    def noise_quantile_w(self) -> float:
        """How far above its mean a fresh reading may land, at `confidence` (one-sided)."""
        self._fit()
        return self._quantile * math.sqrt(self._noise_var)

    def residual_std_w(self) -> float:
        self._fit()
        return math.sqrt(self._noise_var)
