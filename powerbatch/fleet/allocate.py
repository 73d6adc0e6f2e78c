"""The allocator's law (docs/fleet.md, "Allocation"): a fair floor, then the surplus where a
watt is worth most.

`allocate`: while no member is needy, the targets are the static split itself (budget / N,
clipped to each member's bounds, `static_split`): a fleet with nothing to move must cost
nothing, and moving watts between members that all serve what they are sent buys nothing; only
a member with no work at all lends its split to the members with work.
Otherwise every member first gets what a static split would give it, budget / N, or less
where it needs less (a member with no work waiting needs what it draws plus headroom, and a
member that says it keeps less, `keep_w`, keeps that: held by its device limit inside its SLOs
with nothing waiting, one give under its draw, needy or not: docs/fleet.md, stop 65); then the
watts left, the surplus, go to the members with work waiting (`needy`), by water-filling on
their bids; what they cannot take goes to them up to their maxima, and only then to the rest.
So no member is held below its static share while it has work waiting or is at risk, and no
watt is left undrawn while any member has work waiting.

Water-filling (`water_fill`): member i's marginal value is m_i(w) = v_i (1 - w / W_i) below its
want W_i; one price lambda gives w_i = clip(W_i (1 - lambda / v_i)), found by bisection. A move
cuts the batch, so a grant within a dead band is kept while no needy member waits for a raise
(`hold_small_moves`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bid:
    """What the allocator knows of one member."""

    value_per_w: float  # v_i: weighted goodput per watt at a share of 0, >= 0
    want_w: float  # W_i: the power its demand would draw
    min_w: float
    max_w: float
    needy: bool = False  # work is waiting (or its device limit holds it with work)
    keep_w: float = math.inf  # the most its fair floor keeps (inf: its whole split)


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


def _spread(
    shares: dict[str, float],
    bids: Mapping[str, Bid],
    budget_w: float,
    among: Iterable[str] | None = None,
) -> dict[str, float]:
    """Hand the watts left over out evenly (among `among`, default all), up to each maximum."""
    left = budget_w - sum(shares.values())
    keys = list(shares) if among is None else list(among)
    open_ = [k for k in keys if shares[k] < bids[k].max_w - 1e-9]
    while left > 1e-6 and open_:
        each = left / len(open_)
        for k in list(open_):
            add = min(each, bids[k].max_w - shares[k])
            shares[k] += add
            left -= add
            if shares[k] >= bids[k].max_w - 1e-9:
                open_.remove(k)
    return shares


def _need_w(bid: Bid) -> float:
    """What a member can use: its maximum while work waits, else its want (draw + headroom)."""
    return bid.max_w if bid.needy else min(max(bid.want_w, 0.0), bid.max_w)


def _kept_w(bid: Bid) -> float:
    """What a member's fair floor keeps: what it can use, no more than it says it must keep."""
    return min(_need_w(bid), bid.keep_w)


def fair_floors(
    bids: Mapping[str, Bid],
    budget_w: float,
    iters: int = 60,
    need: Callable[[Bid], float] = _need_w,
) -> dict[str, float]:
    """Each member's floor: clip(min(f, need), min, max) with f the static split budget / N,
    or the largest f under it at which the floors fit the budget (minima above f take more).
    If the minima alone exceed the budget they are scaled down together."""
    floor = sum(b.min_w for b in bids.values())
    if floor >= budget_w:
        scale = budget_w / floor if floor > 0 else 0.0
        return {k: b.min_w * scale for k, b in bids.items()}

    def at(f: float) -> dict[str, float]:
        return {k: min(max(min(f, need(b)), b.min_w), b.max_w) for k, b in bids.items()}

    fair = budget_w / len(bids)
    if sum(at(fair).values()) <= budget_w:
        return at(fair)
    lo, hi = 0.0, fair
    for _ in range(iters):
        mid = (lo + hi) / 2
        if sum(at(mid).values()) > budget_w:
            hi = mid
        else:
            lo = mid
    return at(lo)


def _idle(bid: Bid) -> bool:
    """No work at all (its value, 2 λ / W, is 0 only before anything has arrived)."""
    return bid.value_per_w <= 0.0


def static_split(bids: Mapping[str, Bid], budget_w: float) -> dict[str, float]:
    """budget / N clipped to each member's bounds: a minimum above it takes more and the others
    shrink to fit. A member with no work at all keeps only its want (what it draws plus
    headroom: it loses nothing, and a lease brings its split back as soon as work comes); the
    watts it and any maximum leave are spread over the members with work, then over all."""

    def need(b: Bid) -> float:
        return _need_w(b) if _idle(b) else b.max_w

    shares = fair_floors(bids, budget_w, need=need)
    _spread(shares, bids, budget_w, [k for k, b in bids.items() if not _idle(b)])
    return _spread(shares, bids, budget_w)


def allocate(bids: Mapping[str, Bid], budget_w: float) -> dict[str, float]:
    """The targets (module docstring): the static split while no member is needy; else fair
    floors, the surplus water-filled over the members that can use more than their floor (each
    up to its need: its maximum if needy, else its want), then what is left spread, over the
    needy first, then over everyone."""
    if not bids:
        return {}
    if not any(b.needy for b in bids.values()):
        return static_split(bids, budget_w)
    shares = fair_floors(bids, budget_w, need=_kept_w)
    hungry = {k: _need_w(b) for k, b in bids.items() if _need_w(b) > shares[k] + 1e-9}
    left = budget_w - sum(shares.values())
    if hungry and left > 1e-6:
        sub = {
            k: Bid(bids[k].value_per_w, bids[k].want_w, shares[k], need, bids[k].needy)
            for k, need in hungry.items()
        }
        shares.update(water_fill(sub, left + sum(shares[k] for k in hungry)))
    _spread(shares, bids, budget_w, [k for k, b in bids.items() if b.needy])
    return _spread(shares, bids, budget_w)


def hold_small_moves(
    targets: Mapping[str, float],
    grants: Mapping[str, float],
    band_w: float,
    needy: Iterable[str] = (),
) -> dict[str, float]:
    """The targets, except that a member whose target is under its grant by less than
    `band_w` keeps its grant (a lower share cuts its batch), unless a `needy` member is being
    raised: raises are paid only from unheld watts (book.py), so a small cut held back is a
    needy member's raise held back (a member lent out held 200 W of its 245-W split 2.5 s
    into its burst while one above its split kept 15 W, the bursts case, docs/fleet.md, stop
    44). Raises are always made: a raise held back would leave its watts in the pool,
    undrawn."""
    out = dict(targets)
    if any(targets.get(k, 0.0) > grants.get(k, 0.0) + 1e-6 for k in needy):
        return out
    for k, w in targets.items():
        g = grants.get(k)
        if g is not None and 0.0 < g - w < band_w:
            out[k] = g
    return out
