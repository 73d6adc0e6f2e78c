"""Typed settings, each defined once, from which flags, environment, TOML keys and docs are made.

A setting is a field of a frozen dataclass made with `setting(default, help, bounds...)`. Its
annotated type says how text is parsed (int, float, bool, str, a `Literal` of choices, a tuple of
str or int, any of them `| None`); its bounds and the dataclass's `__post_init__` say what is
allowed. Dataclasses nest into sections (`ControlConfig` inside `ServeSettings`); a `Surface`
flattens them, so every setting of a surface has one unique name, and from that name come:

    flag             --ceiling-w            (a surface with a command line)
    environment      POWERBATCH_CEILING_W   (the surface's prefix)
    TOML key         ceiling_w              (top level or in the surface's table)

Precedence: default < TOML file < environment < flag. A value of the wrong type, out of its
bounds, an unknown key or an unknown variable under the prefix is a `ConfigError` that names
where it came from, never a silent default. Plain dataclasses, not a settings library: the
controller's config must import nothing heavy, and vLLM's own config is written the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import math
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from powerbatch.errors import ConfigError

T = TypeVar("T")
_META = "powerbatch.setting"
# A section whose class sets `settings_advanced = True` (the controller's gains) is all tuning,
# wherever it nests: its settings are advanced (`Field.advanced`).
ADVANCED = "settings_advanced"


@dataclass(frozen=True, slots=True)
class Spec:
    """What a setting means and where its value may lie."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    default_doc: str | None = None  # the default in words, where it is derived (e.g. "2% of ...")

    def bounds_text(self) -> str:
        parts = []
        for op, value in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)):
            if value is not None:
                parts.append(f"{op} {value:g}")
        return ", ".join(parts)


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    default_doc: str | None = None,
    secret: bool = False,
) -> Any:
    """A dataclass field that is also a setting. No default: the setting is required.

    A `secret` (an API key) is left out of the dataclass's repr, so logs never show it.
    """
    spec = Spec(help, ge, gt, le, lt, default_doc)
    return dataclasses.field(default=default, metadata={_META: spec}, repr=not secret)


def check_bounds(obj: Any) -> None:
    """Raise ConfigError for any field of `obj` outside its bounds (call from __post_init__)."""
    for f in dataclasses.fields(obj):
        spec = f.metadata.get(_META)
        if spec is not None:
            _check_value(f.name, getattr(obj, f.name), spec)


def _check_value(name: str, value: Any, spec: Spec) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    bad = (
        (spec.ge is not None and value < spec.ge)
        or (spec.gt is not None and value <= spec.gt)
        or (spec.le is not None and value > spec.le)
        or (spec.lt is not None and value >= spec.lt)
    )
    if bad:
        raise ConfigError(f"{name} must be {spec.bounds_text()}, got {value:g}")


# -- the flattened view ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Field:
    """One setting of a surface: its unique name, where it sits, its type and meaning."""

    name: str
    path: tuple[str, ...]  # attribute path from the surface's root dataclass
    kind: Any  # the resolved annotation
    default: Any  # MISSING: required
    spec: Spec
    section: str  # the first line of the owning dataclass's docstring
    advanced: bool = False  # a tuning knob: `--help-all` and the reference's advanced tables

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def choices(self) -> tuple[str, ...] | None:
        base = _strip_none(self.kind)
        if typing.get_origin(base) is Literal:
            return tuple(str(c) for c in typing.get_args(base))
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return tuple(str(m.value) for m in base)
        return None

    def default_text(self) -> str:
        if self.required:
            return "required"
        if self.spec.default_doc:
            return self.spec.default_doc
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, tuple):
            return ",".join(str(x) for x in self.default) or "empty"
        return f"{self.default}"


def _strip_none(kind: Any) -> Any:
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else kind
    return kind


def _optional(kind: Any) -> bool:
    return _strip_none(kind) is not kind


def _walk(cls: type, path: tuple[str, ...], advanced: bool = False) -> Iterator[Field]:
    hints = typing.get_type_hints(cls)
    section = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
    advanced = advanced or getattr(cls, ADVANCED, False) is True
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        spec = f.metadata.get(_META)
        if spec is None and dataclasses.is_dataclass(kind):
            yield from _walk(typing.cast(type, kind), (*path, f.name), advanced)  # a section
        elif spec is not None:
            yield Field(f.name, (*path, f.name), kind, f.default, spec, section, advanced)


