"""The budget's book in Redis: the Lua scripts that change it atomically, and a member's calls
(`RedisBook`: each one script or command, no state of its own). Keys under `powerbatch:fleet:
<budget>`: `:state` (budget_w, created_ms, fresh_until_ms, reallocations), `:members` (a set),
`:m:<id>` (grant, held, expires_ms, lost, lost_since_ms, safe_w and its bid), `:leader` (PX);
and a channel `:wake:<id>` per member, on which the scripts name the member a move waits on.

`grant` is what the member may use once it has read it; `held` is an upper bound on what it may
be using now (the old grant until it confirms a lower one). Invariant, kept by every script:
the sum of `held` over live members plus `safe_w` over lost ones is at most `budget_w`; a raise
is paid only from what is left. Times are Redis's own (TIME), so members' clocks never meet.
The scripts name member keys from the prefix, so a Redis Cluster is out of scope (one shard).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import redis.asyncio as aioredis

from powerbatch.fleet.settings import FleetSettings

# Shared by the scripts: the clock, the sweep of expired leases and the committed watts.
_COMMON = """
local p = KEYS[1]
local st = p .. ':state'
local set = p .. ':members'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function num(x) return tonumber(x or '0') or 0 end

local function init(budget, ttl)
  if redis.call('EXISTS', st) == 0 then
    -- No state: Redis is new or lost its data. For 2 TTL nobody is raised above the safe
    -- share: members still on leases it never saw have fallen back by then.
    redis.call('HSET', st, 'budget_w', budget, 'created_ms', now,
               'fresh_until_ms', now + 2 * ttl, 'reallocations', 0)
  end
  return num(redis.call('HGET', st, 'budget_w')), num(redis.call('HGET', st, 'fresh_until_ms'))
end

-- Expired leases become lost (their grant is reclaimed, their safe share reserved for one
-- more TTL, as the member may be alive and on it); lost ones a TTL old are forgotten.
-- Returns the committed watts and the live member count.
local function sweep(ttl, skip)
  local committed, live = 0, 0
  for _, id in ipairs(redis.call('SMEMBERS', set)) do
    local key = p .. ':m:' .. id
    local h = redis.call('HMGET', key, 'held', 'expires_ms', 'lost', 'safe_w')
    if h[2] == false then
      redis.call('SREM', set, id)
    else
      local exp = num(h[2])
      local lost = h[3] == '1'
      if not lost and exp < now then
        redis.call('HSET', key, 'lost', 1, 'grant', 0, 'held', 0, 'lost_since_ms', exp)
        lost = true
      end
      if lost and exp + ttl < now then
        redis.call('DEL', key)
        redis.call('SREM', set, id)
      elseif id ~= skip then
        if lost then committed = committed + num(h[4])
        else committed = committed + num(h[1]); live = live + 1 end
      end
    end
  end
  return committed, live
end
"""

# KEYS[1] prefix. ARGV: id, ttl_ms, using_w, safe_w, budget_w, then field, value pairs.
# A renewal confirms: `held` drops to max(grant, using), `using` being what the member runs on
# while this reply travels; a grant below the leader's `target` is raised toward it from the
# pool. A member with no live lease joins with at most its safe share, paid from the pool.
# It publishes on `:wake:<id>` (member id) when a move waits on another member: `needy` to the
# leader when this member turns needy, `paid` to each member with a pending raise when this one
# frees watts (`RedisBook.wakes`).
# Returns grant, expires_ms, now_ms, fresh_until_ms, leader, live count.
RENEW = (
    _COMMON
    + """
local id, ttl = ARGV[1], tonumber(ARGV[2])
local using, safe = tonumber(ARGV[3]), tonumber(ARGV[4])
local budget, fresh_until = init(tonumber(ARGV[5]), ttl)
local key = p .. ':m:' .. id
local committed, live = sweep(ttl, id)
local h = redis.call('HMGET', key, 'grant', 'held', 'expires_ms', 'lost', 'target', 'needy')
local was_held, was_needy = num(h[2]), h[6] == '1'
local grant, target
if h[3] == false or h[4] == '1' or num(h[3]) < now then
  grant = math.min(safe, math.max(budget - committed, 0))
  target = grant
