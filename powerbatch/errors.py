"""Every exception powerbatch raises, in one tree.

Classes defined elsewhere name their module in brackets; all derive from a class here.

    PowerbatchError
    ├── ConfigError                 bad settings; raised at start-up, never at run time
    │   ├── MissingExtra            an optional dependency (e.g. the `cli` extra) is missing
    │   ├── UnsupportedVllmVersion  [powerbatch_vllm.compat] vLLM outside the tested range
    │   └── SourceMissing           [powerbatch_vllm.surface] no vLLM scheduler source to check
    ├── TelemetryError              a power reading could not be had
    │   ├── SensorUnavailable       no device / endpoint / library (e.g. no NVML driver)
    │   └── SensorReadError         the source answered, but not with a usable sample
    ├── PowerLimitError             the hardware power limit could not be read, set or restored
    │   ├── LimiterUnavailable      no backend: daemon unreachable, no NVML, no such GPU
    │   ├── LimiterPermissionDenied the backend refused: bad or missing token, no CAP_SYS_ADMIN
    │   └── LimiterTimeout          the backend did not answer in time
    ├── ClockError                  the SM clock lock could not be read, set or reset
    ├── ReplayError                 a recorded trace is malformed
    │   └── TraceExhausted          [telemetry.replay] every row served: over, not broken
    ├── RequestError                a request answered with an HTTP error instead of service
    │   ├── BadRequest              [proxy.parse] a body the proxy cannot serve (400; ValueError)
    │   ├── Rejected                [admission] the queue will not serve it (429/503/504)
    │   └── ApiError                [sim.server] the simulator's OpenAI-shaped error answer
    ├── UpstreamUnreachable         [proxy.hop] no connection to the upstream could be made
    ├── UpstreamBroken              [proxy.hop] the upstream broke off or spoke bad HTTP
    │   └── UpstreamTimeout         [proxy.hop] the upstream was silent past a timeout
    ├── QueueFull                   [sim.engine] the simulator's waiting queue is full
    ├── RequestTooLarge             [sim.engine] a request could never fit the KV cache
    ├── EngineStopped               [sim.engine] the engine stopped before a request finished
    ├── ZeusdRequestError           [telemetry.zeusd] a zeusd call failed (mapped by its callers)
    └── ChildFailed                 [cli.process] a child process exited or never became ready
                                    (also a RuntimeError)

The controller treats any TelemetryError as "no trustworthy reading" and fails closed.
"""

from __future__ import annotations


class PowerbatchError(Exception):
    """Base of everything powerbatch raises on purpose."""


class ConfigError(PowerbatchError):
    """Settings that cannot work together, or a value out of range."""


class MissingExtra(ConfigError):
    """An optional dependency the command needs is not installed; the message says which extra."""


class TelemetryError(PowerbatchError):
    """A power reading could not be had."""


class SensorUnavailable(TelemetryError):
    """The source itself is missing: no driver, no GPU at that index, endpoint refused."""


class SensorReadError(TelemetryError):
    """The source answered but gave nothing usable (parse error, missing metric, NaN)."""


class PowerLimitError(PowerbatchError):
    """The hardware power limit could not be read, set or restored."""


class LimiterUnavailable(PowerLimitError):
    """No way to reach the limit: the daemon is down, NVML is missing, a GPU is not there."""


class LimiterPermissionDenied(PowerLimitError):
    """The backend refused: fixed by configuration (a token, a capability), not by retries."""


class LimiterTimeout(PowerLimitError):
    """The backend did not answer in time; whether the change happened is unknown."""


class ClockError(PowerbatchError):
    """The GPUs' SM clock lock could not be read, set or reset (the clock actuator falls back
    to unlocked clocks and reports it)."""


class ReplayError(PowerbatchError):
    """A recorded trace could not be read."""


class RequestError(PowerbatchError):
    """A request that gets an HTTP error answer (its status and message) instead of service."""
