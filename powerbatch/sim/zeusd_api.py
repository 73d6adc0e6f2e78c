"""The simulator's zeusd: the Zeus node daemon's GPU API over the simulated GPUs.

Same paths, query parameters and JSON as zeusd (github.com/ml-energy/zeus, docs/zeusd/api.md), so
powerbatch's zeusd client, or Zeus's own, can be pointed at `powerbatch sim` as at a real node:

    GET  /discover, /time                       never need a token
    POST /gpu/set_power_limit                   gpu_ids (required), power_limit_mw, block
    GET  /gpu/get_power_limit                   gpu_ids optional: all GPUs
    GET  /gpu/get_power_limit_constraints
    GET  /gpu/get_power                         instant power per GPU
    GET  /gpu/get_cumulative_energy
    GET  /gpu/stream_power                      SSE, one event per GPU sample
    POST /gpu/set_gpu_locked_clocks             gpu_ids, min_clock_mhz, max_clock_mhz, block
    POST /gpu/reset_gpu_locked_clocks           gpu_ids, block
    POST /gpu/reset_locked_clocks               gpu_ids, block (all clock domains)

The clock routes follow zeusd/src/routes/gpu.rs to the letter: every field is required and none
other is allowed (serde's deny_unknown_fields), so a missing or malformed one is a 400 with
actix's plain-text "Query deserialize error: ..."; a bad `gpu_ids` list is a 400
`{"error": ...}` (routes/mod.rs parse_device_ids); an unknown GPU a 400 plain-text "GPU index N
does not exist."; a refused lock (block=true) `{"errors": {"<id>": "NVML error: ..."}}`.

Per-GPU limits are checked against the constraints as NVML checks them (a value outside is a 400
with zeusd's `{"errors": {"<id>": "<message>"}}`). A change takes effect `apply_delay_s` (100 ms)
after the request, not at once: `block=true` answers once it has; `block=false` answers at once.
With a token configured, /gpu/* want `Authorization: Bearer <token>` (401 otherwise); a real
zeusd's tokens are JWTs scoped to API groups, the simulator's is one shared string.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from powerbatch.errors import ClockError, PowerLimitError
from powerbatch.sim.engine import SimEngine

__all__ = ["DEFAULT_APPLY_DELAY_S", "add_zeusd_routes", "sim_gpu_pci_bus_id", "sim_gpu_uuid"]

_log = logging.getLogger(__name__)
DEFAULT_APPLY_DELAY_S = 0.1
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sim_gpu_uuid(gpu: int) -> str:
    """Simulated GPU `gpu`'s UUID, as NVML and dcgm-exporter's `UUID` label give it."""
    return f"GPU-5151a000-0000-4000-8000-{gpu:012d}"


def sim_gpu_pci_bus_id(gpu: int) -> str:
    """Its PCI address as dcgm-exporter's `pci_bus_id` label and NVML's busId write it; zeusd's
    /discover writes the same address with a 4-digit domain (`0000:18:00.0`)."""
    return f"00000000:{gpu + 0x18:02X}:00.0"


def _bad(message: str, status: int = 400) -> web.HTTPException:
    cls = {400: web.HTTPBadRequest, 401: web.HTTPUnauthorized}[status]
    return cls(text=json.dumps({"error": message}), content_type="application/json")


def _text_400(message: str) -> web.HTTPException:
    """actix-web's default error answer: the error's text, plain."""
    return web.HTTPBadRequest(text=message, content_type="text/plain")


def _now_ms() -> int:
    return int(time.time() * 1000)


class _ZeusdApi:
    def __init__(self, engine: SimEngine, token: str | None, apply_delay_s: float) -> None:
        self.engine = engine
        self.token = token
        self.apply_delay_s = apply_delay_s
        self.pending: set[asyncio.Task[None]] = set()

    @property
    def n(self) -> int:
        return self.engine.profile.num_gpus

    def _gpu_ids(self, request: web.Request, *, required: bool) -> list[int]:
        raw = request.query.get("gpu_ids")
        if raw is None or not raw.strip():
            if required:
                raise _bad("gpu_ids is required")
            return list(range(self.n))
        try:
            ids = [int(x) for x in raw.split(",") if x.strip()]
        except ValueError:
            raise _bad(f"gpu_ids must be a comma-separated list of integers, got {raw!r}") from None
        for i in ids:
            if not 0 <= i < self.n:
                raise _bad(f"GPU index {i} does not exist.")
        return ids

    def guarded(self, handler: _Handler) -> _Handler:
        """The bearer-token check of zeusd's /gpu/* routes."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            if self.token is not None:
                header = request.headers.get("Authorization", "")
                if header != f"Bearer {self.token}":
                    raise _bad("missing or invalid bearer token", 401)
            return await handler(request)

        return wrapped

    async def discover(self, request: web.Request) -> web.StreamResponse:
        profile = self.engine.profile
        return web.json_response(
            {
                "gpus": [
                    {
                        "id": i,
                        "name": profile.gpu_model_name,
                        "pci_address": sim_gpu_pci_bus_id(i)[4:].lower(),  # zeusd's spelling
                        "cumulative_energy_available": True,
                    }
                    for i in range(self.n)
                ],
                "cpus": [],
                "enabled_api_groups": ["gpu-control", "gpu-read"],
                "auth_required": self.token is not None,
            }
        )

    async def time(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"timestamp_ms": _now_ms()})

    async def get_power_limit(self, request: web.Request) -> web.StreamResponse:
        limits_w = self.engine.gpu_power_limits_w
        return web.json_response(
            {
                str(i): {"power_limit_mw": round(limits_w[i] * 1000)}
                for i in self._gpu_ids(request, required=False)
            }
        )

    async def get_constraints(self, request: web.Request) -> web.StreamResponse:
        lo, hi = self.engine.gpu_limit_constraints_w()
        return web.json_response(
            {
                str(i): {
                    "min_power_limit_mw": round(lo * 1000),
                    "max_power_limit_mw": round(hi * 1000),
                }
                for i in self._gpu_ids(request, required=False)
            }
        )

    def _each(
        self, ids: list[int], change: Callable[..., None], args: tuple[Any, ...], what: str
    ) -> dict[str, str]:
        """`change(gpu, *args)` on each GPU; NVML's refusal text for each that fails."""
        errors: dict[str, str] = {}
        for i in ids:
            try:
                change(i, *args)
            except (PowerLimitError, ClockError) as exc:
                errors[str(i)] = f"NVML error: the argument is invalid ({exc})"
        if len(errors) < len(ids):
            _log.info("zeusd: GPUs %s %s", ids, what)
        return errors

    async def _write(self, block: bool, route: str, *each: Any) -> web.StreamResponse:
        """A change after `apply_delay_s`; block=false answers at once and, as zeusd, reports
        only dispatch errors: a failure then is only logged."""
        if not block:
            task = asyncio.get_running_loop().create_task(self._later(route, *each))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
            return web.Response(status=200)
        await asyncio.sleep(self.apply_delay_s)
        errors = self._each(*each)
        if errors:
            return web.json_response({"errors": errors}, status=400)
        return web.Response(status=200)

    async def _later(self, route: str, *each: Any) -> None:
        await asyncio.sleep(self.apply_delay_s)
        errors = self._each(*each)
        if errors:
            _log.warning("zeusd: non-blocking %s failed: %s", route, errors)

    async def set_power_limit(self, request: web.Request) -> web.StreamResponse:
        ids = self._gpu_ids(request, required=True)
        raw, block = request.query.get("power_limit_mw"), request.query.get("block", "true")
        try:
            limit_mw = int(raw or "")
        except ValueError:
            raise _bad(f"power_limit_mw must be an integer, got {raw!r}") from None
        if limit_mw < 0 or block not in ("true", "false"):
            raise _bad("power_limit_mw must be >= 0 and block true or false")
        limit_w = limit_mw / 1000.0
        set_w, what = self.engine.set_gpu_power_limit_w, f"power limit {limit_w:.0f} W"
        return await self._write(block == "true", "set_power_limit", ids, set_w, (limit_w,), what)

    def _strict_query(self, request: web.Request, names: tuple[str, ...]) -> dict[str, str]:
        """zeusd's write query: every field required, no other allowed; actix's plain-text 400
        (its QueryPayloadError) otherwise."""
        for key in request.query:
            if key not in names:
                expected = ", ".join(f"`{n}`" for n in names)
                raise _text_400(
                    f"Query deserialize error: unknown field `{key}`, expected one of {expected}"
                )
        for name in names:
            if name not in request.query:
                raise _text_400(f"Query deserialize error: missing field `{name}`")
        q = {name: request.query[name] for name in names}
        if q["block"] not in ("true", "false"):
            raise _text_400("Query deserialize error: provided string was not `true` or `false`")
        for name in names:
            if name.endswith("_mhz") and not (q[name].isdigit() and int(q[name]) < 2**32):
                raise _text_400("Query deserialize error: invalid digit found in string")
        return q

    def _write_ids(self, raw: str) -> list[int]:
        """routes/mod.rs parse_device_ids, then gpu.rs's range check."""
        if not raw.strip():
            raise _bad("gpu_ids must contain at least one GPU index")
        ids: list[int] = []
        for part in raw.split(","):
            part = part.strip()
            if not part:
                raise _bad("gpu_ids contains an empty GPU index")
            if not part.isdigit():
                raise _bad(f"Invalid GPU index: {part}")
            ids.append(int(part))
        ids = sorted(set(ids))
        for i in ids:
            if i >= self.n:
                raise _text_400(f"GPU index {i} does not exist.")
        return ids

    async def _clock_write(
        self, q: dict[str, str], lock: tuple[int, int] | None
    ) -> web.StreamResponse:
        """Lock (None: reset) the SM clocks of the query's GPUs."""
        ids, block = self._write_ids(q["gpu_ids"]), q["block"] == "true"
        if lock is None:
            reset = self.engine.reset_gpu_locked_clocks
            return await self._write(block, "clock change", ids, reset, (), "SM clocks unlocked")
        what = f"SM clocks locked to {lock[0]}-{lock[1]} MHz"
        set_lock = self.engine.set_gpu_locked_clocks
        return await self._write(block, "clock change", ids, set_lock, lock, what)

    async def set_gpu_locked_clocks(self, request: web.Request) -> web.StreamResponse:
        q = self._strict_query(request, ("gpu_ids", "min_clock_mhz", "max_clock_mhz", "block"))
        return await self._clock_write(q, (int(q["min_clock_mhz"]), int(q["max_clock_mhz"])))

    async def reset_gpu_locked_clocks(self, request: web.Request) -> web.StreamResponse:
        return await self._clock_write(self._strict_query(request, ("gpu_ids", "block")), None)

    async def get_power(self, request: web.Request) -> web.StreamResponse:
        ids = self._gpu_ids(request, required=False)
        readings_w = self.engine.instant_power_per_gpu_w()
        return web.json_response(
            {
                "timestamp_ms": _now_ms(),
                "power_mw": {str(i): round(readings_w[i] * 1000) for i in ids},
            }
        )

    async def get_energy(self, request: web.Request) -> web.StreamResponse:
        ids = self._gpu_ids(request, required=False)
        per_gpu_mj = round(self.engine.energy_j() * 1000.0 / self.n)
        return web.json_response({str(i): {"energy_mj": per_gpu_mj} for i in ids})

    async def stream_power(self, request: web.Request) -> web.StreamResponse:
        ids = self._gpu_ids(request, required=False)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            while True:
                readings_w = self.engine.instant_power_per_gpu_w()
                now_ms = _now_ms()
                for i in ids:
                    event = {
                        "timestamp_ms": now_ms,
                        "gpu_id": i,
                        "power_mw": round(readings_w[i] * 1000),
                    }
                    await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await asyncio.sleep(0.1)
        except ConnectionResetError:  # the client went away
            pass
        return resp


