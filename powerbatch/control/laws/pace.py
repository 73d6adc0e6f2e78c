"""Prefill pace: prompt tokens per second the watts allow, on top of the batch's decode.

Prefill is compute-bound: a burst of prompts is a burst of watts that the batch limit does not
see (a request replacing one that finished keeps the batch the same size). So the pace is the
fastest rate whose modelled watts, over those of the load the meter measured (`seen`), added to
the 1-second meter, fit under the target: the meter for the level, the model for the slope, as
in the batch law. The load the pace is priced at is the batch running now (`running` requests,
at most the limit), so the watts of requests admitted since the reading are not granted again
to prompts: a meter a second behind would otherwise see the room twice at the start of a burst.
Requests still queued are not counted: the pace is what admits them. The watts are the model's
upper bound at r less its upper bound at `seen`, so a rate the model has seen little of (its
bound widens away from the data) is priced higher than its mean. Near the target the pace is
about the prompt flow now; over it, slower. It never exceeds `pace_max` × the larger of the
batch's steady prompt flow and the highest flow the meter saw lately (a burst let through at
once is a burst of watts the model has not seen; the flow it has seen is the base it explores
from, so a binding pace, which keeps the batch small, cannot starve itself) and never
falls under `min_prefill_tok_s` (a trickle still feeds the batch; the batch law, not a stalled
queue, answers a plant whose decode fills the target). Not counted: one reading's spread (the
batch law adds it; added here too, it starved the batch of prompts). Off under a device limit,
which clips a burst within milliseconds: pacing it as well would only delay first tokens.
"""

from __future__ import annotations

import numpy as np

from powerbatch.control.config import ControlConfig
from powerbatch.estimate import Features, PowerModel
from powerbatch.estimate.features import design_prefill_sweep, design_row

RATES = 16
"""Rates tried between the floor and the top, geometrically spaced."""


def prefill_pace(
    config: ControlConfig,
    model: PowerModel,
    per_request: Features,
    *,
    seen: Features,
    power_w: float,
    batch: int,
    running: float,
    target_w: float,
    seen_peak_tok_s: float = 0.0,
) -> float | None:
    """The pace in prompt tokens/s, or None when pacing is off."""
    if not config.prefill_pacing:
        return None
    floor = config.min_prefill_tok_s
    steady = max(per_request.prefill_tok_s * batch, seen_peak_tok_s)
    top = max(steady * config.gains.pace_max, floor)
    rates = np.geomspace(floor, top, RATES)
    ahead = seen.per_request().scaled(max(min(float(batch), running), seen.batch, 1.0))
    rows = np.vstack([design_prefill_sweep(ahead, rates), design_row(seen)])
    upper_w = model.predict_design(rows).upper_w
    ok = rates[power_w + upper_w[:-1] - upper_w[-1] <= target_w]
    return float(ok.max()) if len(ok) else floor
