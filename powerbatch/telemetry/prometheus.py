"""Power from a dcgm-exporter endpoint, and load signals from vLLM's /metrics.

Both are Prometheus text endpoints scraped on demand; how often is the monitor's business.
dcgm-exporter's own collection interval (30 s by default) bounds how fresh its power can be, so
deploy it with a short interval (e.g. -c 100) or read NVML directly.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from powerbatch.errors import SensorReadError, SensorUnavailable
from powerbatch.telemetry.base import PowerSample

LabelFilter = Mapping[str, str | Sequence[str]]


def _normalise(labels: LabelFilter | None) -> dict[str, frozenset[str]]:
    # A str is itself a Sequence[str]: treat it as one value, not as its characters.
    return {
        key: frozenset([value]) if isinstance(value, str) else frozenset(value)
        for key, value in (labels or {}).items()
    }


class _Scrape:
    """One fetched and parsed exposition, indexed by sample name."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.samples: dict[str, list[Sample]] = {}
        for family in families:
            for sample in family.samples:
                self.samples.setdefault(sample.name, []).append(sample)
                # prometheus_client renames counter samples to `<name>_total`; dcgm-exporter types
                # its energy counter without the suffix, so index the family's own name as well.
                if family.type == "counter" and sample.name == family.name + "_total":
                    self.samples.setdefault(family.name, []).append(sample)

    def matching(self, metric: str, labels: Mapping[str, frozenset[str]]) -> list[Sample] | None:
        """Samples of `metric` passing the filter; None when the metric is absent altogether."""
        if metric not in self.samples:
            return None
        return [
            s
            for s in self.samples[metric]
            if all(s.labels.get(key) in values for key, values in labels.items())
        ]


