"""One scenario-bench run, scenario by scenario: what was drawn, the cap's goodput (req/s), and
powerbatch's tokens/s, J/token, goodput and interactive streaming p95 TTFT over the cap's.

    cd results/scenarios/stop63-seed2 && python per_scenario.py results.json
"""

import json
import sys
from pathlib import Path


def fmt(v: float | None) -> str:
    return "  —  " if v is None else f"{v:5.2f}"


def main() -> None:
    for s in json.loads(Path(sys.argv[1]).read_text())["scenarios"]:
        plant, load = s["plant"]["draw"], s["load"]["draw"]
        f = s["figures"]["powerbatch"]
        what = (
            f"{plant['num_gpus']} GPU {plant['curve']:15s} {plant['meter']:8s} "
            f"{load['arrival']:8s} {load['lengths']:12s}"
        )
        cap = s["runs"]["hwcap"]["goodput_rps"]
        print(
            f"{s['index']:2d} {what} cap goodput {cap:5.2f}  tok/s {fmt(f['tok_s'])}  "
            f"J/tok {fmt(f['j_per_token'])}  goodput {fmt(f['goodput'])}  "
            f"ttft {fmt(f['ttft_p95'])}"
        )


if __name__ == "__main__":
    main()