else
  grant = num(h[1])
  target = num(h[5])
  -- A raise the leader could not pay when it allocated is paid now from the pool, so watts a
  -- giver has just confirmed reach the taker at its next renewal, not the leader's next turn.
  if target > grant + 1e-6 and now >= fresh_until then
    grant = math.max(grant, math.min(target, budget - committed))
  end
end
local held = math.max(grant, using)
redis.call('HSET', key, 'grant', grant, 'held', held, 'expires_ms', now + ttl, 'lost', 0,
           'seen_ms', now, 'safe_w', safe, 'target', target)
for i = 6, #ARGV, 2 do redis.call('HSET', key, ARGV[i], ARGV[i + 1]) end
redis.call('SADD', set, id)
local leader = redis.call('GET', p .. ':leader') or ''
-- Wake-ups (the periods stay; these only make a move take round trips, not periods): a
-- member that turns needy wakes the leader, and one that frees watts wakes each member whose
-- raise waits on the pool, to be paid at its renewal now.
if leader ~= '' and leader ~= id and not was_needy and redis.call('HGET', key, 'needy') == '1' then
  redis.call('PUBLISH', p .. ':wake:' .. leader, 'needy')
end
if held < was_held - 1e-6 then
  for _, other in ipairs(redis.call('SMEMBERS', set)) do
    if other ~= id then
      local o = redis.call('HMGET', p .. ':m:' .. other, 'grant', 'target', 'lost')
      if o[3] ~= '1' and num(o[2]) > num(o[1]) + 1e-6 then
        redis.call('PUBLISH', p .. ':wake:' .. other, 'paid')
      end
    end
  end
end
return {tostring(grant), tostring(now + ttl), tostring(now), tostring(fresh_until), leader,
        tostring(live + 1), tostring(committed + held)}
"""
)

# KEYS[1] prefix. ARGV: leader id, ttl_ms, budget_w, then id, target_w pairs.
# Fenced: only the holder of the leader lease may write. Lowers take effect at once (grant =
# target; held stays until the member confirms); raises share what the pool holds, each in
# proportion to what it lacks, and the rest of each is left as `target` for its renewal.
# It publishes `cut` or `raise` on `:wake:<id>` for each grant it moves.
# Returns pool_w left, reallocations, changed (0/1); {-1} if not the leader.
ALLOCATE = (
    _COMMON
    + """
if redis.call('GET', p .. ':leader') ~= ARGV[1] then return {'-1'} end
local ttl = tonumber(ARGV[2])
local budget, fresh_until = init(tonumber(ARGV[3]), ttl)
local fresh = now < fresh_until
local changed = 0
local raises = {}
sweep(ttl, '')
for i = 4, #ARGV, 2 do
  local id, target = ARGV[i], tonumber(ARGV[i + 1])
  local key = p .. ':m:' .. id
  local h = redis.call('HMGET', key, 'grant', 'held', 'lost', 'safe_w')
  if h[1] ~= false and h[3] ~= '1' then
    local grant, held, safe = num(h[1]), num(h[2]), num(h[4])
    if fresh then target = math.min(target, math.max(grant, safe)) end
    redis.call('HSET', key, 'target', target)
    if target < grant - 1e-6 then
      redis.call('HSET', key, 'grant', target)
      redis.call('PUBLISH', p .. ':wake:' .. id, 'cut')
      changed = 1
    elseif target > grant + 1e-6 then
      table.insert(raises, {key, grant, held, target, id})
    end
  end