def add_zeusd_routes(
    app: web.Application,
    engine: SimEngine,
    *,
    token: str | None = None,
    apply_delay_s: float = DEFAULT_APPLY_DELAY_S,
) -> None:
    """Serve zeusd's GPU API for `engine` on `app` (see the module docstring)."""
    api = _ZeusdApi(engine, token, apply_delay_s)

    async def on_cleanup(app: web.Application) -> None:
        for task in list(api.pending):
            task.cancel()

    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/discover", api.discover)
    app.router.add_get("/time", api.time)
    routes: list[tuple[str, str, Any]] = [
        ("POST", "/gpu/set_power_limit", api.set_power_limit),
        ("GET", "/gpu/get_power_limit", api.get_power_limit),
        ("GET", "/gpu/get_power_limit_constraints", api.get_constraints),
        ("GET", "/gpu/get_power", api.get_power),
        ("GET", "/gpu/get_cumulative_energy", api.get_energy),
        ("GET", "/gpu/stream_power", api.stream_power),
        ("POST", "/gpu/set_gpu_locked_clocks", api.set_gpu_locked_clocks),
        ("POST", "/gpu/reset_gpu_locked_clocks", api.reset_gpu_locked_clocks),
        # No memory-clock lock is modelled: resetting every domain is the SM clock's reset.
        ("POST", "/gpu/reset_locked_clocks", api.reset_gpu_locked_clocks),
    ]
    for method, path, handler in routes:
        app.router.add_route(method, path, api.guarded(handler))
