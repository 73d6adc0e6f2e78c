"""Engine-queue law: work the engine would only queue waits in powerbatch's queue instead.

An inference server queues what it cannot run yet in its own first-come queue (vLLM's
default `--scheduling-policy fcfs`): what the step's token budget, `max_num_seqs` or the free
KV blocks leave waiting. A request there is past admission: its class no longer orders it,
and a stream behind a backlog of batch prompts waits for its first token as long as they do.
A hardware cap knows no classes either; this is where admission can do better than it.

So while the engine's waiting queue (`EngineLoad.queued`) stands longer than a buffer of
`max(engine_min_buffer, engine_queue_s × its start rate)`, the in-flight cap is the requests
it runs plus that buffer. Standing: the shorter of the last two scrapes' queues is over it, as
CoDel tells a standing queue from a burst's by the least delay over an interval (K. Nichols and
V. Jacobson, "Controlling Queue Delay", ACM Queue 10(5), 2012). A burst's prompts wait a step
or two for the engine's token budget, and a scrape then may see most of them waiting: on the
first scrapes of a fleet member's load, at a start rate barely measured, the law held it to ten
requests and grew it a buffer a scrape, while 17-25 waited in its admission queue for four
seconds (19 of its first 58 requests missed the SLOs, none behind the hardware split;
docs/fleet.md, stop 54). The engine stays fed (its queue holds about the buffer, enough to
start what it can until the next scrape refills it; a finishing request frees a slot here and
the next waiter goes at once) and the surplus waits in the admission queue, where the top
class's streams go first. The engine's own limits are not known, only seen: once its queue is
under half the buffer the cap grows by `max(buffer, engine_growth_frac × cap)` per scrape, and
lets go at the maximum batch. The counts are scraped (once a second) and so lag; the buffer
(two seconds of starts by default) also covers a rise in what the engine can run before the
next scrape shows it. With no scraped counts the law holds nothing back.
"""

from __future__ import annotations

import math

from powerbatch.control.config import ControlConfig
from powerbatch.control.types import EngineLoad


class EngineLaw:
    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.cap: int | None = None  # None: the engine's queue holds nothing back
        self._scraped_t_s: float | None = None
        self._queued_before: float | None = None  # the engine's queue at the scrape before

    def buffer(self, start_rate: float) -> int:
        g = self.config.gains
        return max(g.engine_min_buffer, math.ceil(g.engine_queue_s * start_rate))

    def update(self, engine: EngineLoad | None, in_flight: int) -> None:
        """Act once per new scrape: the counts between two scrapes are the same counts."""
        if engine is None:
            self.cap, self._scraped_t_s, self._queued_before = None, None, None
            return
        if engine.t_s == self._scraped_t_s:
            return
        self._scraped_t_s = engine.t_s
        buffer = self.buffer(engine.start_rate)
        before, self._queued_before = self._queued_before, engine.queued
        if before is not None and min(before, engine.queued) > buffer:
            self.cap = max(self.config.min_batch, math.ceil(engine.running) + buffer)
        elif self.cap is not None and 2 * engine.queued <= buffer:
            step = max(buffer, math.ceil(self.config.gains.engine_growth_frac * self.cap))
            grown = max(self.cap, in_flight) + step
            self.cap = None if grown >= self.config.max_batch else grown