end
local committed = sweep(ttl, '')
local pool = math.max(budget - committed, 0)
local need = 0
for _, r in ipairs(raises) do need = need + math.max(r[4] - r[3], 0) end
local frac = 1
if need > pool then frac = pool / need end
for _, r in ipairs(raises) do
  local key, grant, held, target, id = r[1], r[2], r[3], r[4], r[5]
  local new = math.min(target, held + frac * math.max(target - held, 0))
  if new > grant + 1e-6 then
    pool = pool - math.max(new - held, 0)
    redis.call('HSET', key, 'grant', new, 'held', math.max(held, new))
    redis.call('PUBLISH', p .. ':wake:' .. id, 'raise')
    changed = 1
  end
end
if changed == 1 then redis.call('HINCRBY', st, 'reallocations', 1) end
return {tostring(pool), redis.call('HGET', st, 'reallocations'), tostring(changed)}
"""
)

# KEYS[1] the leader key. ARGV: id, ttl_ms. Compare-and-renew: extends the lease only for its
# holder (a leader that lost it must not take it back from the new one).
RENEW_LEADER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] the leader key. ARGV: id. Resigns only its own lease.
RESIGN_LEADER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def prefix(budget: str) -> str:
    return f"powerbatch:fleet:{budget}"


class RedisBook:
    """The keys under `prefix(budget)`, as member `member_id` reads and writes them."""

    def __init__(
        self, settings: FleetSettings, member_id: str, client: aioredis.Redis | None = None
    ) -> None:
        assert settings.fleet_budget is not None, "a member needs fleet_budget"
        self.settings = settings
        self.id = member_id
        self.prefix = prefix(settings.fleet_budget)
        self.leader_key = self.prefix + ":leader"
        self.ttl_ms = int(settings.fleet_lease_ttl_s * 1000)
        self._client = client

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            s = self.settings
            t = min(s.fleet_publish_interval_s, s.fleet_lease_ttl_s / 6)
            self._client = aioredis.Redis.from_url(
                s.fleet_redis_url, socket_timeout=t, socket_connect_timeout=t, decode_responses=True
            )
        return self._client

    async def renew(
        self, using_w: float, safe_w: float, bid: Mapping[str, Any]
    ) -> tuple[float, str, int]:
        """Renew the lease on `using_w` and publish `bid`: (grant, leader, live members)."""
        args: list[Any] = [self.id, self.ttl_ms, using_w, safe_w, self.settings.fleet_budget_w]
        for k, v in bid.items():
            args += [k, v]
        reply = await self.client.eval(RENEW, 1, self.prefix, *args)
        return float(reply[0]), reply[4], int(reply[5])

    async def renew_leader(self) -> bool:
        return bool(await self.client.eval(RENEW_LEADER, 1, self.leader_key, self.id, self.ttl_ms))

    async def claim_leader(self) -> bool:
        return bool(await self.client.set(self.leader_key, self.id, nx=True, px=self.ttl_ms))

    async def resign_leader(self) -> None:
        await self.client.eval(RESIGN_LEADER, 1, self.leader_key, self.id)

    async def members(self) -> dict[str, dict[str, str]]:
        """Every member's hash, by id (empty where it has gone)."""
        c = self.client
        ids = sorted(str(i) for i in await c.smembers(self.prefix + ":members"))
        async with c.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(f"{self.prefix}:m:{i}")
            rows = await pipe.execute()
        return dict(zip(ids, rows, strict=True))

    async def allocate(self, targets: Mapping[str, float]) -> bool | None:
        """Write the targets, fenced: None where this member is not the leader, else whether
        any grant moved."""
        args: list[Any] = [self.id, self.ttl_ms, self.settings.fleet_budget_w]
        for i, w in targets.items():
            args += [i, round(w, 3)]
        reply = await self.client.eval(ALLOCATE, 1, self.prefix, *args)
        return None if reply[0] == "-1" else reply[2] == "1"

    async def wakes(self) -> AsyncIterator[str]:
        """What the scripts publish for this member, as it comes: why it should renew now
        (`cut`, `raise`, `paid`, `needy`). A subscribed connection runs no scripts, so this
        one is its own."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(f"{self.prefix}:wake:{self.id}")
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is not None:
                    yield str(msg["data"])
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.settings.fleet_publish_interval_s):
                    await pubsub.aclose()

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
