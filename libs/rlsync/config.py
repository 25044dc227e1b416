"""Typed service configuration: dataclasses whose fields map onto flags and environment variables in one place.

Precedence: command-line flag > environment variable `RLSYNC_<FIELD>` > the field's default.
Nested dataclass fields are flattened (their fields become flags of the outer config).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "RLSYNC_"


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
           choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    """A config field: its default and the help text that flags and docs show."""
    meta = {"help": help, "choices": choices, "secret": secret}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class ServerConfig:
    """How a service listens: address, access control, message limits, shutdown."""

    host: str = option("127.0.0.1", "address to bind; loopback by default, 0.0.0.0 to serve other hosts")
    port: int = option(0, "port to bind; 0 picks a free one (printed at start)")
    token: str = option("", "shared secret; when set, every RPC but health must send "
                            "'authorization: Bearer <token>'", secret=True)
    tls_cert: str = option("", "PEM certificate file; with --tls-key, serve TLS")
    tls_key: str = option("", "PEM private key file for --tls-cert")
    max_message_bytes: int = option(16 << 20, "largest request or response message; larger ones "
                                              "get RESOURCE_EXHAUSTED")
    advertise: str = option("", "host (or host:port) other machines reach this service at; empty = the bind "
                                "address, or this host's address when bound to all")
    grace_seconds: float = option(5.0, "on SIGTERM: time in-flight work gets to finish (a replica's requests, "
                                       "then the server's RPCs: up to twice this in all)")
    log_level: str = option("INFO", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    metrics_port: int = option(-1, "port of the Prometheus /metrics endpoint (bound to --host); 0 picks a free "
                                   "one; -1: off")


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
                raise ValueError("expected a JSON object")
            return value
        if origin in (list, tuple):
            items = [s for s in raw.split(",") if s]
            (item_tp, *_) = typing.get_args(base) or (str,)
            return type(origin)(_parse(s, item_tp, name) for s in items) if origin is tuple else \
                [_parse(s, item_tp, name) for s in items]
        return base(raw)
    except ValueError as e:
        raise SystemExit(f"invalid value {raw!r} for {name}: {e}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one --flag per (flattened) field of `cls`."""
    defaults = describe(cls())
    for f, tp in _fields(cls):
        flag = "--" + f.name.replace("_", "-")
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
        parser.add_argument(flag, **kwargs)


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
                raise SystemExit(f"invalid value {value!r} for {f.name}: choose from {', '.join(choices)}")
            values[f.name] = value
    return _construct(cls, values)


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
