"""Typed service configuration: dataclasses whose fields map onto flags and environment variables in one place.

Precedence: command-line flag > environment variable `RLSYNC_<FIELD>` > the field's default.
Nested dataclass fields are flattened (their fields become flags of the outer config).

A value a service cannot start with is refused before anything loads, in one line that names the
flag and its variable (StartupError): `build` refuses what does not parse, `validate` what is out of
a field's bounds, fails its `check`, or fails the config's own `check()` (a port in use, a missing
file, two values that contradict each other).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rlsync.checks import ENV_PREFIX, advertise_address, check_ports, check_tls, flag, refused

T = TypeVar("T")


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
           choices: tuple[str, ...] | None = None, secret: bool = False, minimum: float | None = None,
           maximum: float | None = None, above: float | None = None,
           check: Callable[[Any], str | None] | None = None) -> Any:
    """A config field: its default and the help text that flags and docs show.

    minimum / maximum: inclusive bounds; above: an exclusive lower bound (a timeout above 0).
    check: value -> what is wrong with it (None: nothing), run by `validate` (at start-up only)."""
    meta = {"help": help, "choices": choices, "secret": secret, "minimum": minimum, "maximum": maximum,
            "above": above, "check": check}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class ServerConfig:
    """How a service listens: address, access control, message limits, shutdown."""

    host: str = option("127.0.0.1", "address to bind; loopback by default, 0.0.0.0 to serve other hosts")
    port: int = option(0, "port to bind; 0 picks a free one (printed at start)", minimum=0, maximum=65535)
    token: str = option("", "shared secret; when set, every RPC but health must send "
                            "'authorization: Bearer <token>'", secret=True)
    tls_cert: str = option("", "PEM certificate file; with --tls-key, serve TLS")
    tls_key: str = option("", "PEM private key file for --tls-cert")
    max_message_bytes: int = option(16 << 20, "largest request or response message; larger ones "
                                              "get RESOURCE_EXHAUSTED", minimum=1, maximum=(1 << 31) - 1)
    advertise: str = option("", "host (or host:port) other machines reach this service at; empty = the bind "
                                "address, or this host's address when bound to all", check=advertise_address)
    grace_seconds: float = option(5.0, "on SIGTERM: time in-flight work gets to finish (a replica's requests, "
                                       "then the server's RPCs: up to twice this in all)", minimum=0)
    log_level: str = option("INFO", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    metrics_port: int = option(-1, "port of the Prometheus /metrics endpoint (bound to --host); 0 picks a free "
                                   "one; -1: off", minimum=-1, maximum=65535)

    def check(self) -> None:
        """What only this host can say: TLS files that load, a --host of this host, ports not in use."""
        if bool(self.tls_cert) != bool(self.tls_key):
            given, missing = ("tls_cert", "tls_key") if self.tls_cert else ("tls_key", "tls_cert")
            raise refused(given, f"TLS needs both --tls-cert and --tls-key: give {flag(missing)} too")
        if self.tls_cert:
            check_tls(self.tls_cert, self.tls_key)
        ports = {"port": self.port}
        if self.metrics_port >= 0:
            ports["metrics_port"] = self.metrics_port
        check_ports(self.host, ports)


def _fields(cls: type) -> list[tuple[dataclasses.Field, type]]:
    """Flattened (field, resolved type) pairs; nested dataclasses contribute their own fields."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _fields(tp)
        else:
            out.append((f, tp))
    return out


def _base(tp: Any) -> Any:
    """`int | None` -> int; other types unchanged."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _parse(raw: str, tp: Any, name: str) -> Any:
    base = _base(tp)
    origin = typing.get_origin(base) or base
    try:
        if base is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if origin in (dict, Mapping):
            value = json.loads(raw) if raw else {}
            if not isinstance(value, dict):
                raise ValueError("not an object")
            return value
        if origin in (list, tuple):
            items = [s for s in raw.split(",") if s]
            (item_tp, *_) = typing.get_args(base) or (str,)
            return tuple(_parse(s, item_tp, name) for s in items) if origin is tuple else \
                [_parse(s, item_tp, name) for s in items]
        return base(raw)
    except ValueError as e:
        if origin in (dict, Mapping):
            expected = "a JSON object" + (f" ({e})" if isinstance(e, json.JSONDecodeError) else "")
        else:
            expected = {bool: "true or false", int: "an integer", float: "a number"}.get(base, str(e))
        raise refused(name, f"invalid value {raw!r} for {name}: expected {expected}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one --flag per (flattened) field of `cls`."""
    defaults = describe(cls())
    for f, tp in _fields(cls):
        option_string = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        shown = defaults[f.name]
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {shown!r}]"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if _base(tp) is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = f.name.upper()
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(option_string, **kwargs)


def build(cls: type[T], args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
          **overrides: Any) -> T:
    """An instance of `cls` from flags, then environment, then defaults; `overrides` win over all."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f, tp in _fields(cls):
        value = overrides.get(f.name, getattr(args, f.name, None) if args is not None else None)
        if value is None and ENV_PREFIX + f.name.upper() in env:
            value = env[ENV_PREFIX + f.name.upper()]
        if isinstance(value, str) and _base(tp) is not str:
            value = _parse(value, tp, f.name)
        if value is not None:
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise refused(f.name, f"invalid choice: {value!r} (choose from {', '.join(choices)})")
            values[f.name] = value
    return _construct(cls, values)


def validate(cfg: Any) -> None:
    """Refuses (StartupError, naming the flag) a value `cfg` cannot start with: first each field on
    its own (its bounds, its check), then each config's `check()` (nested ones first): values together,
    and what only this host can say (ports in use, files). Reads the file system and binds probe
    sockets: the entry point calls it once, before anything loads."""
    configs = _configs(cfg)
    for config in configs:
        for f in dataclasses.fields(config):
            if not dataclasses.is_dataclass(value := getattr(config, f.name)):
                _check_field(f, value)
    for config in configs:
        if hasattr(config, "check"):
            config.check()


def _configs(cfg: Any) -> list[Any]:
    """`cfg` and the configs nested in it, the nested ones first."""
    nested = [c for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(c := getattr(cfg, f.name))]
    return [*(inner for c in nested for inner in _configs(c)), cfg]


def _check_field(f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value:
            raise refused(f.name, "must be a number, got nan")
        if meta.get("minimum") is not None and value < meta["minimum"]:
            raise refused(f.name, f"must be at least {meta['minimum']}, got {value}")
        if meta.get("maximum") is not None and value > meta["maximum"]:
            raise refused(f.name, f"must be at most {meta['maximum']}, got {value}")
        if meta.get("above") is not None and value <= meta["above"]:
            raise refused(f.name, f"must be more than {meta['above']}, got {value}")
    if meta.get("check") is not None and (problem := meta["check"](value)):
        raise refused(f.name, problem)


def _construct(cls: type[T], values: dict[str, Any]) -> T:
    return _apply(cls(), values)


def _apply(instance: T, values: dict[str, Any]) -> T:
    """A copy of `instance` (whose defaults may come from an outer config) with `values` set."""
    changes = {}
    for f in dataclasses.fields(instance):
        current = getattr(instance, f.name)
        if dataclasses.is_dataclass(current):
            changes[f.name] = _apply(current, values)
        elif f.name in values:
            changes[f.name] = values[f.name]
    return dataclasses.replace(instance, **changes)


def describe(cfg: Any) -> dict[str, Any]:
    """The config as a dict for logs, with secrets masked."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(describe(value))
        else:
            out[f.name] = "***" if f.metadata.get("secret") and value else value
    return out
