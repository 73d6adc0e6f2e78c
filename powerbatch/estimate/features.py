"""What the power model regresses on: the quantities the proxy controls or sees."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

# Scales keep the design matrix well conditioned; they carry no physics.
_BATCH_SCALE = 64.0
_KV_SCALE = 100_000.0
_PREFILL_SCALE = 10_000.0
_DECODE_SCALE = 10_000.0

REGRESSORS: tuple[str, ...] = (
    "const",
    "batch",
    "log2_batch",
    "kv_tokens",
    "prefill_tok_s",
    "decode_tok_s",
)


@dataclass(frozen=True, slots=True)
class Features:
    """One operating point, smoothed over about the same window as the power reading.

    `batch` is the engine's running batch when the upstream reports it, else the requests the
    proxy has in flight. Rates are tokens per second over the smoothing window.
    """

    batch: float
    kv_tokens: float
    prefill_tok_s: float
    decode_tok_s: float

    def per_request(self) -> Features:
        """The same point divided by the batch: the shape of the load, without its size."""
        n = max(self.batch, 1e-9)
        return Features(1.0, self.kv_tokens / n, self.prefill_tok_s / n, self.decode_tok_s / n)

    def scaled(self, batch: float) -> Features:
        """This per-request shape at another batch size: where a candidate limit would put us."""
        return Features(
            batch, self.kv_tokens * batch, self.prefill_tok_s * batch, self.decode_tok_s * batch
        )

    def with_prefill(self, prefill_tok_s: float) -> Features:
        return Features(self.batch, self.kv_tokens, prefill_tok_s, self.decode_tok_s)


def design_row(f: Features) -> NDArray[np.float64]:
    """The regression row for one operating point (order: REGRESSORS)."""
    return np.array(
        [
            1.0,
            f.batch / _BATCH_SCALE,
            np.log2(1.0 + max(f.batch, 0.0)),
            f.kv_tokens / _KV_SCALE,
            f.prefill_tok_s / _PREFILL_SCALE,
            f.decode_tok_s / _DECODE_SCALE,
        ]
    )


def design_matrix(points: list[Features]) -> NDArray[np.float64]:
    if not points:
        return np.empty((0, len(REGRESSORS)))
    return np.vstack([design_row(f) for f in points])


def design_ray(shape: Features, batches: NDArray[np.float64]) -> NDArray[np.float64]:
    """Rows for `shape.scaled(n)` at every n in `batches`, built in one vectorised step."""
    n = np.asarray(batches, float)
    return np.column_stack(
        [
            np.ones_like(n),
            n / _BATCH_SCALE,
            np.log2(1.0 + np.maximum(n, 0.0)),
            shape.kv_tokens * n / _KV_SCALE,
            shape.prefill_tok_s * n / _PREFILL_SCALE,
            shape.decode_tok_s * n / _DECODE_SCALE,
        ]
    )


def design_prefill_sweep(f: Features, prefill_tok_s: NDArray[np.float64]) -> NDArray[np.float64]:
    """Rows for `f.with_prefill(r)` at every r in `prefill_tok_s`, in one vectorised step."""
    rates = np.asarray(prefill_tok_s, float)
    rows = np.tile(design_row(f), (len(rates), 1))
    rows[:, REGRESSORS.index("prefill_tok_s")] = rates / _PREFILL_SCALE
    return rows
