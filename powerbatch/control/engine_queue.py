"""The upstream engine's own queue, start rate and step, from its counters: the proxy's scrape of
vLLM's metrics, or the vLLM plugin's own step counts (powerbatch_vllm.engine.StepStats), the
same counters kept exactly.

vLLM schedules its running requests first and then, while the step's token budget and free KV
blocks allow, its waiting queue in arrival order (vllm/v1/core/sched/scheduler.py): a request
in `vllm:num_requests_waiting` is one the next step will not start. The prompt being
prefilled this step is running, not waiting, and must not count as queued: the engine needs
it to fill the step. The start rate is the count of vLLM's TTFT histogram per second (it is
observed once per request, at its first output: vllm/v1/metrics/stats.py), or, from an
engine without it, the requests sent to it per second; until two scrapes have measured it
there is no load to act on. A failed scrape keeps the last load (its time unchanged, so the law
holds its cap and does not act on it again) for up to `MISSES_KEPT` scrapes in a row: one scrape
lost to a busy moment must not let the whole backlog into the engine's first-come queue.

The time per output token: the rises of vLLM's inter-token latency histogram's sum and count
(`vllm:inter_token_latency_seconds`, observed at each output after a request's first) between
scrapes give the time a running request waited per token. A request's TPOT is the mean of its
steps over its tokens, so the rises are averaged over a request's tokens: an exponential
average of both that forgets, per interval, the steps a decoding request took in it (the
count's rise over the requests decoding through it) over the tokens a request decodes (the
count's rises over the finished requests' rises, `vllm:request_decode_time_seconds`' count:
vllm/v1/metrics/stats.py); none until a request has finished, since one interval alone is one
prefill burst. Until then nothing is forgotten: the requests running have decoded through every
step since the first (forgotten each interval instead, the first reading was the last interval
alone, and a fleet member's first was a burst's 0.16-s step: docs/fleet.md, stop 54). A prefill
burst that slows a few steps slows no request much, a batch too large for the SLO slows every
one. That is what the requests running now will show at their end, a request's length before a
window of finished requests' p95 does. (Forgotten over a decode
*time* instead, a burst's slow second weighed as much as a decode's fast seconds: at a fleet
member's burst this average read 0.10-0.23 s a token against a 0.1-s SLO while the requests
running finished at 0.02-0.06 s, and the latency law held their successors queued for
seconds; docs/fleet.md, stop 50.) The last intervals' own (`step_s`, an
EWMA of `RATE_WEIGHT` a scrape) say whether the step is still slow now, after a shrink the
average still remembers. (The running count over the generated tokens per second would count the
requests in prefill, which make no tokens, as slow decodes.)

The engine's generated-token counter (`vllm:generation_tokens`) is kept for the last
`GENERATED_KEPT_S` of scrapes (`EngineLoad.generated`): the proxy counts one token per
streamed event and the rest of an answer's tokens (an answer not streamed, or events that carry
several) only when it ends, so its own decode rate over one second was off by 1.8x at the median
and 3.9x at the 90th percentile in a bursty bench run (`benchmarks/decode_rate_error.py`), and
follows the load about a second late; the engine's counter, read a second apart, does neither.
"""

from __future__ import annotations

import math
from collections import deque

from powerbatch.control.types import EngineLoad
from powerbatch.telemetry import UpstreamSignals
from powerbatch.telemetry.filters import ewma_step

RATE_WEIGHT = 0.3
"""EWMA weight per scrape of the start rate: a few scrapes, as bursts come and go."""


GENERATED_KEPT_S = 10.0
"""How far back the generated-token counter's scrapes are kept: past any meter's lag."""


MISSES_KEPT = 2
"""Failed scrapes in a row through which the last load is kept; at the next the engine is taken
for one without metrics, and its rate is measured anew."""


