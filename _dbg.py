import sys
import clock_plants as cp
from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.control.laws.clock import ClockLaw
seed=int(sys.argv[1]); lag=float(sys.argv[2])
profile, ceiling, kv = cp.draw(seed)
law = ClockLaw(ClockPolicy(clock_objective="energy"), ControlConfig(ceiling_w=ceiling))
orig = law.tick
n=[0]
def tick(inp, ok):
    c = orig(inp, ok)
    n[0]+=1
    if n[0]%10==0:
        print(f"{inp.t_s-1000:6.1f} top {inp.top_mhz:.0f} P {inp.power_w:.0f} b {inp.batch:.1f} d {inp.decode_tok_s:.0f} q {inp.queued} tpot {inp.tpot_p95_s:.4f} -> {c.lock} {c.reason} br {law._bracket} probed {sorted(law._probed)}")
    return c
law.tick = tick
r = cp.run(profile, ceiling, kv, seed, float(sys.argv[3]), law=law, meter_lag_s=lag)
print(r); print(law.levels); print(law.factors()); print(law.summary()["samples"])
print(profile.num_gpus, ceiling, profile.tdp_w)
