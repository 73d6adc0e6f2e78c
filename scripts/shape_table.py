"""Print the shape bench's markdown table (docs/power-shape.md) from results.json files.

Usage: python scripts/shape_table.py results/shape/bursty-scale/results.json
results/shape/bursty-shaped/results.json. Files of one load are merged by arm; the bench was
split into several invocations only so that each one stays short on a shared machine.
"""

import json
import sys
from pathlib import Path

from powerbatch.cli.shape_bench import markdown_table

if __name__ == "__main__":
    docs = [json.loads(Path(p).read_text()) for p in sys.argv[1:]]
    if not docs:
        sys.exit(__doc__)
    print(markdown_table(docs))
