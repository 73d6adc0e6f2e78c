"""An async OpenAI-API load client: sends a planned load and records what a user would see."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp

from powerbatch.energy.usage import tail_energy_j
from powerbatch.load.profile import PlannedRequest
from powerbatch.sse import usage_completion_tokens

_FIRST_TOKEN = re.compile(rb'"(?:content|text)":"[^"]')


@dataclass(frozen=True, slots=True)
class RequestResult:
    t_start_s: float  # offset from the start of the run, as sent
    priority: str
    phase: int
    status: int  # HTTP status; 0 when the connection failed; 599 when a stream broke
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    energy_j: float | None = None  # usage.energy_j, where the server reports it (powerbatch)
    late: bool = False  # ended after no answer still running could count (`run_load`'s finish)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def within_slo(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        """Goodput counts a request that finished with its first token and every later one in
        time."""
        if not self.ok or self.ttft_s is None or self.ttft_s > ttft_slo_s:
            return False
        return self.tpot_s is None or self.tpot_s <= tpot_slo_s


@dataclass(slots=True)
class InFlight:
    """A request still unanswered, as far as the drain needs it (monotonic seconds; None: not
    yet, e.g. waiting for `run_load`'s concurrency gate, whose wait no SLO clock counts)."""

    max_tokens: int
    sent_s: float | None = None
    first_token_s: float | None = None

    def may_meet(self, now_s: float, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        """False once no ending of this answer can count as goodput (`within_slo`): its first
        token is later than the TTFT SLO, or even its longest answer (`max_tokens`) could not
        average the TPOT SLO over the tokens after the first. A non-streamed answer's first
        token is its whole answer, so only the first rule applies to it."""
        if self.sent_s is None:
            return True
        if self.first_token_s is None:
            return now_s - self.sent_s <= ttft_slo_s
        return now_s - self.first_token_s <= (self.max_tokens - 1) * tpot_slo_s


def chat_body(req: PlannedRequest, model: str) -> bytes:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "tok " * req.prompt_tokens}],
        "max_tokens": req.max_tokens,
        "stream": req.stream,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


async def send_one(
    session: aiohttp.ClientSession,
    base_url: str,
    req: PlannedRequest,
    t_run0: float,
    model: str,
    api_key: str | None = None,
    in_flight: InFlight | None = None,
) -> RequestResult:
    """Send `req`; what the user saw. `in_flight`, where given, learns the send and first-token
    times as they happen."""
    t0 = time.monotonic()
    if in_flight is not None:
        in_flight.sent_s = t0
    headers = {"Content-Type": "application/json", "x-priority": req.priority}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    ttft: float | None = None
    tokens = 0

    def result(
        status: int,
        ttft_s: float | None,
        error: str | None = None,
        *,
        e2e_s: float | None = None,
        energy_j: float | None = None,
    ) -> RequestResult:
        """What the user saw, ended now (or at `e2e_s`)."""
        e2e = time.monotonic() - t0 if e2e_s is None else e2e_s
        start_s, prompt = t0 - t_run0, req.prompt_tokens
        return RequestResult(
            start_s, req.priority, req.phase, status, ttft_s, e2e, prompt, tokens, error, energy_j
        )

    try:
        async with session.post(
            base_url.rstrip("/") + "/v1/chat/completions",
            data=chat_body(req, model),
            headers=headers,
        ) as resp:
            if resp.status != 200:
                text = await resp.text()
                return result(resp.status, None, text[:200])
            if not req.stream:
                payload = await resp.json()
                e2e = time.monotonic() - t0
                usage = payload.get("usage") or {}
                tokens = int(usage.get("completion_tokens", 0))
                energy = usage.get("energy_j")
                joules = float(energy) if isinstance(energy, int | float) else None
                return result(200, e2e, e2e_s=e2e, energy_j=joules)
            tail = b""
            async for chunk in resp.content.iter_any():
                if ttft is None and _FIRST_TOKEN.search(chunk):
                    ttft = time.monotonic() - t0
                    if in_flight is not None:
                        in_flight.first_token_s = t0 + ttft
                tail = (tail + chunk)[-2048:]
            error = None
            if b'"error"' in tail:
                error = "error event in stream"
            tokens = usage_completion_tokens(tail) or 0
            return result(599 if error else 200, ttft, error, energy_j=tail_energy_j(tail))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return result(0, ttft, f"{type(exc).__name__}: {exc}")


async def run_load(
    base_url: str,
    plan: list[PlannedRequest],
    *,
    model: str = "sim-llama",
    drain_timeout_s: float | None = 120.0,
    slo_s: tuple[float, float] | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    api_key: str | None = None,
    concurrency: int | None = None,
    finish_s: float | None = None,
) -> list[RequestResult]:
    """Send each planned request at its offset; then wait for the answers still running.

    The wait ends when every answer is in, after `drain_timeout_s` (None: no limit), or, with
    `slo_s` = (TTFT SLO, TPOT SLO), as soon as none still running can count as goodput
    (`InFlight.may_meet`): waiting longer could not change a goodput figure, however slow the
    server. Answers still running then are cancelled and not recorded, unless `finish_s` is
    given: then the wait goes on, that much longer at most, and the answers that end in it are
    recorded `late`. Tokens and joules need them: an arm whose answers are cut off unanswered
    would otherwise show fewer tokens made from the same load, and no J/token comparable with an
    arm that answered them all.

    With `concurrency`, at most that many are outstanding: a request due while all are busy
    waits for one to finish (a closed cap on an open schedule, so a slow server is not flooded).
    """
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t_run0 = time.monotonic()
        tasks: dict[asyncio.Task[None], InFlight] = {}
        late = False

        async def one(req: PlannedRequest, seen: InFlight) -> None:
            if gate is None:
                result = await send_one(session, base_url, req, t_run0, model, api_key, seen)
            else:
                async with gate:
                    result = await send_one(session, base_url, req, t_run0, model, api_key, seen)
            if late:
                result = replace(result, late=True)
            results.append(result)
            if on_result is not None:
                on_result(result)

        for req in plan:
            delay = t_run0 + req.t_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            seen = InFlight(req.max_tokens)
            task = asyncio.create_task(one(req, seen))
            tasks[task] = seen
            task.add_done_callback(tasks.pop)
        await _drain(tasks, drain_timeout_s, slo_s, cancel=finish_s is None)
        if finish_s is not None:
            late = True
            await _drain(tasks, finish_s, None, cancel=True)
    return results


async def _drain(
    tasks: dict[asyncio.Task[None], InFlight],
    timeout_s: float | None,
    slo_s: tuple[float, float] | None,
    *,
    cancel: bool,
) -> None:
    """Wait for `tasks` as `run_load` says; with `cancel`, cancel what is left."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while tasks:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        if slo_s is not None and not any(f.may_meet(now, *slo_s) for f in tasks.values()):
            break
        left = 1.0 if deadline is None else min(1.0, deadline - now)
        await asyncio.wait(list(tasks), timeout=left)
    if not cancel:
        return
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
