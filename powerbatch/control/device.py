"""The device power limit as the loop sees it: the limit it may lean on, and sets made off the
tick (a set takes milliseconds to a second, zeusd's block=true, and a tick must not wait)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from powerbatch.telemetry.limiter import LimitActuator

log = logging.getLogger("powerbatch.control")


class DeviceLimit:
    """One set at a time; the next tick brings the newest request. The limiter starts first
    and stops last: it restores a limit a crashed run left behind before anything else."""

    def __init__(self, actuator: LimitActuator) -> None:
        self.actuator = actuator
        self._applying: asyncio.Task[None] | None = None
        self._set_under_w: float | None = None  # the ceiling when the limit last changed

    def in_force_w(self) -> float | None:
        """The limit the controller may lean on: None while degraded (admission alone then
        holds the ceiling with the software margin)."""
        return None if self.actuator.degraded else self.actuator.in_force_w

    def bounds_w(self) -> tuple[float, float] | None:
        return self.actuator.bounds_w()

    def status(self) -> dict[str, Any]:
        return self.actuator.status()

    async def start(self) -> None:
        if not await self.actuator.start():
            log.error("power limiter degraded at start: %s", self.actuator.degraded_reason)

    async def apply(self, requested_w: float | None) -> None:
        """Set the limit now and wait for it (start-up: before the first request)."""
        if requested_w is not None:
            await self._apply(requested_w)

    def request(self, requested_w: float | None, ceiling_w: float | None = None) -> None:
        """Hand the requested limit to the actuator off the tick (no loop: a tick driven by
        hand in a test sets nothing). A raise waits the actuator's pace, unless the ceiling
        (a fleet share) has risen since the limit last changed: those watts are granted, and
        a share raised just after it fell would otherwise stay undrawn for the pace."""
        if requested_w is None or (self._applying is not None and not self._applying.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        under = self._set_under_w
        rose = ceiling_w is not None and under is not None and ceiling_w > under
        self._applying = loop.create_task(
            self._apply(requested_w, ceiling_w, paced=not rose), name="powerbatch-limit"
        )

    async def _apply(
        self, requested_w: float, ceiling_w: float | None = None, paced: bool = True
    ) -> None:
        before = self.actuator.in_force_w
        try:
            await self.actuator.apply(requested_w, paced)
        except Exception:  # the actuator reports its own failures; this is a bug guard
            log.exception("applying the device power limit failed")
        if self.actuator.in_force_w != before:
            self._set_under_w = ceiling_w

    async def stop(self) -> None:
        if self._applying is not None:
            with contextlib.suppress(Exception):
                await self._applying
        try:
            await self.actuator.restore()
        except Exception as exc:  # the state file makes the next start restore it
            log.error("could not restore the device power limit: %s", exc)
        await self.actuator.limiter.close()
