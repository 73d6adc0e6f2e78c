"""`powerbatch sim` as an operator starts it: it says where it listens once it does."""

from __future__ import annotations

import re
import select
import subprocess
import sys
import time
import urllib.request


def test_sim_logs_its_url_once_listening() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerbatch", "sim", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        url = None
        lines = []
        while url is None and time.monotonic() < deadline:
            ready, _, _ = select.select(
                [proc.stdout], [], [], max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break  # silent until the deadline
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
        assert url is not None, "".join(lines)
        with urllib.request.urlopen(url + "/health", timeout=5) as r:  # the line means it is up
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
