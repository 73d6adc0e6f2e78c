"""The attribution rule: each interval's metered energy, less idle, split by the work done in it.

Pure and clock-free: callers pass times and energies. For one interval of `dt_s` seconds with
metered energy `delta_j`:

* idle energy is `min(delta_j, idle_w * dt_s)`: what the GPUs would draw with nothing to do. It
  is reported on its own and never charged to a request (so a request's joules do not depend on
  how busy the server was when it ran);
* the rest is split over the requests in flight in proportion to their work units in the
  interval: `prefill_weight * prompt tokens prefilled + tokens generated`. In a continuous
  batch every running request advances by one token per step, so generated tokens measure each
  request's share of the steps; a prompt token costs `prefill_weight` of a generated one
  (compute-bound prefill spreads a step's energy over many more tokens);
* a request whose tokens the host cannot see as they are made (a non-streamed answer arrives
  whole) is charged an estimate: the mean generated tokens of the requests that were seen
  decoding in the interval, or one token when none was;
* with no work in flight at all, everything metered is idle.

So attributed + idle equals metered in every interval (to float rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Labels = tuple[str, str, str]
"""(priority, tenant, model): what a request's energy is totalled by."""

DEFAULT_PREFILL_WEIGHT = 0.25
"""Energy of a prompt token relative to a generated token, where the power model cannot say.

From published figures for Llama-3.1-8B on one H100 SXM: compute-bound prefill runs near the
power limit ("Illusion of Power Capping in LLM Decode", arXiv 2605.11999) at about 25,000 tokens/s
(2 x 8e9 FLOP per token at 40% of the 989 TFLOP/s bf16 peak, NVIDIA's datasheet), about
665 W / 25,000 = 0.027 J per prompt token; decode at batch 64 draws about 620 W at an 11 ms step
(the ML.ENERGY leaderboard fits in GPU-to-Grid, arXiv 2602.05116), 620 W x 0.011 s / 64 = 0.11 J
per generated token. 0.027 / 0.11 is about 0.25.
"""

# A learned weight outside this range is noise (a coefficient fitted on too little prefill).
_WEIGHT_RANGE = (0.01, 10.0)


class RequestEnergy:
    """One request's account: work in the open interval, and joules charged so far.

    The host adds work as it sees it (`add`), marks the request `finished`, and reads
    `energy_j` after the interval that includes its end has been settled. Made by
    `EnergyLedger.begin`, which it tells of its work and its end, so a settle visits only the
    requests with work in the interval.
    """

    __slots__ = (
        "_charged_j",
        "_done",
        "_finished",
        "_ledger",
        "_pending",
        "_share0_j",
        "decode_tokens",
        "labels",
        "observed",
        "prefill_tokens",
    )

    def __init__(self, ledger: EnergyLedger, labels: Labels, observed: bool = True) -> None:
        self.labels = labels
        self.observed = observed  # False: its tokens are not seen as they come (estimated)
        self.prefill_tokens = 0.0
        self.decode_tokens = 0.0
        self._ledger = ledger
        self._charged_j = 0.0  # all but the estimated decoding's share, below
        self._share0_j = ledger.estimated_share_j  # that share's running sum at the start
        self._pending = False  # has work in the open interval (in the ledger's list)
        self._finished = False
        self._done = False  # dropped from the ledger: the account is closed

    def add(self, prefill_tokens: float = 0.0, decode_tokens: float = 0.0) -> None:
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        if not self._pending and not self._done:
            self._pending = True
            self._ledger._worked.append(self)

    @property
    def finished(self) -> bool:
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        """Once True it stays: charged in the next settle, then dropped."""
        if value and not self._finished:
            self._finished = True
            self._ledger._finished.append(self)

    @property
    def energy_j(self) -> float:
        """Joules charged so far, over the intervals settled."""
        if self.observed or self._done:
            return self._charged_j
        return self._charged_j + self._ledger.estimated_share_j - self._share0_j


@dataclass(frozen=True, slots=True)
class IntervalSplit:
    """One settled interval: metered = idle + the charges, here summed by labels."""

    dt_s: float
    metered_j: float
    idle_j: float
    by_labels_j: dict[Labels, float]

    @property
    def attributed_j(self) -> float:
        return math.fsum(self.by_labels_j.values())


def split_energy(
    delta_j: float, dt_s: float, idle_w: float, units: Sequence[float]
) -> tuple[float, list[float]]:
    """(idle joules, each request's joules) for one interval; see the module's docstring."""
    delta_j = max(0.0, delta_j)
    idle_j = min(delta_j, max(0.0, idle_w) * max(0.0, dt_s))
    total = math.fsum(units)
    if total <= 0.0:
        return delta_j, [0.0] * len(units)
    rest_j = delta_j - idle_j
    return idle_j, [rest_j * u / total for u in units]


def learned_prefill_weight(
    prefill_j_per_token: float, busy_w: float, decode_tok_s: float
) -> float | None:
    """The weight from a fitted power model, or None where it cannot be trusted.

    `prefill_j_per_token` is the model's marginal watts per prompt token/s (W per token/s is
    J per token); `busy_w` the modelled power above idle with prefill taken out, spent on
    `decode_tok_s` generated tokens per second.
    """
    if not (busy_w > 0 and decode_tok_s > 0 and prefill_j_per_token > 0):
        return None
    weight = prefill_j_per_token / (busy_w / decode_tok_s)
    lo, hi = _WEIGHT_RANGE
    return weight if lo <= weight <= hi else None


