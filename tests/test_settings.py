"""Settings: one definition per setting, and nonsense refused at start-up with one clear line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_reliability_access import admits

from powerbatch.cli.main import build_parser, main
from powerbatch.cli.settings import SERVE, ServeSettings
from powerbatch.errors import ConfigError
from powerbatch.proxy.auth import ApiKeys
from powerbatch.settings import load, parse_value, reference_markdown

UP = "http://127.0.0.1:28401"


def serve_settings(**flat: Any) -> ServeSettings:
    settings: ServeSettings = load(SERVE, overrides={"upstream": UP, "ceiling_w": 550} | flat)
    return settings


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--margin-w", "-50"], "margin_w must be >= 0"),  # target above the ceiling
        (["--margin-w", "500"], "under half the ceiling"),  # negative target
        (["--ceiling-w", "inf"], "finite"),
        (["--ceiling-w", "nan"], "finite"),
        (["--max-wait-s", "-1"], "max_wait_s must be > 0"),
        (["--max-plausible-w", "500"], "above the ceiling"),
        (["--upstream", "127.0.0.1:28401"], "http(s) URL"),
        (["--port", "99999"], "port must be"),
        (["--admin-port", "8000"], "must differ from port"),
        (["--max-batch", "32.5"], "whole number"),
        (["--initial-batch", "300"], "initial_batch <= max_batch"),
        (["--mode", "shadow"], "one of enforce, observe"),
        (["--interactive-classes", "vip"], "unknown classes vip"),
        (["--stale-after-s", "0.05"], "every reading would be stale"),
        (["--power-source", "model"], "vLLM plugin's"),
    ],
)
def test_nonsense_flags_are_one_line_errors(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--upstream", UP, "--ceiling-w", "550", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("powerbatch: error:") and says in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_toml_lists_types_and_zero_are_kept(tmp_path: Path) -> None:
    f = tmp_path / "pb.toml"
    f.write_text(
        '[powerbatch]\nupstream = "http://127.0.0.1:9"\nceiling_w = 600\n'
        'api_keys = ["a", "b"]\ngpus = [0, 1]\nwarmup_s = 0\nmax_queue_len = 0\n'
    )
    s = load(SERVE, environ={"POWERBATCH_CONFIG": str(f)})
    assert s.proxy.api_keys == ("a", "b")  # not "['a'" and "'b']"
    assert s.power.gpus == ("0", "1")
    assert s.control.warmup_s == 0.0 and s.admission.max_queue_len == 0  # 0 is not "unset"
    keys = ApiKeys.load(s.proxy.api_keys)
    assert keys is not None and admits(keys, "Bearer a") and not admits(keys, "Bearer ['a'")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("max_batch = 32.5", "whole number"),
        ('tick_hz = "lots"', "must be a number"),
        ("prefill_pacing = 1", "true or false"),
        ("max_batchs = 8", "did you mean max_batch"),
        ("gpus = 0", "must be a list"),
    ],
)
def test_bad_toml_values_name_the_file(tmp_path: Path, line: str, says: str) -> None:
    f = tmp_path / "pb.toml"
    f.write_text(f'upstream = "http://127.0.0.1:9"\nceiling_w = 600\n{line}\n')
    with pytest.raises(ConfigError, match=says) as err:
        load(SERVE, environ={"POWERBATCH_CONFIG": str(f)})
    assert str(f) in str(err.value)


def test_precedence_default_file_env_flag(tmp_path: Path) -> None:
    f = tmp_path / "pb.toml"
    f.write_text('upstream = "http://127.0.0.1:9"\nceiling_w = 600\ntick_hz = 2\nwarmup_s = 3\n')
    env = {"POWERBATCH_CONFIG": str(f), "POWERBATCH_TICK_HZ": "4"}
    args = build_parser().parse_args(["serve", "--warmup-s", "1"])
    s = load(SERVE, args=args, environ=env)
    assert (s.control.tick_hz, s.control.warmup_s, s.control.ttft_slo_s) == (4.0, 1.0, 2.0)


def test_unknown_variable_is_an_error_but_other_surfaces_pass() -> None:
    env = {"POWERBATCH_UPSTREAM": UP, "POWERBATCH_CEILING_W": "500"}
    with pytest.raises(ConfigError, match="did you mean POWERBATCH_MAX_BATCH"):
        load(SERVE, environ=env | {"POWERBATCH_MAX_BACTH": "8"})
    ok = env | {"POWERBATCH_VLLM_CEILING_W": "1", "POWERBATCH_HEALTH_URL": "x"}
    assert load(SERVE, environ=ok).control.ceiling_w == 500


def test_required_settings_name_every_spelling() -> None:
    with pytest.raises(ConfigError, match="--ceiling-w / POWERBATCH_CEILING_W / key ceiling_w"):
        load(SERVE, environ={"POWERBATCH_UPSTREAM": UP})


def test_every_gain_is_a_setting() -> None:
    s = serve_settings(power_gain=0.5, kv_lead=3, demand_slack=0)
    assert (s.control.gains.power_gain, s.control.gains.kv_lead) == (0.5, 3.0)
    assert s.control.gains.demand_slack == 0
    with pytest.raises(ConfigError, match="pace_max"):
        serve_settings(pace_max=0.5)


def test_parse_value_by_annotation() -> None:
    assert parse_value(int | None, "") is None
    assert parse_value(tuple[str, ...], " a, b ,") == ("a", "b")
    with pytest.raises(ValueError, match="whole number"):
        parse_value(int, True)


def _help(flag: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "powerbatch", "serve", flag],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "200", "PATH": ""},
    ).stdout
    return " ".join(out.split())


def test_help_shows_an_operators_settings_and_help_all_the_advanced_ones() -> None:
    short, full = _help("--help"), _help("--help-all")
    for flat in (short, full):
        assert "POWERBATCH_CONFIG" in flat and "--help-all" in flat
        assert "default: 2% of the ceiling" in flat and "env POWERBATCH_MARGIN_W" in flat
    tick = "default: 5.0; > 0, <= 100; env POWERBATCH_TICK_HZ"
    assert tick not in short and "--power-gain" not in short and "--tick-hz" not in short
    assert tick in full and "Advanced: Controller gains" in full
    assert all(SERVE.flag(f) in full for f in SERVE.fields)
    shown = [f for f in SERVE.fields if SERVE.flag(f) + " " in short]
    assert 20 <= len(shown) <= 40, "--help should be an operator's page, not every knob"


def test_advanced_settings_are_still_flags_and_documented_after_the_operators() -> None:
    args = build_parser().parse_args(["serve", "--power-gain", "0.5", "--tick-hz", "10"])
    s = load(SERVE, args=args, overrides={"upstream": UP, "ceiling_w": 550})
    assert (s.control.gains.power_gain, s.control.tick_hz) == (0.5, 10.0)
    gains = {f.name for f in SERVE.fields if f.path[:2] == ("control", "gains")}
    assert gains and all(f.advanced for f in SERVE.fields if f.name in gains)
    table = reference_markdown(SERVE)
    first_advanced = table.index("**Advanced: ")
    assert table.index("`--ceiling-w`") < first_advanced < table.index("`--power-gain`")


def test_a_port_in_use_is_a_startup_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--upstream", UP, "--ceiling-w", "550", "--port", str(port)]
        argv += ["--power-source", "replay", "--replay-trace", str(_trace(Path("/tmp")))]
        argv += ["--no-upstream-metrics"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


def _trace(folder: Path) -> Path:
    path = folder / f"pb-settings-trace-{id(folder)}.csv"
    rows = "\n".join(f"{t / 10},{300 + t}" for t in range(100))
    path.write_text("t_s,power_w\n" + rows + "\n")
    return path


def test_key_file_errors_name_file_and_line_and_comments_are_allowed(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# clients\nsk-one  # team a\nsk-two\n")
    keys = ApiKeys.load((), str(f))
    assert keys is not None and admits(keys, "Bearer sk-one") and len(keys) == 2
    f.write_text("sk-one\nsk two\n")
    with pytest.raises(ConfigError, match=f"{f}:2:"):
        ApiKeys.load((), str(f))


def test_an_upstream_without_power_metrics_refuses_to_start() -> None:
    """A real vLLM's /metrics has no DCGM power: say so and name the fix, never serve blind."""
    import asyncio

    from aiohttp import web

    from powerbatch.cli.serve import serve

    async def vllm_metrics(request: web.Request) -> web.Response:
        return web.Response(
            text="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
        )

    async def go() -> str:
        app = web.Application()
        app.router.add_get("/metrics", vllm_metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            s = load(
                SERVE,
                overrides={"upstream": url, "ceiling_w": 550, "startup_probe_s": 0.5, "port": 1},
            )
            with pytest.raises(ConfigError) as err:
                await serve(s, stop=asyncio.Event())
            return str(err.value)
        finally:
            await runner.cleanup()

    message = asyncio.run(go())
    assert "DCGM_FI_DEV_POWER_USAGE" in message
    assert "--power-source nvml" in message and "--dcgm-url" in message


@pytest.mark.parametrize("command", ["bench", "fleet-bench"])
def test_the_benches_count_slos_by_the_controllers_defaults(command: str) -> None:
    args = build_parser().parse_args([command])
    control = serve_settings().control
    assert (args.ttft_slo_s, args.tpot_slo_s) == (control.ttft_slo_s, control.tpot_slo_s)