class EngineQueue:
    """Call `update` once per scrape, with the proxy's counts at the time of the scrape."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (t_s, requests started) at last scrape
        self._rate: float | None = None
        self.load: EngineLoad | None = None  # None until a start rate has been measured
        self._misses = 0  # failed scrapes in a row
        self._tokens: tuple[float, float, float] | None = None  # (t_s, ITL sum, ITL count)
        self._finished: float | None = None  # requests the engine has finished decoding, ever
        self._itl = (0.0, 0.0)  # the ITL sum's and count's rises, averaged over the horizon
        self._step_s: float | None = None  # the last intervals' mean ITL
        self._step_batch: float | None = None  # and the requests decoding over them
        self._per_request = (0.0, 0.0)  # ITL count and finished requests' rises, averaged
        self._generated: deque[tuple[float, float]] = deque()  # (t_s, tokens generated ever)

    def update(self, up: UpstreamSignals | None, admitted: int, in_flight: int) -> None:
        if up is None or up.requests_waiting is None or up.t_s is None:
            self._misses += 1
            if self._misses > MISSES_KEPT:
                self.load, self._last, self._rate = None, None, None
                self._generated.clear()
            return
        self._misses = 0
        self._update_generated(up.t_s, up.generation_tokens_total)
        count = admitted if up.requests_started_total is None else up.requests_started_total
        if self._last is not None and up.t_s > self._last[0]:
            rate = max(0.0, count - self._last[1]) / (up.t_s - self._last[0])
            self._rate = ewma_step(self._rate, rate, RATE_WEIGHT)
        self._last = (up.t_s, count)
        self._update_token_s(up)
        # No rate, no buffer that keeps the engine fed: the law waits for a second scrape.
        self.load = None
        if self._rate is not None:
            self.load = EngineLoad(
                up.requests_waiting,
                in_flight,
                self._rate,
                up.t_s,
                self.token_s,
                self._step_s,
                tuple(self._generated),
                self._step_batch,
            )

    def _update_generated(self, t_s: float, total: float | None) -> None:
        g = self._generated
        if total is None or (g and total < g[-1][1]):  # not exported, or the engine restarted
            g.clear()
        if total is None:
            return
        g.append((t_s, total))
        while g[0][0] < t_s - GENERATED_KEPT_S:
            g.popleft()

    def _update_token_s(self, up: UpstreamSignals) -> None:
        if up.itl_sum_s is None or up.itl_count is None or up.t_s is None:
            self._tokens, self._itl, self._step_s, self._step_batch = None, (0.0, 0.0), None, None
            return
        last, self._tokens = self._tokens, (up.t_s, up.itl_sum_s, up.itl_count)
        finished_before, self._finished = self._finished, up.decode_count
        if last is None or up.t_s <= last[0]:
            return
        count, total_s = up.itl_count - last[2], up.itl_sum_s - last[1]
        if count < 0 or total_s < 0:  # the engine restarted: its counts begin again
            self._itl, self._step_s, self._per_request = (0.0, 0.0), None, (0.0, 0.0)
            self._step_batch = None
            return
        finished = 0.0
        if finished_before is not None and self._finished is not None:
            finished = max(self._finished - finished_before, 0.0)
        w = 1.0 - RATE_WEIGHT
        self._per_request = (w * self._per_request[0] + count, w * self._per_request[1] + finished)
        tokens = self.tokens_per_request
        # Each request decoding through the interval took count / batch = dt × count / total_s
        # steps: the average over steps forgets exp(-steps / tokens) of what came before, and
        # weighs the interval's own steps as that decay does within it (their mean weight).
        steps = (up.t_s - last[0]) * count / total_s if total_s > 0 else 0.0
        keep, own = 1.0, 1.0  # no request finished yet: every step since decoding began
        if tokens:
            x = steps / tokens
            keep = math.exp(-x)
            own = 1.0 if x < 1e-9 else (1.0 - keep) / x
        self._itl = (keep * self._itl[0] + own * total_s, keep * self._itl[1] + own * count)
        if count > 0:
            self._step_s = ewma_step(self._step_s, total_s / count, RATE_WEIGHT)
            # The ITL sum's rise over the interval is the request-seconds spent waiting for
            # tokens: over the interval's length, the requests decoding through it, averaged
            # as the step is, so the two are one point of the step against the batch.
            batch = total_s / (up.t_s - last[0])
            self._step_batch = ewma_step(self._step_batch, batch, RATE_WEIGHT)

    @property
    def tokens_per_request(self) -> float | None:
        """Tokens after its first a finished request decoded, on average; None before one."""
        tokens, finished = self._per_request
        return tokens / finished if finished > 0 and tokens > 0 else None

    @property
    def token_s(self) -> float | None:
        total_s, count = self._itl
        return total_s / count if count >= 1.0 and self.tokens_per_request else None
