"""Every setting of `powerbatch serve`, defined once: flag, environment variable and file key.

Precedence: built-in default < config file (TOML, top level or a [powerbatch] table) <
environment (POWERBATCH_<NAME>) < command-line flag. `docs/configuration.md` is generated from
this table (`powerbatch config-reference`), so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerbatch.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "POWERBATCH_" + self.name.upper()


SERVE_OPTIONS: tuple[Option, ...] = (
    Option("upstream", str, None, "base URL of the OpenAI-compatible server (required)"),
    Option("host", str, "127.0.0.1", "address to listen on"),
    Option("port", int, 8000, "port to listen on"),
    Option("ceiling_w", float, None, "hard power ceiling for the GPU set, watts (required)"),
    Option(
        "max_w",
        float,
        None,
        "the GPU set's power limit (TDP), watts; prior only; default: NVML's default limit "
        "with --power-source nvml, else ceiling / 0.7",
    ),
    Option("power_source", str, "dcgm", "where watts come from", ("nvml", "dcgm", "replay")),
    Option("gpus", str, "0", "comma-separated GPU indices (NVML) or gpu label values (dcgm)"),
    Option("dcgm_url", str, None, "dcgm-exporter /metrics URL (default: the upstream's /metrics)"),
    Option("dcgm_metric", str, "DCGM_FI_DEV_POWER_USAGE", "power metric name to sum"),
    Option("replay_trace", str, None, "CSV trace for --power-source replay"),
    Option("power_interval_s", float, 0.1, "power polling interval"),
    Option("stale_after_s", float, 1.0, "a reading older than this fails the controller closed"),
    Option("max_plausible_w", float, None, "readings above this are garbage (default 3 x ceiling)"),
    Option("upstream_metrics", bool, True, "scrape the upstream's vLLM metrics as extra signals"),
    Option(
        "mode",
        str,
        "enforce",
        "enforce limits, or observe (decide and report only)",
        ("enforce", "observe"),
    ),
    Option("warmup_s", float, 5.0, "silent warm-up: learn at the initial batch"),
    Option("tick_hz", float, 5.0, "control decisions per second"),
    Option("min_batch", int, 1, "smallest batch limit"),
    Option("max_batch", int, 256, "largest batch limit; keep at or under vLLM --max-num-seqs"),
    Option("initial_batch", int, 8, "batch limit during warm-up"),
    Option("safe_batch", int, 2, "batch limit while no power reading can be trusted"),
    Option("max_kv_tokens", int, 2_000_000, "hard cap on estimated KV tokens in flight"),
    Option("margin_w", float, None, "stay this far under the ceiling (default 2%)"),
    Option("confidence", float, 0.95, "confidence of the upper prediction bound"),
    Option("ttft_slo_s", float, 2.0, "p95 time-to-first-token SLO"),
    Option("tpot_slo_s", float, 0.1, "p95 time-per-output-token SLO"),
    Option("prefill_pacing", bool, True, "pace prompt tokens admitted per second"),
    Option("valley_fill", bool, False, "hold deferrable (low) work for power troughs"),
    Option("max_queue_len", int, 1_000, "requests waiting, all classes"),
    Option(
        "max_wait_s", float, 30.0, "longest wait in the queue (low class: 10x with valley fill)"
    ),
    Option("max_body_bytes", int, 4 * 1024 * 1024, "larger request bodies get 413"),
    Option("default_max_tokens", int, 256, "KV estimate for requests without max_tokens"),
    Option("read_timeout_s", float, 120.0, "longest upstream silence inside a response"),
    Option("connect_timeout_s", float, 5.0, "longest wait to connect to the upstream"),
    Option(
        "headers_timeout_s",
        float,
        600.0,
        "longest wait for the upstream's response headers (a non-streamed answer: all of it)",
    ),
    Option(
        "client_timeout_s",
        float,
        60.0,
        "longest a client may take to send its body (408) or to take a stream chunk",
    ),
    Option("max_tokens_limit", int, 131_072, "larger max_tokens get 400"),
    Option("api_keys", str, None, "comma-separated client API keys (Bearer); unset: no auth"),
    Option("api_keys_file", str, None, "file of client API keys, one a line (# comments)"),
    Option(
        "upstream_api_key",
        str,
        None,
        "send this key upstream instead of the client's Authorization",
    ),
    Option(
        "admin_port",
        int,
        None,
        "serve /metrics and /status* on this port only (unset: on --port, behind the keys)",
    ),
    Option("admin_host", str, "127.0.0.1", "address of the admin listener"),
    Option(
        "hardware_backstop",
        bool,
        False,
        "also set the GPUs' NVML power limit to the ceiling, restored on exit (needs nvml, root)",
    ),
    Option("drain_grace_s", float, 30.0, "on SIGTERM, time given to in-flight requests"),
    Option("record_trace", str, None, "write the control trace CSV here on exit"),
    Option("log_level", str, "info", "logging level", ("debug", "info", "warning", "error")),
)


def _coerce(opt: Option, value: Any, where: str) -> Any:
    if value is None:
        return None
    if opt.kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: {opt.name} must be true or false, got {value!r}")
    try:
        out = opt.kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{where}: {opt.name} must be {opt.kind.__name__}, got {value!r}"
        ) from exc
    if opt.choices and out not in opt.choices:
        raise ConfigError(f"{where}: {opt.name} must be one of {', '.join(opt.choices)}")
    return out


def add_arguments(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    parser.add_argument("--config", help="TOML file with these settings")
    for opt in options:
        if opt.kind is bool:
            parser.add_argument(
                opt.flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=opt.help.replace("%", "%%"),
            )
        else:
            help_text = f"{opt.help} [env {opt.env}]".replace("%", "%%")
            parser.add_argument(opt.flag, default=None, help=help_text)


def resolve(
    options: tuple[Option, ...],
    args: argparse.Namespace,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, Any]:
    """Merge defaults, file, environment and flags; raise ConfigError on a bad value or key."""
    file_values: dict[str, Any] = {}
    path = getattr(args, "config", None) or environ.get("POWERBATCH_CONFIG")
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        file_values = data.get("powerbatch", data)
        known = {o.name for o in options}
        unknown = sorted(set(file_values) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown keys {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for opt in options:
        value = opt.default
        if opt.name in file_values:
            value = _coerce(opt, file_values[opt.name], str(path))
        if opt.env in environ:
            value = _coerce(opt, environ[opt.env], opt.env)
        flag_value = getattr(args, opt.name, None)
        if flag_value is not None:
            value = _coerce(opt, flag_value, opt.flag)
        out[opt.name] = value
    return out


def reference_markdown(options: tuple[Option, ...] = SERVE_OPTIONS) -> str:
    lines = [
        "| flag | environment | file key | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for o in options:
        choices = f" ({' / '.join(o.choices)})" if o.choices else ""
        default = "—" if o.default is None else f"`{o.default}`"
        lines.append(f"| `{o.flag}` | `{o.env}` | `{o.name}` | {default} | {o.help}{choices} |")
    return "\n".join(lines) + "\n"
