"""The percentile the reports share. numpy only, so that scripts/gpu_check.py can import it on a
GPU machine that has no more than torch, numpy and the checkout."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pct(values: Sequence[float], q: float, scale: float = 1.0) -> float | None:
    """The q-th percentile of `values` (numpy's, interpolated) times `scale`; None for none."""
    return float(np.percentile(values, q)) * scale if len(values) else None