@dataclass(frozen=True)
class Surface:
    """The settings of one program: a root dataclass and how its names are spelled outside."""

    root: type
    env_prefix: str  # e.g. "POWERBATCH_"
    config_env: str  # the variable that names a TOML file
    table: str  # the TOML table that may hold the keys (else: top level)
    has_flags: bool = True
    other_env: tuple[str, ...] = ()  # variables under the prefix that are not settings
    other_prefixes: tuple[str, ...] = ()  # e.g. another surface's prefix under ours
    # Defaults this surface sets differently from the dataclass: name -> (value, in words).
    defaults: Mapping[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    # The settings an operator sets: `--help` shows these, the rest are advanced (`--help-all`,
    # and the reference's tables after them). None: all but the advanced sections'.
    operator: frozenset[str] | None = None

    @property
    def fields(self) -> tuple[Field, ...]:
        out = tuple(self._field(f) for f in _walk(self.root, ()))
        names = [f.name for f in out]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:  # a programming error: names are the public interface
            raise TypeError(f"{self.root.__name__}: settings defined twice: {sorted(dupes)}")
        stray = sorted((self.operator or frozenset()) - set(names))
        if stray:
            raise TypeError(f"{self.root.__name__}: operator settings that are none: {stray}")
        return out

    def _field(self, f: Field) -> Field:
        if f.name in self.defaults:
            value, doc = self.defaults[f.name]
            f = dataclasses.replace(
                f, default=value, spec=dataclasses.replace(f.spec, default_doc=doc)
            )
        if self.operator is not None and f.name not in self.operator:
            f = dataclasses.replace(f, advanced=True)
        return f

    def flag(self, f: Field) -> str:
        return "--" + f.name.replace("_", "-")

    def env(self, f: Field) -> str:
        return self.env_prefix + f.name.upper()

    def where(self, f: Field) -> str:
        """All the spellings of a setting, for error messages."""
        out = [self.flag(f)] if self.has_flags else []
        return " / ".join([*out, self.env(f), f"key {f.name}"])


# -- parsing ---------------------------------------------------------------------------------

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_value(kind: Any, raw: Any) -> Any:
    """`raw` (text from a flag or variable, or a TOML value) as `kind`; ValueError if it isn't."""
    if _optional(kind):
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none")):
            return None
        kind = _strip_none(kind)
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        choice = raw.strip() if isinstance(raw, str) else raw
        if choice not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {raw!r}")
        return choice
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(raw.strip() if isinstance(raw, str) else raw)
        except ValueError:
            names = ", ".join(str(m.value) for m in kind)
            raise ValueError(f"must be one of {names}, got {raw!r}") from None
    if origin is tuple:
        item = typing.get_args(kind)[0]
        if isinstance(raw, str):
            items: list[Any] = [x.strip() for x in raw.split(",") if x.strip()]
        elif isinstance(raw, list | tuple):
            items = list(raw)
        else:
            raise ValueError(f"must be a list, got {raw!r}")
        return tuple(parse_value(item, x) for x in items)
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        word = raw.strip().lower() if isinstance(raw, str) else ""
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(f"must be true or false, got {raw!r}")
    if kind is int:
        if isinstance(raw, bool | float):
            raise ValueError(f"must be a whole number, got {raw!r}")
        try:
            return int(str(raw).strip(), 10) if isinstance(raw, str) else int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"must be a whole number, got {raw!r}") from None
    if kind is float:
        if isinstance(raw, bool):
            raise ValueError(f"must be a number, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {raw!r}")
        return value
    if kind is str:
        if isinstance(raw, str | int) and not isinstance(raw, bool):
            return str(raw)
        raise ValueError(f"must be text, got {raw!r}")
    raise TypeError(f"unsupported setting type {kind!r}")  # a programming error


def _unknown(name: str, known: list[str]) -> str:
    near = difflib.get_close_matches(name, known, n=1)
    return f"{name} (did you mean {near[0]}?)" if near else name


