"""Water-filling: shares that equalise the marginal value of a watt across members.

Each member i reports `value_per_w` v_i (the goodput its first watt buys, weighted by the priority
of its demand; signals.py) and `want_w` W_i (the power that would serve all its demand). Its
goodput is modelled as concave and saturating at W_i, with marginal value

    m_i(w) = v_i * (1 - w / W_i)   for w < W_i,  0 beyond,

so a watt is worth most to a member far from serving its demand and nothing to one that
already has all it can use. Maximising sum_i g_i(w_i) subject to sum_i w_i <= B and
lo_i <= w_i <= hi_i, the KKT conditions say: there is one price lambda >= 0 with
m_i(w_i) = lambda for every member strictly inside its bounds, m_i >= lambda at hi_i and
m_i <= lambda at lo_i. Then w_i(lambda) = clip(W_i * (1 - lambda / v_i), lo_i, hi_i), which is
non-increasing in lambda, so lambda is found by bisection. Watts nobody can use (every member
at its want) are spread evenly as headroom: a share is a ceiling, not a draw.

A share that moves costs the member: a lower share reads as a breach to its control loop (the
last second's power was drawn under the higher one), which cuts its batch. So the leader holds
a member's grant where the new target is within a dead band of it (`hold_small_moves`): the
bids of a light load drift from second to second, and following them lost more goodput than
the watts they moved could buy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEAD_BAND_FRAC = 0.1  # the leader moves no share by less than this share of the safe share


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


def read_bids(
    rows: Mapping[str, Mapping[str, str]], budget_w: float
) -> tuple[dict[str, Bid], dict[str, float], float]:
    """The bids and grants of the members' hashes (book.py), and the budget left to share: a
    lost member's safe share stays reserved while it may be on it."""
    bids: dict[str, Bid] = {}
    grants: dict[str, float] = {}
    for i, h in rows.items():
        if not h:
            continue
        if h.get("lost") == "1":
            budget_w -= _f(h.get("safe_w"))
            continue
        if h.get("grant") not in (None, ""):
            grants[i] = _f(h.get("grant"))
        bids[i] = Bid(
            value_per_w=_f(h.get("value_per_w")),
            want_w=_f(h.get("want_w")),
            min_w=_f(h.get("min_w")),
            max_w=_f(h.get("max_w"), budget_w),
        )
    return bids, grants, budget_w


def _f(x: Any, default: float = 0.0) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default
