"""A small async client for the Zeus project's node daemon, zeusd, and a power source over it.

zeusd (github.com/ml-energy/zeus, folder zeusd/; API reference docs/zeusd/api.md) is a privileged
daemon, one per node, that puts NVML's privileged calls behind HTTP over TCP or a unix socket, so
an unprivileged process (a pod without CAP_SYS_ADMIN) can read power and set a GPU's power limit.
Parameters are query parameters; answers are JSON keyed by GPU index as a string; an optional
bearer token (a JWT scoped to API groups such as `gpu-read`, `gpu-control`) goes in
`Authorization`.

Why our own client rather than Zeus's `zeus.utils.zeusd.ZeusdClient`: Zeus's client is
synchronous (httpx), and both the proxy and the vLLM plugin's control thread run asyncio loops,
where a blocking call would stall the loop for as long as the daemon takes; running it in a thread
per call costs a hop and a thread. It would also add zeus, httpx and their dependencies to every
vLLM environment for the handful of endpoints used here. aiohttp is already a dependency; the
endpoints, parameters and JSON shapes below follow Zeus's client and daemon.

The client raises `ZeusdRequestError` with a `kind`; the limiter and the power source map it to
their own error classes (`PowerLimitError` and `TelemetryError` subclasses), so it never escapes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

from powerbatch.errors import (
    ConfigError,
    PowerbatchError,
    SensorReadError,
    SensorUnavailable,
    TelemetryError,
)
from powerbatch.telemetry.base import PowerSample
from powerbatch.telemetry.gpu_ids import GpuId, zeusd_indices

__all__ = [
    "PciLookup",
    "ZeusdClient",
    "ZeusdGpu",
    "ZeusdPowerSource",
    "ZeusdRequestError",
    "resolve_gpu_ids",
]

ErrorKind = Literal["unreachable", "unauthorized", "forbidden", "bad_request", "timeout", "failed"]


class ZeusdRequestError(PowerbatchError):
    """A zeusd call failed; `kind` says how (what the caller maps to its own error class)."""

    def __init__(self, kind: ErrorKind, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


@dataclass(frozen=True, slots=True)
class ZeusdGpu:
    """One GPU as `/discover` lists it."""

    id: int
    name: str
    cumulative_energy_available: bool
    pci_address: str = ""  # domain:bus:device.function, as lspci -D writes it


def _kind(status: int) -> ErrorKind:
    # zeusd: 400 bad input or out of range, 401 no or bad token, 403 token lacks the scope or
    # NVML NoPermission, 404 API group disabled, 500 daemon or driver failure.
    if status == 401:
        return "unauthorized"
    if status == 403:
        return "forbidden"
    if status in (400, 422):
        return "bad_request"
    if status == 404:
        return "unreachable"
    return "failed"


def _ids(gpu_ids: Sequence[GpuId]) -> str:
    return ",".join(str(i) for i in gpu_ids)


class ZeusdClient:
    """zeusd over `http://host:port` or `unix:///path/to/zeusd.sock`; every call bounded in time.

    The HTTP session is made on first use, inside the running loop, and closed by `close()`.
    """

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 2.0) -> None:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"zeusd url {url!r}: unix:// needs a socket path")
            self._socket: str | None = parts.path
            self._base = "http://localhost"  # the host is ignored over a unix socket
        elif parts.scheme in ("http", "https") and parts.netloc:
            self._socket = None
            self._base = f"{parts.scheme}://{parts.netloc}"
        else:
            raise ValueError(f"zeusd url must be http://host:port or unix:///path, got {url!r}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.url = url
        self.endpoint = self._socket or parts.netloc
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = (
                aiohttp.UnixConnector(path=self._socket) if self._socket is not None else None
            )
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, timeout=self._timeout
            )
        return self._session

    async def request(self, method: str, path: str, params: dict[str, str] | None = None) -> Any:
        """One call; the decoded JSON answer (None for an empty 200) or ZeusdRequestError."""
        where = f"zeusd at {self.endpoint}: {method} {path}"
        try:
            async with self._get_session().request(
                method, self._base + path, params=params or {}
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    text = body.decode(errors="replace").strip()[:300]
                    raise ZeusdRequestError(
                        _kind(resp.status), f"{where}: HTTP {resp.status}: {text}", resp.status
                    )
        except TimeoutError as exc:
            raise ZeusdRequestError(
                "timeout", f"{where}: no answer within {self.timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise ZeusdRequestError("unreachable", f"{where}: {exc}") from exc
        if not body.strip():
            return None
        try:
            return json.loads(body)
        except ValueError as exc:
            raise ZeusdRequestError("failed", f"{where}: answer is not JSON: {exc}") from exc

    @staticmethod
    def _per_gpu(data: Any, gpu_ids: Sequence[int], key: str, what: str) -> dict[int, float]:
        try:
            return {i: float(data[str(i)][key]) for i in gpu_ids}
        except (KeyError, TypeError, ValueError) as exc:
            raise ZeusdRequestError("failed", f"zeusd {what}: no {key} for {exc}") from exc

    async def discover(self) -> tuple[list[ZeusdGpu], set[str], bool]:
        """(GPUs, enabled API groups, whether auth is required); never needs a token."""
        data = await self.request("GET", "/discover")
        try:
            gpus = [
                ZeusdGpu(
                    int(g["id"]),
                    str(g.get("name", "")),
                    bool(g["cumulative_energy_available"]),
                    str(g.get("pci_address", "")),
                )
                for g in data["gpus"]
            ]
            return gpus, set(data.get("enabled_api_groups", [])), bool(data["auth_required"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ZeusdRequestError("failed", f"zeusd /discover: malformed answer: {exc}") from exc

    async def get_power_limit_mw(self, gpu_ids: Sequence[int]) -> dict[int, float]:
        data = await self.request("GET", "/gpu/get_power_limit", {"gpu_ids": _ids(gpu_ids)})
        return self._per_gpu(data, gpu_ids, "power_limit_mw", "get_power_limit")

    async def get_power_limit_constraints_mw(
        self, gpu_ids: Sequence[int]
    ) -> dict[int, tuple[float, float]]:
        data = await self.request(
            "GET", "/gpu/get_power_limit_constraints", {"gpu_ids": _ids(gpu_ids)}
        )
        lo = self._per_gpu(data, gpu_ids, "min_power_limit_mw", "get_power_limit_constraints")
        hi = self._per_gpu(data, gpu_ids, "max_power_limit_mw", "get_power_limit_constraints")
        return {i: (lo[i], hi[i]) for i in gpu_ids}

    async def _write(self, path: str, gpu_ids: Sequence[int], block: bool, **fields: int) -> None:
        """A /gpu write: the GPUs, each field as an integer, and `block`."""
        params = {"gpu_ids": _ids(gpu_ids), **{k: str(int(v)) for k, v in fields.items()}}
        await self.request("POST", path, {**params, "block": "true" if block else "false"})

    async def set_power_limit_mw(
        self, gpu_ids: Sequence[int], power_limit_mw: int, *, block: bool = True
    ) -> None:
        """`block=True` waits until the daemon has applied it and reports per-GPU errors."""
        await self._write("/gpu/set_power_limit", gpu_ids, block, power_limit_mw=power_limit_mw)

    async def set_gpu_locked_clocks(
        self, gpu_ids: Sequence[int], min_clock_mhz: int, max_clock_mhz: int, *, block: bool = True
    ) -> None:
        """Lock the SM clock (zeusd/src/routes/gpu.rs: every field required)."""
        lock = {"min_clock_mhz": min_clock_mhz, "max_clock_mhz": max_clock_mhz}
        await self._write("/gpu/set_gpu_locked_clocks", gpu_ids, block, **lock)

    async def reset_gpu_locked_clocks(self, gpu_ids: Sequence[int], *, block: bool = True) -> None:
        """Back to the driver's default clock policy."""
        await self._write("/gpu/reset_gpu_locked_clocks", gpu_ids, block)

    async def get_power_mw(self, gpu_ids: Sequence[int]) -> dict[int, float]:
        data = await self.request("GET", "/gpu/get_power", {"gpu_ids": _ids(gpu_ids)})
        try:
            return {i: float(data["power_mw"][str(i)]) for i in gpu_ids}
        except (KeyError, TypeError, ValueError) as exc:
            raise ZeusdRequestError("failed", f"zeusd get_power: no reading for {exc}") from exc

    async def get_cumulative_energy_mj(self, gpu_ids: Sequence[int]) -> dict[int, float]:
        data = await self.request("GET", "/gpu/get_cumulative_energy", {"gpu_ids": _ids(gpu_ids)})
        return self._per_gpu(data, gpu_ids, "energy_mj", "get_cumulative_energy")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


