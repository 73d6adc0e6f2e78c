"""LoadTestShape classes over the schedules in `pbload.schedule`.

`-u` sets the peak user count and `--run-time` the length of the run when given (the shapes opt
in with use_common_options); otherwise each profile's defaults apply. The shape returns None at
the end, so a headless run stops by itself.
"""

from __future__ import annotations

from typing import Any, ClassVar

from locust import LoadTestShape, events
from locust.env import Environment

from pbload.schedule import SCHEDULES, Defaults

_GIVEN: dict[str, Any] = {}


def _capture_options(environment: Environment, **_: Any) -> None:
    # Read before headless mode fills in -u 1 / -r 1, so "not given" stays visible.
    opts = environment.parsed_options
    if opts is not None:
        _GIVEN.update(users=opts.num_users, spawn_rate=opts.spawn_rate, run_time=opts.run_time)


events.init.add_listener(_capture_options)  # type: ignore[no-untyped-call]


class ProfileShape(LoadTestShape):
    abstract = True
    use_common_options = True
    schedule: ClassVar[str] = "steady"
    defaults: ClassVar[Defaults] = Defaults(users=16, duration_s=300)

    def tick(self) -> tuple[int, float] | None:
        users = int(_GIVEN.get("users") or self.defaults.users)
        duration = float(_GIVEN.get("run_time") or self.defaults.duration_s)
        rate = float(_GIVEN.get("spawn_rate") or max(1, users))
        elapsed: float = self.get_run_time()  # type: ignore[no-untyped-call]
        n = SCHEDULES[self.schedule](elapsed, users, duration)
        return None if n is None else (n, rate)


class SteadyShape(ProfileShape):
    schedule = "steady"
    defaults = Defaults(users=16, duration_s=300)


class BurstyShape(ProfileShape):
    schedule = "bursty"
    defaults = Defaults(users=24, duration_s=360)


class DiurnalShape(ProfileShape):
    schedule = "diurnal"
    defaults = Defaults(users=32, duration_s=600)


class LongContextShape(ProfileShape):
    schedule = "steady"
    defaults = Defaults(users=8, duration_s=300)


class MixedPriorityShape(ProfileShape):
    schedule = "steps"
    defaults = Defaults(users=32, duration_s=360)
