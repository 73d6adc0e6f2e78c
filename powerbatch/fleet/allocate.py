"""Water-filling: shares that equalise the marginal value of a watt (docs/fleet.md, "Allocation").

Member i's marginal value is m_i(w) = v_i (1 - w / W_i) below its want W_i; one price lambda
gives w_i = clip(W_i (1 - lambda / v_i)), found by bisection; watts nobody can use are spread as
headroom. A move cuts the batch, so a grant within a dead band is kept (`hold_small_moves`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bid:
    """What the allocator knows of one member."""

    value_per_w: float  # v_i: weighted goodput per watt at a share of 0, >= 0
    want_w: float  # W_i: the power its demand would draw
    min_w: float
    max_w: float


def marginal_value(bid: Bid, w: float) -> float:
    """m_i(w): the value of one more watt at share `w`."""
    if bid.want_w <= 0 or w >= bid.want_w:
        return 0.0
    return bid.value_per_w * (1.0 - w / bid.want_w)


def _at_price(bid: Bid, price: float) -> float:
    if bid.value_per_w <= 0 or bid.want_w <= 0 or price >= bid.value_per_w:
        w = 0.0
    else:
        w = bid.want_w * (1.0 - price / bid.value_per_w)
    return min(max(w, bid.min_w), bid.max_w)


def water_fill(bids: Mapping[str, Bid], budget_w: float, iters: int = 60) -> dict[str, float]:
    """Shares summing to at most `budget_w` (and to it, where the maxima allow) that maximise
    the modelled goodput. Minima are honoured first; if they alone exceed the budget they are
    scaled down together."""
    if not bids:
        return {}
    floor = sum(b.min_w for b in bids.values())
    if floor >= budget_w:
        scale = budget_w / floor if floor > 0 else 0.0
        return {k: b.min_w * scale for k, b in bids.items()}
    if sum(_at_price(b, 0.0) for b in bids.values()) <= budget_w:
        shares = {k: _at_price(b, 0.0) for k, b in bids.items()}
    else:
        lo, hi = 0.0, max(b.value_per_w for b in bids.values())
        for _ in range(iters):
            mid = (lo + hi) / 2
            if sum(_at_price(b, mid) for b in bids.values()) > budget_w:
                lo = mid
            else:
                hi = mid
        shares = {k: _at_price(b, hi) for k, b in bids.items()}
    return _spread(shares, bids, budget_w)


def _spread(shares: dict[str, float], bids: Mapping[str, Bid], budget_w: float) -> dict[str, float]:
    """Hand the watts left over out evenly, up to each maximum."""
    left = budget_w - sum(shares.values())
    open_ = [k for k in shares if shares[k] < bids[k].max_w - 1e-9]
    while left > 1e-6 and open_:
        each = left / len(open_)
        for k in list(open_):
            add = min(each, bids[k].max_w - shares[k])
            shares[k] += add
            left -= add
            if shares[k] >= bids[k].max_w - 1e-9:
                open_.remove(k)
    return shares


def hold_small_moves(
    targets: Mapping[str, float], grants: Mapping[str, float], band_w: float
) -> dict[str, float]:
    """The targets, except that a member whose target is within `band_w` of its grant keeps
    its grant. Safe whatever it keeps: raises are paid only from unheld watts (book.py)."""
    out = dict(targets)
    for k, w in targets.items():
        g = grants.get(k)
        if g is not None and abs(w - g) < band_w:
            out[k] = g
    return out