class EnergyLedger:
    """The requests in flight and the running totals, settled one interval at a time.

    A settle costs the requests with work seen in the interval, not all in flight: each request
    whose decoding is estimated is charged the same share an interval, kept as one running sum
    (`estimated_share_j`) that its account reads from its start to its end. The proxy settles
    at every request's end with all its other requests in flight, most of them unobserved.
    """

    def __init__(self, prefill_weight: float = DEFAULT_PREFILL_WEIGHT) -> None:
        self.prefill_weight = prefill_weight
        self._live: dict[RequestEnergy, None] = {}  # in the order they began
        self._worked: list[RequestEnergy] = []  # with work in the open interval
        self._finished: list[RequestEnergy] = []  # to drop at the next settle
        self._estimated: dict[Labels, int] = {}  # unobserved requests in flight, by labels
        self.estimated_share_j = 0.0  # what one unobserved request in flight all along got
        self.totals_j: dict[Labels, float] = {}
        self.idle_j = 0.0
        self.metered_j = 0.0

    def begin(
        self, labels: Labels, *, observed: bool = True, prefill_tokens: float = 0.0
    ) -> RequestEnergy:
        rec = RequestEnergy(self, labels, observed)
        self._live[rec] = None
        if not observed:
            self._estimated[labels] = self._estimated.get(labels, 0) + 1
        if prefill_tokens:
            rec.add(prefill_tokens=prefill_tokens)
        return rec

    @property
    def in_flight(self) -> int:
        return len(self._live)

    @property
    def live(self) -> tuple[RequestEnergy, ...]:
        """The requests of the open interval, in the order they began."""
        return tuple(self._live)

    def settle(self, delta_j: float, dt_s: float, idle_w: float) -> IntervalSplit:
        """Charge the interval that ends now; drop the requests that finished within it."""
        worked, self._worked = self._worked, []
        w = self.prefill_weight
        # Unseen decoding: the mean of the requests seen decoding, or one token (module doc).
        seen = [r.decode_tokens for r in worked if r.observed and r.decode_tokens > 0]
        estimate = math.fsum(seen) / len(seen) if seen else 1.0
        estimated = sum(self._estimated.values())
        units = [w * r.prefill_tokens + (r.decode_tokens if r.observed else 0.0) for r in worked]
        idle_j, charges = split_energy(delta_j, dt_s, idle_w, [*units, estimated * estimate])
        by_labels: dict[Labels, float] = {}
        for rec, j in zip(worked, charges, strict=False):
            rec._charged_j += j
            rec.prefill_tokens = rec.decode_tokens = 0.0
            rec._pending = False
            by_labels[rec.labels] = by_labels.get(rec.labels, 0.0) + j
        share_j = charges[-1] / estimated if estimated else 0.0
        if share_j > 0:
            self.estimated_share_j += share_j
            for labels, n in self._estimated.items():
                if n:
                    by_labels[labels] = by_labels.get(labels, 0.0) + share_j * n
        totals = self.totals_j
        for labels, j in by_labels.items():
            totals[labels] = totals.get(labels, 0.0) + j
        self.idle_j += idle_j
        self.metered_j += max(0.0, delta_j)
        finished, self._finished = self._finished, []
        for rec in finished:
            self._drop(rec)
        return IntervalSplit(dt_s, max(0.0, delta_j), idle_j, by_labels)

    def _drop(self, rec: RequestEnergy) -> None:
        if not rec.observed:
            rec._charged_j = rec.energy_j  # the estimated share up to now, closed
            self._estimated[rec.labels] -= 1
        rec._done = True
        del self._live[rec]


class EnergyMeter:
    """The energy metered between calls, from a power reading.

    Where the source has an energy counter, its increase is used, carried forward from the
    counter's sample to now at the sample's power (a counter is read at the poll rate, an
    interval may end between polls); an overshoot is taken back from the next interval, never
    made negative, so the sum over intervals follows the counter, across sensor gaps too.
    Without a counter: power x dt, and a gap with no trusted reading is unmetered (counted in
    `unmetered_s`).
    """

    def __init__(self) -> None:
        self._t_s: float | None = None
        self._counter_j: float | None = None  # the counter's last raw value
        self._metered_to_j: float | None = None  # the counter scale reached so far
        self.unmetered_s = 0.0

    def advance(
        self,
        t_s: float,
        power_w: float | None,
        energy_j: float | None = None,
        energy_age_s: float = 0.0,
    ) -> tuple[float, float]:
        """(joules, seconds) since the last call; the first call starts the meter at zero."""
        dt_s = 0.0 if self._t_s is None else max(0.0, t_s - self._t_s)
        self._t_s = t_s
        if power_w is None or not math.isfinite(power_w):
            # No trusted reading now. A counter keeps counting: the gap's energy comes with
            # the next good reading. Without one, the gap is lost.
            if self._metered_to_j is None:
                self.unmetered_s += dt_s
            return 0.0, dt_s
        if energy_j is None or not math.isfinite(energy_j):
            self._counter_j = self._metered_to_j = None
            return power_w * dt_s, dt_s
        now_j = energy_j + power_w * max(0.0, energy_age_s)
        last = self._metered_to_j
        if last is None or self._counter_j is None or energy_j < self._counter_j:
            # First reading of a counter, or it went back (a reset): start from here.
            self._counter_j, self._metered_to_j = energy_j, now_j
            return power_w * dt_s, dt_s
        self._counter_j = energy_j
        self._metered_to_j = max(last, now_j)
        return max(0.0, now_j - last), dt_s
