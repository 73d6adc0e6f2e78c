"""The locust profiles in load_tests/: their plain parts in-process, one profile end to end.

locust monkey-patches the process with gevent on import, so the smoke runs it as a subprocess
against the simulator and the proxy on loopback; only locust-free modules are imported here.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from powerbatch.cli.stack import Stack
from powerbatch.load import sharegpt

LOAD_TESTS = Path(__file__).resolve().parents[1] / "load_tests"
sys.path.insert(0, str(LOAD_TESTS))

from pbload import schedule  # noqa: E402
from pbload.server import StartupError, auth_headers, discover  # noqa: E402
from pbload.sse import StreamMeter  # noqa: E402
from pbload.workload import CHAT_PATH, Mix, Workload  # noqa: E402
from summarize import summarize  # noqa: E402

PROFILES = ("steady", "bursty", "diurnal", "long_context", "mixed_priority")


def test_every_profile_has_a_locustfile_and_a_readme_command() -> None:
    readme = (LOAD_TESTS / "README.md").read_text()
    for name in PROFILES:
        assert (LOAD_TESTS / f"{name}.py").is_file()
        assert f"load_tests/{name}.py" in readme


@pytest.mark.parametrize("name", sorted(schedule.SCHEDULES))
def test_schedules_stay_in_bounds_and_end(name: str) -> None:
    fn = schedule.SCHEDULES[name]
    counts = [fn(t / 10, 16, 60.0) for t in range(600)]
    assert all(c is not None and 1 <= c <= 16 for c in counts)
    assert max(c for c in counts if c is not None) == 16
    assert fn(60.0, 16, 60.0) is None


def test_bursty_alternates_and_diurnal_peaks_midway() -> None:
    assert {schedule.bursty(t, 16, 60.0) for t in range(60)} == {4, 16}
    day = [schedule.diurnal(t, 32, 100.0) or 0 for t in range(100)]
    assert day[50] == 32 == max(day) and day[0] == 4 and day[25] == day[75]


def test_stream_meter_reads_split_events_and_usage() -> None:
    m = StreamMeter()
    events = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" there"}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}\n\n',
        b"data: [DONE]\n\n",
    ]
    m.feed(events[0][:30], 1.0)  # the role event, split: no token yet
    m.feed(events[0][30:] + events[1][:20], 1.5)
    assert m.first_token_s is None
    m.feed(events[1][20:], 2.0)
    m.feed(b"".join(events[2:]), 3.0)
    assert m.first_token_s == 2.0
    assert m.done and m.error is None
    assert m.content_events == 2 and m.output_tokens == 7


def test_stream_meter_reports_an_error_event() -> None:
    m = StreamMeter()
    m.feed(b'data: {"error":{"message":"upstream failed","code":502}}\n\ndata: [DONE]\n\n', 1.0)
    assert m.error == "upstream failed"


def test_sharegpt_sample_is_deterministic_and_shaped() -> None:
    a, b = sharegpt.generate(50, seed=3), sharegpt.generate(50, seed=3)
    assert a == b and a != sharegpt.generate(50, seed=4)
    assert all(t["from"] in ("human", "gpt") for r in a for t in r["conversations"])
    s = sharegpt.samples(sharegpt.generate(300), max_prompt_tokens=2000, max_output_tokens=512)
    prompts = sorted(x.prompt_tokens for x in s)
    assert len(s) > 250 and prompts[-1] <= 2000
    assert prompts[len(prompts) // 2] < 400 < 1000 < prompts[-1]  # short median, long tail
    assert all(x.messages[-1]["role"] == "user" and 1 <= x.output_tokens <= 512 for x in s)


def test_workload_draws_valid_bodies_in_the_mix() -> None:
    mix = Mix(priority_mix={"high": 0.5, "low": 0.5}, chat_fraction=0.5, stream_fraction=0.5)
    w = Workload(mix, "m", max_model_len=2048)
    rng = random.Random(0)
    drawn = [w.next(rng) for _ in range(400)]
    prios = Counter(p.priority for p in drawn)
    assert set(prios) == {"high", "low"} and min(prios.values()) > 150
    assert 150 < sum(p.path == CHAT_PATH for p in drawn) < 250
    for p in drawn:
        body = json.loads(p.body)
        assert body["model"] == "m" and body["stream"] is p.stream
        assert p.prompt_tokens + p.max_tokens <= 2048 and body["max_tokens"] == p.max_tokens
        assert ("messages" in body) is (p.path == CHAT_PATH)
        assert ("stream_options" in body) is p.stream
    long = Workload(Mix(lengths="lognormal", prompt_median=3000, max_prompt_tokens=7000), "m")
    sizes = [long.next(rng).prompt_tokens for _ in range(200)]
    assert 2000 < sorted(sizes)[100] < 4500 and max(sizes) <= 7000


def test_priority_mix_from_the_environment() -> None:
    env = {"PB_PRIORITY_MIX": "high=1", "PB_STREAM_FRACTION": "0"}
    assert Mix().with_env(env).priority_mix == {"high": 1.0}
    assert Mix().with_env(env).stream_fraction == 0.0
    assert Mix(priority_mix={"low": 1.0}).with_env(env, priority=False).priority_mix == {"low": 1}


def test_steady_profile_smoke_against_the_simulator_through_the_proxy(tmp_path: Path) -> None:
    """4 users for 8 s: every request answered, TTFT/TPOT/E2E/TOK/S recorded and plausible."""

    async def main() -> tuple[int, bytes]:
        async with Stack(
            tmp_path / "logs",
            proxy_args=["--ceiling-w", "2000", "--no-upstream-metrics", "--warmup-s", "1"],
        ) as stack:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(LOAD_TESTS / "steady.py"),
                "--headless",
                "-u",
                "4",
                "-r",
                "4",
                "--run-time",
                "8s",
                "--host",
                stack.proxy_url,
                "--csv",
                str(tmp_path / "steady"),
                "--only-summary",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            try:
                async with asyncio.timeout(40):
                    out, _ = await proc.communicate()
            except TimeoutError:
                proc.kill()
                out, _ = await proc.communicate()
            assert proc.returncode is not None
            return proc.returncode, out

    rc, out = asyncio.run(main())
    assert rc == 0, out.decode(errors="replace")[-3000:]
    s = summarize(tmp_path / "steady")
    requests = s["requests"]
    assert sum(r["count"] for r in requests.values()) >= 4
    assert sum(r["failures"] for r in requests.values()) == 0
    assert not s["rejected"]
    m = s["metrics"]
    assert set(m) == {"TTFT", "TPOT", "E2E", "TOK/S"}, m.keys()
    ttft = list(m["TTFT"].values())
    tpot = list(m["TPOT"].values())
    assert all(0.1 < st["mean"] < 10_000 for st in ttft)  # ms: the sim's prefill, plus queueing
    assert all(0.5 < st["mean"] < 500 for st in tpot)  # ms per token: a few per decode step
    assert all(st["mean"] > 1 for st in m["TOK/S"].values())


@contextmanager
def _keyed_models_server(key: str) -> Iterator[str]:
    """A /v1/models on loopback that answers 401 without `Bearer <key>`, as vLLM --api-key does."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {key}":
                status, body = 401, {"error": {"message": "Unauthorized", "code": 401}}
            else:
                status, body = 200, {"data": [{"id": "keyed-model", "max_model_len": 4096}]}
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_users_send_pb_api_key_and_a_401_at_start_blames_the_key() -> None:
    assert auth_headers({}) == {}
    assert auth_headers({"PB_API_KEY": "sk-1"}) == {"Authorization": "Bearer sk-1"}
    with _keyed_models_server("sk-1") as url:
        for env, says in (({}, "PB_API_KEY is unset"), ({"PB_API_KEY": "bad"}, "was refused")):
            with pytest.raises(StartupError) as err:
                discover(url, env)
            assert "401" in str(err.value) and "PB_API_KEY" in str(err.value), err.value
            assert says in str(err.value) and "PB_MODEL" not in str(err.value)
        assert discover(url, {"PB_API_KEY": "sk-1"}) == ("keyed-model", 4096)
        assert discover(url, {"PB_MODEL": "m", "PB_MAX_MODEL_LEN": "100"}) == ("m", 100)
