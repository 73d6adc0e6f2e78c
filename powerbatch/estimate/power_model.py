"""Online regression of measured power on the operating point, with an upper prediction bound.

Weighted least squares over a sliding window whose weights halve every
`half_life_s`, so the model follows a plant that drifts (thermals, a new model, a new load mix)
and forgets what no longer holds. A weak prior, written as a few pseudo-observations, anchors
predictions before data arrives and where the data never went: it is generic (idle near 11% of the
power limit, concave growth with batch, prefill toward the limit) and is outweighed within seconds.
Nothing here knows the simulator's formulas; the controller trusts only what this model learns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy import special

from powerbatch.estimate.features import REGRESSORS, Features, design_matrix, design_row

# A safe default cap is about 70% of TDP (NVIDIA Dynamo's power-planner notes); an idle H200
# draws about 75-80 W of its 700 W (vendor and benchmark pages).
_CEILING_OVER_TDP = 0.7
_IDLE_OVER_TDP = 0.11
# Eigenvalues of X'WX below this share of the largest count as zero (a rank-deficient design).
_RCOND = 1e-12


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
            # ML.ENERGY leaderboard fits (GPU-to-Grid, arXiv 2602.05116) give 3% (8B, H100) and
            # 5% (70B, 4 GPUs); decode on H200 about 3% (arXiv 2605.11999).
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
    """Sliding-window WLS of power on `Features`, refit lazily when asked to predict.

    The fit is the normal equations of the weighted least squares, so it costs O(k²) per sample
    and O(k³) plus one pass over the window per refit (k = 6 regressors), with no statsmodels on
    the control loop (a statsmodels refit took several milliseconds at a full 1,500-sample window,
    and woke BLAS's thread pool, which then spun). The window's X'WX and X'Wy are kept
    incrementally: every sample rescales them by the forgetting factor, the evicted sample is
    subtracted, and they are rebuilt exactly once per window of samples so that rounding cannot
    drift. The results equal statsmodels' WLS on the same rows (tests/test_estimate_fit.py).
    Work over the window's n rows is elementwise numpy or einsum, never a BLAS call: BLAS only
    ever sees k×k matrices, too small to wake its thread pool (tests/test_idle_cpu.py).
    """

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
        if window < 1:
            raise ValueError("window must be at least 1")
        self.prior = prior
        self.half_life_s = half_life_s
        self.confidence = confidence
        k = len(REGRESSORS)
        # Ring buffers: a fit reads them whole, in any order (weights carry recency).
        self._t = np.zeros(window)
        self._x = np.zeros((window, k))
        self._y = np.zeros(window)
        self._w = np.zeros(window)  # each sample's own weight (the ticks of load it covers)
        self._n = 0
        self._next = 0
        self._t_last = 0.0
        # Sums over the window, weighted relative to the newest sample (whose weight is 1).
        self._xtwx = np.zeros((k, k))
        self._xtwy = np.zeros(k)
        self._since_rebuild = 0
        # The prior enters twice: a few points that give a level before any data (weak: levels
        # differ by hundreds of watts between plants), and ridge rows that pull each slope
        # towards the prior's slope (stronger: it settles directions the data has not
        # explored, such as kv and decode rate, which move together with batch).
        prior_points = prior.points()
        px = design_matrix([f for f, _ in prior_points])
        py = np.array([p for _, p in prior_points])
        slopes = np.linalg.lstsq(px, py, rcond=None)[0]
        ridge_x = np.hstack([np.zeros((k - 1, 1)), np.eye(k - 1)])
        self._prior_x = np.vstack([px, ridge_x])
        self._prior_y = np.concatenate([py, slopes[1:]])
        self._prior_w = np.concatenate(
            [np.full(len(py), prior.weight / len(py)), np.full(k - 1, prior.slope_weight)]
        )
        self._prior_xtwx = (self._prior_x * self._prior_w[:, None]).T @ self._prior_x
        self._prior_xtwy = (self._prior_x * self._prior_w[:, None]).T @ self._prior_y
        # The fit: coefficients, (X'WX)⁺ (statsmodels' normalized_cov_params), WLS scale.
        self._params = np.zeros(k)
        self._cov = np.zeros((k, k))
        self._scale = 1.0
        self._noise_var = 0.0
        self._noise_df = 1.0
        self._quantile = 1.0
        self._dirty = True

    @property
    def n_samples(self) -> int:
        return self._n

    def observe(self, t_s: float, features: Features, power_w: float, weight: float = 1.0) -> None:
        """Learn one reading. `weight`: how many samples it stands for. A 1-second mean read
        every tick comes as one sample a tick; a meter that collects once a second comes as
        one reading a second, which weighs the ticks it stood for, so that both weigh the same
        against the prior and against the past."""
        if not math.isfinite(power_w) or not weight > 0:
            return
        row = design_row(features)
        if not np.isfinite(row).all():
            return  # one NaN would poison every fit until it left the window
        i, window = self._next, len(self._y)
        evicted = self._n == window
        x_old, y_old, t_old, w_old = self._x[i].copy(), self._y[i], self._t[i], self._w[i]
        self._t[i], self._x[i], self._y[i], self._w[i] = t_s, row, power_w, weight
        self._next = (i + 1) % window
        had = self._n
        self._n = min(self._n + 1, window)
        decay = math.exp2(-(t_s - self._t_last) / self.half_life_s) if had else 0.0
        self._t_last = t_s
        self._dirty = True
        self._since_rebuild += 1
        if self._since_rebuild >= window or not 0.0 <= decay <= 1.0:
            # Once a window (rounding must not drift), and if the clock went backwards.
            self._rebuild()
            return
        self._xtwx *= decay
        self._xtwy *= decay
        if evicted:
            w_old *= math.exp2(-(t_s - t_old) / self.half_life_s)
            self._xtwx -= w_old * np.outer(x_old, x_old)
            self._xtwy -= (w_old * y_old) * x_old
        self._xtwx += weight * np.outer(row, row)
        self._xtwy += (weight * power_w) * row

    def forget(self) -> None:
        """Drop every reading, keeping the prior: what was learned no longer describes the
        plant (readings paired with the wrong load)."""
        self._n = self._next = self._since_rebuild = 0
        self._xtwx = np.zeros_like(self._xtwx)
        self._xtwy = np.zeros_like(self._xtwy)
        self._w[:] = 0.0
        self._dirty = True

    def _weights(self) -> NDArray[np.float64]:
        n = self._n
        return self._w[:n] * np.exp2(-(self._t_last - self._t[:n]) / self.half_life_s)

    def _rebuild(self) -> None:
        """X'WX and X'Wy from the window afresh (einsum: element loops, no BLAS threads)."""
        n = self._n
        w, xs = self._weights(), self._x[:n]
        self._xtwx = np.einsum("i,ij,ik->jk", w, xs, xs)
        self._xtwy = np.einsum("i,ij,i->j", w, xs, self._y[:n])
        self._since_rebuild = 0

    def _fit(self) -> None:
        if not self._dirty:
            return
        n = self._n
        xtwx = self._prior_xtwx + self._xtwx
        xtwy = self._prior_xtwy + self._xtwy
        # (X'WX)⁺ from its eigenvectors: for a full-rank design (the ridge rows see to that) it
        # is the inverse; statsmodels' pinv of the whitened design gives the same matrix.
        vals, vecs = np.linalg.eigh(xtwx)
        keep = vals > _RCOND * max(float(vals[-1]), 0.0)
        rank = int(keep.sum())
        v = vecs[:, keep]
        self._cov = cov = (v / vals[keep]) @ v.T
        self._params = params = cov @ xtwy
        prior_resid = self._prior_y - (self._prior_x * params).sum(axis=1)
        ssr = float(self._prior_w @ prior_resid**2)
        if n:
            w = self._weights()
            xs, ys = self._x[:n], self._y[:n]
            resid = ys - (xs * params).sum(axis=1)  # elementwise: no BLAS threads on n rows
            ssr += float((w * resid * resid).sum())
        # statsmodels' WLS sees no constant column (the ridge rows hold 0 there), so its
        # df_model is the rank and df_resid the rows less the rank.
        df_resid = len(self._prior_y) + n - rank
        self._scale = ssr / df_resid if df_resid > 0 else math.nan
        self._noise_var, self._noise_df = self._scale, float(df_resid)
        if n:
            # The noise of a fresh reading comes from real readings only: the prior's misfit is
            # not sensor noise and would widen every bound. The scale is robust (a weighted
            # MAD, weights meaning recency): a start-up ramp or a load step leaves a few huge
            # residuals that say nothing about the steady noise the bound is for.
            resid = np.abs(resid)
            # Kish's effective size, a reading counting as the samples it weighs.
            m = self._w[:n]
            n_eff = w.sum() ** 2 / (w * w / m).sum()
            df = n_eff - rank - 1
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
        # scipy.special.stdtrit is what stats.t.ppf computes, without its ~0.2 ms of overhead.
        self._quantile = float(special.stdtrit(self._noise_df, self.confidence))
        self._dirty = False

    def predict(self, points: Sequence[Features]) -> Prediction:
        """Mean and one-sided upper bound (at `confidence`) for a fresh reading at each point."""
        return self.predict_design(design_matrix(list(points)))

    def predict_design(self, x: NDArray[np.float64]) -> Prediction:
        """`predict` for rows already in design form (see features.design_matrix)."""
        self._fit()
        x = np.asarray(x, dtype=float)
        mean = (x * self._params).sum(axis=1)
        # The parameters' uncertainty at each row (x (X'WX)⁺ x', times the WLS scale, as
        # statsmodels' se_mean), rescaled to the noise of real readings; plus that noise.
        leverage = np.maximum(np.einsum("ij,jk,ik->i", x, self._cov, x), 0.0)
        rescale = self._noise_var / max(self._scale, 1e-12)
        se_mean2 = leverage * self._scale * rescale
        upper = mean + self._quantile * np.sqrt(se_mean2 + self._noise_var)
        return Prediction(mean_w=mean, upper_w=upper)

    def predict_one(self, point: Features) -> tuple[float, float]:
        p = self.predict([point])
        return float(p.mean_w[0]), float(p.upper_w[0])

    def coefficients(self) -> dict[str, float]:
        """Fitted coefficients by regressor name (scaled units; for status and debugging)."""
        self._fit()
        return {name: float(v) for name, v in zip(REGRESSORS, self._params, strict=True)}

    def noise_quantile_w(self) -> float:
        """How far above its mean a fresh reading may land, at `confidence` (one-sided)."""
        self._fit()
        return self._quantile * math.sqrt(self._noise_var)

    def residual_std_w(self) -> float:
        self._fit()
        return math.sqrt(self._noise_var)
