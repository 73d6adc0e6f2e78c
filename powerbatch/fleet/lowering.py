"""A share that falls: the device limit comes down first (docs/fleet.md, "A share that falls").

Handed straight to the control loop, a lower share reads as a breach: the meter still shows the
last second's power, drawn under the higher share, so the loop cuts the batch and work queues,
where a server whose cap fell would only slow down. So while its share comes down, a member
shows the loop a ceiling that follows its meter down from the old one (never above what it
held, never up), and asks for the new share's device limit at once (`limit_w`); the loop, held
by that limit, keeps its batch and slows as a capped server does. Once that limit is in force
it bounds the draw, so a meter still over the share shows what was drawn before it took: the
ceiling then follows the meter, up or down but never over the ceiling before the fall, until
a reading wholly after the fall (`Meter.span_s`) reads the share: a lagging meter read against
the share would be a breach, and cut the batch, and a low reading taken before the fall ended
the lowering too soon on a meter 2 s late (docs/fleet.md, stop 36). Before the limit holds,
the ceiling follows the meter down, never up, and never under the limit still in force while
the new one is due (a ceiling under the limit in force reads as no limit to the loop, whose
admission law then cuts the batch; stop 44), and once the meter reads the new share (after
that span, where a limit is due), or after `MAX_S`, the share itself is the ceiling. Without a
device limit the ceiling follows the meter down the same way, and admission steps the batch
down rather than cutting it.

Why it is safe: the member's draw stays under the old ceiling, which Redis still holds for it
until a renewal reports less; and a renewal reports less only once the meter shows it or, with
a device limit, once the lower limit is in force (the limit bounds the draw: `Lease.using_w`),
after which the ceiling shown bounds nothing the budget counts on.
"""

from __future__ import annotations

from dataclasses import dataclass

LIMIT_SET_GRACE_S = 1.0  # a device limit set still in flight this long: wait for it
MAX_S = 3.0  # at most this long above the share
FOLLOW_SLACK_FRAC = 0.02  # the ceiling shown stays this far over the last reading
LIMIT_TOLERANCE_W = 0.5  # the limit in force may be this far over the one asked for


@dataclass(frozen=True, slots=True)
class Meter:
    """The host loop's last tick, as a member reads it each tick (cheap: no model)."""

    power_w: float | None = None  # the power the loop acts on (its 1-s mean)
    limit_w: float | None = None  # the device limit in force; None: none, or degraded
    limit_margin_frac: float = 0.0  # the loop sets the limit this share under its ceiling
    limited: bool = False  # a limiter controls the device (its limit may be in flight)
    span_s: float = 0.0  # how far back a reading reaches (the loop's `reading_span_s`)
    lowest_w: float = 0.0  # the lowest limit the device accepts (a lower ask is set at this)
    queued: int = 0  # requests waiting at the last tick
    in_flight: int = 0  # and running


class Lowering:
    """The ceiling shown to the loop, tick by tick, and the device limit asked for under it."""

    def __init__(self) -> None:
        self.ceiling_w: float | None = None  # shown on the last tick
        self.since: float | None = None  # when the share fell below it
        self.from_w = 0.0  # the ceiling shown then: what the draw was under before the fall
        self.asked_at = 0.0  # when the share last fell: the lower limit asked for then
        self.share_w = 0.0  # the share on the last tick
        self.limit_w: float | None = None  # the limit to ask for this tick, or None
        self.limit_holds = False  # the lower limit is in force

    def show(self, now: float, share_w: float, live: bool, held_w: float, m: Meter) -> float:
        """The ceiling for this tick, given the usable share and what Redis holds for it."""
        prev = self.ceiling_w
        out = share_w
        keep = False  # a lower limit holds (or is due) and no reading is yet wholly after the fall
        self.limit_w, self.limit_holds = None, False
        if self.since is not None and share_w >= self.from_w - 1e-6:
            self.since = None  # the share is back where it fell from
        going = self.since is not None or (prev is not None and share_w < prev - 1e-6)
        if live and prev is not None and m.power_w is not None and going:
            if self.since is None:
                self.since, self.from_w, self.asked_at = now, prev, now
            elif share_w < self.share_w - 1e-6:  # a further fall asks for a lower limit: its
                # own grace to be set, and its own reading wholly after it (a share that fell
                # again 1.5 s into a fall was shown at once while the meter read the old one:
                # a breach, and the batch cut from 51 to 3, the bursts case, stop 44)
                self.asked_at = now
            age, asked = now - self.since, now - self.asked_at
            want_limit = share_w * (1.0 - m.limit_margin_frac)
            holds = m.limit_w is not None and m.limit_w <= max(want_limit, m.lowest_w) + (
                LIMIT_TOLERANCE_W
            )
            waiting = m.limited and not holds and asked >= LIMIT_SET_GRACE_S
            over_w = m.power_w * (1.0 + FOLLOW_SLACK_FRAC)
            keep = m.limited and not waiting and asked < m.span_s  # the limit holds or is due
            if holds and (m.power_w > share_w or keep):  # the limit bounds the draw, so the
                # meter shows what was drawn before it took (under the old ceiling): follow it
                # until a reading after the fall reads the share, up as well as down, with no
                # deadline and no hold to obey
                out = max(share_w, min(self.from_w, over_w))
            elif age < MAX_S and not waiting and m.power_w > share_w:
                out = max(share_w, min(prev, held_w, over_w))
            if m.limited and not holds and not waiting and m.limit_w is not None:
                # the lower limit is due: the one in force still bounds the draw, and Redis
                # holds the old share for it; under a ceiling below it the loop reads no
                # limit and its admission law cuts the batch the new limit was about to hold
                # (a member lent out cut its batch from 8 to 2 as its burst began, stop 44)
                out = max(out, min(m.limit_w, prev, held_w))
            if m.limited:
                self.limit_w, self.limit_holds = want_limit, holds
        if out <= share_w + 1e-9 and not keep:
            out, self.since = share_w, None
        self.ceiling_w, self.share_w = out, share_w
        return out

    def reset(self) -> None:
        self.ceiling_w, self.since, self.limit_w, self.limit_holds = None, None, None, False
        self.from_w = 0.0