async def _fetch(session: aiohttp.ClientSession, url: str, timeout_s: float) -> _Scrape:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                raise SensorReadError(f"{url} answered HTTP {response.status}")
            text = await response.text()
    except TimeoutError as exc:
        raise SensorUnavailable(f"{url} did not answer within {timeout_s} s") from exc
    except aiohttp.ClientConnectionError as exc:
        raise SensorUnavailable(f"cannot reach {url}: {exc}") from exc
    except aiohttp.ClientError as exc:
        raise SensorReadError(f"bad response from {url}: {exc}") from exc
    try:
        # The parser is lazy: errors surface while iterating, so iterate inside the try.
        return _Scrape(list(text_string_to_metric_families(text)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise SensorReadError(f"{url} is not Prometheus text: {exc}") from exc


class _Endpoint:
    """An HTTP endpoint with a session that is closed only if this object created it."""

    def __init__(self, url: str, timeout_s: float, session: aiohttp.ClientSession | None) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
        self.url = url
        self.timeout_s = timeout_s
        self._session = session
        self._owns_session = session is None

    async def fetch(self) -> _Scrape:
        if self._session is None:
            # Created lazily: aiohttp sessions belong to a running event loop.
            self._session = aiohttp.ClientSession()
        return await _fetch(self._session, self.url, self.timeout_s)

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None


class PrometheusPowerSource:
    """Total power (W) over the GPUs a label filter selects, from dcgm-exporter text.

    `labels` maps a label to one value or a list of accepted values, e.g. {"gpu": ["0", "1"]}.
    Every listed value must be present in the scrape: a GPU that drops out of the exporter would
    otherwise lower the sum and make the controller admit more load than the ceiling allows.
    """

    def __init__(
        self,
        url: str,
        *,
        metric: str = "DCGM_FI_DEV_POWER_USAGE",
        labels: LabelFilter | None = None,
        energy_metric: str | None = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        timeout_s: float = 1.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._endpoint = _Endpoint(url, timeout_s, session)
        self.metric = metric
        self.energy_metric = energy_metric
        self._labels = _normalise(labels)
        self.name = f"prometheus:{url}#{metric}"

    def _check_coverage(self, samples: list[Sample]) -> None:
        for key, wanted in self._labels.items():
            missing = wanted - {s.labels.get(key) for s in samples}
            if missing:
                raise SensorReadError(
                    f"{self.metric} has no sample with {key} in {sorted(missing)} "
                    f"at {self._endpoint.url}"
                )

    def _energy_j(self, scrape: _Scrape, power_count: int) -> float | None:
        if self.energy_metric is None:
            return None
        samples = scrape.matching(self.energy_metric, self._labels)
        # Energy over a different set of GPUs than the power would be a wrong number, not a
        # missing one; a bad counter makes energy unknown rather than failing the power read.
        if not samples or len(samples) != power_count:
            return None
        values = [s.value for s in samples]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            return None
        return sum(values) / 1000.0  # dcgm-exporter reports mJ

    async def read(self) -> PowerSample:
        scrape = await self._endpoint.fetch()
        t_s = time.monotonic()
        samples = scrape.matching(self.metric, self._labels)
        if samples is None:
            raise SensorReadError(f"{self.metric} is absent from {self._endpoint.url}")
        if not samples:
            raise SensorReadError(
                f"no {self.metric} sample matches {dict(self._labels)} at {self._endpoint.url}"
            )
        self._check_coverage(samples)
        bad = [s for s in samples if not math.isfinite(s.value)]
        if bad:
            raise SensorReadError(f"{self.metric} is not finite: {bad[0].labels} = {bad[0].value}")
        return PowerSample(
            t_s=t_s,
            power_w=float(sum(s.value for s in samples)),
            energy_j=self._energy_j(scrape, len(samples)),
        )

    async def close(self) -> None:
        await self._endpoint.close()


@dataclass(frozen=True, slots=True)
class UpstreamSignals:
    """What vLLM says about its own load; a field is None when the server does not export it."""

    requests_running: float | None
    requests_waiting: float | None
    kv_cache_usage: float | None  # fraction 0..1
    t_s: float | None = None  # time.monotonic() when scraped
    # Requests the engine has given a first token, ever: the count of vLLM's TTFT histogram
    # (observed once per request, at its first output: vllm/v1/metrics/stats.py).
    requests_started_total: float | None = None
    # vLLM's inter-token latency histogram's sum and count (each output after a request's
    # first, the time since its last: vllm/v1/metrics/stats.py): their rises between two
    # scrapes are the mean time a running request waited per token in between.
    itl_sum_s: float | None = None
    itl_count: float | None = None
    # vLLM's request decode time histogram's sum and count (first token to last, per finished
    # request): how long the steps are that one request's TPOT averages.
    decode_sum_s: float | None = None
    decode_count: float | None = None
    # Tokens the engine has generated, ever (`vllm:generation_tokens`, counted at each step:
    # vllm/v1/metrics/loggers.py), where the proxy sees most of an answer's only at its end.
    generation_tokens_total: float | None = None


class UpstreamMetricsScraper:
    """Scrape vLLM's /metrics for the load signals the controller and the estimator use.

    Request counts are summed over label sets (one per engine under data parallelism); KV cache
    usage is a fraction, so it is averaged over them instead, keeping it in 0..1.
    """

    RUNNING = "vllm:num_requests_running"
    WAITING = "vllm:num_requests_waiting"
    KV_CACHE = "vllm:kv_cache_usage_perc"
    STARTED = "vllm:time_to_first_token_seconds_count"
    ITL_SUM = "vllm:inter_token_latency_seconds_sum"
    ITL_COUNT = "vllm:inter_token_latency_seconds_count"
    DECODE_SUM = "vllm:request_decode_time_seconds_sum"
    DECODE_COUNT = "vllm:request_decode_time_seconds_count"
    GENERATED = "vllm:generation_tokens_total"

    def __init__(
        self,
        url: str,
        *,
        labels: LabelFilter | None = None,
        timeout_s: float = 1.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._endpoint = _Endpoint(url, timeout_s, session)
        self._labels = _normalise(labels)

    def _values(self, scrape: _Scrape, metric: str) -> list[float] | None:
        samples = scrape.matching(metric, self._labels)
        if not samples:
            return None
        values = [s.value for s in samples]
        if not all(math.isfinite(v) for v in values):
            raise SensorReadError(f"{metric} is not finite at {self._endpoint.url}: {values}")
        return values

    def _total(self, scrape: _Scrape, metric: str) -> float | None:
        """Summed over label sets (one per engine under data parallelism); None if absent."""
        values = self._values(scrape, metric)
        return None if values is None else sum(values)

    async def scrape(self) -> UpstreamSignals:
        scrape = await self._endpoint.fetch()
        t_s = time.monotonic()
        kv_cache = self._values(scrape, self.KV_CACHE)
        total = functools.partial(self._total, scrape)
        return UpstreamSignals(
            requests_running=total(self.RUNNING),
            requests_waiting=total(self.WAITING),
            kv_cache_usage=None if kv_cache is None else sum(kv_cache) / len(kv_cache),
            t_s=t_s,
            requests_started_total=total(self.STARTED),
            itl_sum_s=total(self.ITL_SUM),
            itl_count=total(self.ITL_COUNT),
            decode_sum_s=total(self.DECODE_SUM),
            decode_count=total(self.DECODE_COUNT),
            generation_tokens_total=total(self.GENERATED),
        )

    async def close(self) -> None:
        await self._endpoint.close()


async def dcgm_pci_bus_ids(
    url: str, uuids: Sequence[str], *, timeout_s: float = 2.0
) -> dict[str, str]:
    """The PCI bus ID of each GPU UUID, from any dcgm-exporter series at `url` that carries both
    labels (`UUID`, `pci_bus_id`); UUIDs it does not list are left out. TelemetryError if the
    endpoint cannot be read."""
    wanted = set(uuids)
    async with aiohttp.ClientSession() as session:
        scrape = await _fetch(session, url, timeout_s)
    found: dict[str, str] = {}
    for samples in scrape.samples.values():
        for sample in samples:
            uuid, bus_id = sample.labels.get("UUID"), sample.labels.get("pci_bus_id")
            if uuid in wanted and bus_id:
                found[uuid] = bus_id
    return found


class DcgmClockReader:
    """The GPUs' SM clock, MHz, from dcgm-exporter's DCGM_FI_DEV_SM_CLOCK (the mean over the
    selected GPUs): what the clock actuator reports where zeusd, which has no clock read, sets
    the clock."""

    METRIC = "DCGM_FI_DEV_SM_CLOCK"

    def __init__(self, url: str, *, labels: LabelFilter | None = None, timeout_s: float = 1.0):
        self._endpoint = _Endpoint(url, timeout_s, None)
        self._labels = _normalise(labels)

    async def read_mhz(self) -> float | None:
        """The clock now, None where the exporter does not export it; TelemetryError if the
        endpoint cannot be read."""
        samples = (await self._endpoint.fetch()).matching(self.METRIC, self._labels)
        values = [s.value for s in samples or [] if math.isfinite(s.value)]
        return sum(values) / len(values) if values else None

    async def close(self) -> None:
        await self._endpoint.close()
