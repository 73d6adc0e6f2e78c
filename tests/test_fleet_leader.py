"""Leader election across processes: two members, the allocator killed, the other takes over."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import redis
from helpers import wait_until
from redis_server import RedisServer, redis_server  # noqa: F401 - the fixture

TTL_S = 1.5

MEMBER = """
import asyncio, sys
from powerbatch.fleet import FleetSettings
from powerbatch.fleet.member import FleetMember
s = FleetSettings(fleet_budget="le", fleet_budget_w=500.0, fleet_redis_url=sys.argv[1],
                  fleet_members=2, fleet_lease_ttl_s=TTL, fleet_publish_interval_s=0.5)
async def main():
    m = FleetMember(s, sys.argv[2])
    await m.start()
    await asyncio.sleep(60)
asyncio.run(main())
""".replace("TTL", repr(TTL_S))


def test_leader_killed_the_other_process_takes_over_within_a_ttl(
    redis_server: RedisServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    procs = {
        mid: subprocess.Popen(
            [sys.executable, "-c", MEMBER, redis_server.url, mid],
            stdout=(tmp_path / f"{mid}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for mid in ("p1", "p2")
    }
    try:
        key = "powerbatch:fleet:le:leader"
        leader = wait_until(lambda: r.get(key), 30, "a leader elected")
        members = "powerbatch:fleet:le:members"
        wait_until(lambda: r.scard(members) == 2, 30, "both members joined")
        procs[leader].kill()  # SIGKILL: no resignation
        procs[leader].wait(10)
        t0 = time.monotonic()
        other = "p2" if leader == "p1" else "p1"
        wait_until(lambda: r.get(key) == other, TTL_S + 1.5, f"{other} leading after the kill")
        assert time.monotonic() - t0 <= TTL_S + 1.5
        # And the new leader allocates: the dead member's watts come back to the survivor.
        wait_until(
            lambda: float(r.hget(f"powerbatch:fleet:le:m:{other}", "grant") or 0) > 400,
            4 * TTL_S,
            "the survivor granted the dead member's watts",
        )
    finally:
        for p in procs.values():
            p.kill()
            p.wait(10)
        r.close()