PciLookup = Callable[[Sequence[str]], Awaitable[Mapping[str, str]]]
"""GPU UUIDs to PCI bus IDs, for the ones it can find (powerbatch.telemetry.factory's)."""


async def resolve_gpu_ids(
    gpu_ids: Sequence[GpuId], gpus: Sequence[ZeusdGpu], pci_lookup: PciLookup | None
) -> list[int]:
    """zeusd's index for each GPU (`gpu_ids` as given: indices, or UUIDs matched through their
    PCI address to /discover's `gpus`); ConfigError, naming the fixes, for one not found."""
    uuids = [g for g in gpu_ids if isinstance(g, str)]
    pci_of_uuid = dict(await pci_lookup(uuids)) if uuids and pci_lookup is not None else {}
    return zeusd_indices(gpu_ids, {g.id: g.pci_address for g in gpus}, pci_of_uuid)


def _telemetry_error(exc: ZeusdRequestError) -> TelemetryError:
    if exc.kind in ("unreachable", "unauthorized", "forbidden", "timeout"):
        return SensorUnavailable(str(exc))
    return SensorReadError(str(exc))


class ZeusdPowerSource:
    """Total power (and energy, where every GPU has a trustworthy counter) read through zeusd.

    `GET /gpu/get_power` is NVML's instant power per GPU. The energy counter is read only when
    `/discover` says every selected GPU has one: a sum that leaves one GPU out would be wrong.
    """

    def __init__(
        self,
        url: str,
        gpu_ids: Sequence[GpuId] = (0,),
        *,
        token: str | None = None,
        timeout_s: float = 1.0,
        client: ZeusdClient | None = None,
        pci_lookup: PciLookup | None = None,
    ) -> None:
        if not gpu_ids:
            raise ValueError("gpu_ids must name at least one GPU")
        self._client = client or ZeusdClient(url, token=token, timeout_s=timeout_s)
        self.gpu_ids = tuple(gpu_ids)
        self.name = f"zeusd:{self._client.endpoint}:{_ids(self.gpu_ids)}"
        self._pci_lookup = pci_lookup
        self._ids: list[int] = []  # zeusd's indices, once /discover is asked
        self._energy: bool | None = None  # None: /discover not asked yet

    async def _energy_available(self) -> bool:
        if self._energy is None:
            gpus, _, _ = await self._client.discover()
            try:
                ids = await resolve_gpu_ids(self.gpu_ids, gpus, self._pci_lookup)
            except (ConfigError, TelemetryError) as exc:
                raise SensorUnavailable(str(exc)) from exc
            known = {g.id: g for g in gpus}
            missing = [i for i in ids if i not in known]
            if missing:
                raise SensorUnavailable(f"zeusd at {self._client.endpoint} has no GPU {missing}")
            self._ids = ids
            self._energy = all(known[i].cumulative_energy_available for i in ids)
        return self._energy

    async def read(self) -> PowerSample:
        try:
            energy = await self._energy_available()
            power_mw = await self._client.get_power_mw(self._ids)
            t_s = time.monotonic()
            energy_mj = await self._client.get_cumulative_energy_mj(self._ids) if energy else None
        except ZeusdRequestError as exc:
            raise _telemetry_error(exc) from exc
        total_w = sum(power_mw.values()) / 1000.0
        if not math.isfinite(total_w) or total_w < 0:
            raise SensorReadError(f"zeusd power reading is not usable: {total_w} W")
        return PowerSample(
            t_s=t_s,
            power_w=total_w,
            energy_j=None if energy_mj is None else sum(energy_mj.values()) / 1000.0,
        )

    async def close(self) -> None:
        await self._client.close()
