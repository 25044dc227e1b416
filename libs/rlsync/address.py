"""The address a service tells others to dial, which is not always the one it binds."""

from __future__ import annotations

import socket


def advertised(host: str, port: int, advertise: str = "") -> str:
    """The address others should dial: --advertise (a host, or host:port behind a port mapping) with
    the bound port, else the bind address, or this host's address when bound to all."""
    if advertise:
        if _has_port(advertise):
            return advertise
        return f"[{advertise}]:{port}" if ":" in advertise else f"{advertise}:{port}"  # IPv6 in brackets
    return f"{reachable_host(host)}:{port}"


def reachable_host(bind: str) -> str:
    """The bind address, or this host's address when bound to every interface."""
    if bind in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:  # a host name that does not resolve: say what is bound
            pass
    return bind


def advertise_host(advertise: str) -> str | None:
    """The host part of --advertise, for channels that pick their own ports (weight transfers)."""
    if not advertise:
        return None
    return advertise.rpartition(":")[0].strip("[]") if _has_port(advertise) else advertise


def _has_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep) and port.isdigit() and (host.endswith("]") or ":" not in host)