def read_toml(path: str | Path, table: str) -> dict[str, Any]:
    """The surface's keys from a TOML file: its `[table]` if present, else the top level."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    values = data.get(table, data)
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: [{table}] must be a table")
    return values


def load(
    surface: Surface,
    *,
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """The surface's root settings from defaults < file < environment < flags < `overrides`.

    `overrides` (by setting name, already typed or text) is for programs and tests that build
    settings in code; they pass the same checks as every other source.
    """
    env = dict(environ or {})
    fields = {f.name: f for f in surface.fields}
    names = sorted(fields)
    values: dict[str, Any] = {name: value for name, (value, _) in surface.defaults.items()}

    def put(f: Field, raw: Any, where: str) -> None:
        try:
            value = parse_value(f.kind, raw)
            _check_value(f.name, value, f.spec)
        except (ValueError, ConfigError) as exc:
            msg = str(exc).removeprefix(f"{f.name} ")
            raise ConfigError(f"{where}: {f.name} {msg}") from None
        values[f.name] = value

    path = (getattr(args, "config", None) if args else None) or env.get(surface.config_env)
    if path:
        file_values = read_toml(path, surface.table)
        unknown = [_unknown(k, names) for k in sorted(file_values) if k not in fields]
        if unknown:
            raise ConfigError(f"{path}: unknown keys: {', '.join(unknown)}")
        for key, raw in file_values.items():
            put(fields[key], raw, str(path))

    env_names = {surface.env(f): f for f in fields.values()}
    allowed = {surface.config_env, *surface.other_env}
    stray = [
        _unknown(k, sorted(env_names))
        for k in sorted(env)
        if k.startswith(surface.env_prefix)
        and k not in env_names
        and k not in allowed
        and not k.startswith(surface.other_prefixes or ("\0",))
    ]
    if stray:
        raise ConfigError(f"unknown settings in the environment: {', '.join(stray)}")
    for key, f in env_names.items():
        if key in env:
            put(f, env[key], key)

    if args is not None:
        for f in fields.values():
            raw = getattr(args, f.name, None)
            if raw is not None:
                put(f, raw, surface.flag(f))
    for name, raw in (overrides or {}).items():
        if name not in fields:
            raise ConfigError(f"unknown setting {_unknown(name, names)}")
        put(fields[name], raw, name)

    missing = [f for f in fields.values() if f.required and f.name not in values]
    if missing:
        raise ConfigError(
            "required: " + "; ".join(f"{f.name} ({surface.where(f)})" for f in missing)
        )
    return build(surface.root, values)


def build(cls: type[T], values: Mapping[str, Any], path: tuple[str, ...] = ()) -> T:
    """Instantiate `cls` and its sections from flat values (defaults for the rest)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        if f.metadata.get(_META) is None and dataclasses.is_dataclass(kind):
            kwargs[f.name] = build(kind, values, (*path, f.name))  # type: ignore[arg-type]
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def flat(obj: Any) -> dict[str, Any]:
    """Every setting of a (nested) settings object by name: for logs, status and tests."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get(_META) is None and dataclasses.is_dataclass(value):
            out.update(flat(value))
        else:
            out[f.name] = value
    return out


# -- generated surfaces: flags and the reference ---------------------------------------------


def _ordered(surface: Surface) -> list[tuple[str, list[Field]]]:
    """The surface's fields by section, an operator's first, then the advanced ones."""
    out: dict[str, list[Field]] = {}
    for f in sorted(surface.fields, key=lambda f: f.advanced):  # stable: the sections' order
        out.setdefault(f"Advanced: {f.section}" if f.advanced else f.section, []).append(f)
    return list(out.items())


class _HelpAll(argparse.Action):
    """`--help-all`: the help with the advanced settings shown too."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        self.hidden: list[tuple[argparse.Action, str]] = kwargs.pop("hidden")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        for action, text in self.hidden:
            action.help = text
        parser.print_help()
        parser.exit()


def add_arguments(parser: argparse.ArgumentParser, surface: Surface) -> None:
    """One flag per setting, grouped by section, the way vLLM groups its help.

    `--help` shows an operator's settings; the advanced ones (gains, tuning knobs) are flags
    like the rest but their help waits for `--help-all`. Values stay text until `load` parses
    them with the rest.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file of these settings (env {surface.config_env}); its keys are the "
        "flags' names with underscores",
    )
    hidden: list[tuple[argparse.Action, str]] = []
    n_advanced = sum(f.advanced for f in surface.fields)
    if n_advanced:
        parser.add_argument(
            "--help-all",
            action=_HelpAll,
            hidden=hidden,
            help=f"show this help with the {n_advanced} advanced settings too (gains and tuning "
            "knobs, in the groups marked Advanced) and exit",
        )
    for title, fields in _ordered(surface):
        group = parser.add_argument_group(title)
        for f in fields:
            extra = [f"default: {f.default_text()}", f.spec.bounds_text(), f"env {surface.env(f)}"]
            text = f"{f.spec.help} [{'; '.join(filter(None, extra))}]".replace("%", "%%")
            kw: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
            if _strip_none(f.kind) is not bool:
                kw = {"metavar": "{" + ",".join(f.choices) + "}" if f.choices else f.name.upper()}
            shown = argparse.SUPPRESS if f.advanced else text
            action = group.add_argument(surface.flag(f), dest=f.name, help=shown, **kw)
            if f.advanced:
                hidden.append((action, text))
    parser.set_defaults(**{f.name: None for f in surface.fields})


def reference_markdown(surface: Surface) -> str:
    """Every setting of the surface as markdown tables, one per section, advanced ones last."""
    out: list[str] = []
    head = ["flag"] if surface.has_flags else []
    head += ["environment", "file key", "default", "meaning"]
    for title, fs in _ordered(surface):
        if out:
            out.append("")
        out += [f"**{title}**", "", "| " + " | ".join(head) + " |"]
        out.append("|" + "---|" * len(head))
        for f in fs:
            meaning = f.spec.help
            if f.choices:
                meaning += f" (one of {' / '.join(f.choices)})"
            if f.spec.bounds_text():
                meaning += f"; {f.spec.bounds_text()}"
            cells = [f"`{surface.flag(f)}`"] if surface.has_flags else []
            default = f.default_text()
            if not (f.required or f.spec.default_doc or f.default is None):
                default = f"`{default}`"
            cells += [f"`{surface.env(f)}`", f"`{f.name}`", default, meaning.replace("|", "\\|")]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
