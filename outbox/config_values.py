"""How one setting's raw value, TOML's or an ``OUTBOX_*`` variable's text, becomes its typed value,
and what an address or URL setting must look like.

Every parser refuses what it cannot read with a one-line :class:`ConfigurationError` that
names the variable, so a daemon or a seller's app never starts on a half-understood setting.
Ranges and the checks between settings are :class:`outbox.config.Settings`'s.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from typing import Any, Mapping
from urllib.parse import urlsplit

from outbox.errors import ConfigurationError
from outbox.urls import Network

ENV_PREFIX = "OUTBOX_"


def normalize_database_url(url: str) -> str:
    """``postgres://`` (Heroku's, libpq's and many platforms' spelling) as ``postgresql://``.

    SQLAlchemy knows only the latter; the two name the same database.
    """
    scheme, sep, rest = url.partition("://")
    base, plus, driver = scheme.partition("+")
    if sep and base.lower() == "postgres":
        return f"postgresql{plus}{driver}://{rest}"
    return url


def _parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    value = str(raw).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigurationError(f"{ENV_PREFIX}{name.upper()} must be true or false (or 1/0, yes/no, on/off), "
                             f"got {raw!r}")


def _parse_cidrs(raw: Any) -> tuple[Network, ...]:
    items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
    networks = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise ConfigurationError(f"OUTBOX_ALLOWED_CIDRS: {item!r} is not a network ({exc})") from None
    return tuple(networks)


def _parse_encryption_key(raw: Any, variable: str = "OUTBOX_ENCRYPTION_KEY") -> bytes:
    try:
        key = base64.b64decode(str(raw).strip(), validate=True)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigurationError(
            f"{variable} must be 32 bytes in base64 (`outboxd encryption generate` prints one)"
        )
    return key


def _parse_old_keys(raw: Any) -> tuple[bytes, ...]:
    items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
    return tuple(_parse_encryption_key(i, "each of OUTBOX_ENCRYPTION_OLD_KEYS") for i in items if str(i).strip())


def _parse_tenant_keys(raw: Any) -> dict[str, tuple[str, str]]:
    if not isinstance(raw, Mapping):
        raise ConfigurationError("tenant_signing_keys must be a TOML table of tenant = {file, key_id}")
    keys = {}
    for tenant, entry in raw.items():
        where = f"[outbox.tenant_signing_keys] {tenant!r}"
        if not isinstance(entry, Mapping):
            raise ConfigurationError(f"{where} must be a table {{file = \"...\", key_id = \"...\"}}, got {entry!r}")
        missing = [k for k in ("file", "key_id") if not isinstance(entry.get(k), str) or not entry.get(k)]
        unknown = sorted(set(entry) - {"file", "key_id"})
        if missing or unknown:
            raise ConfigurationError(f"{where}: " + "; ".join(
                [f"needs {k} (a string)" for k in missing] + [f"unknown key {k!r}" for k in unknown]))
        keys[str(tenant)] = (entry["file"], entry["key_id"])
    return keys


_WHOLE = re.compile(r"[+-]?[0-9]+")


def coerce(name: str, annotation: str, raw: Any) -> Any:
    """``raw`` as the setting ``name`` (declared as ``annotation`` on Settings) holds it."""
    if name == "allowed_cidrs":
        return _parse_cidrs(raw)
    if name == "encryption_key":
        return _parse_encryption_key(raw)
    if name == "encryption_old_keys":
        return _parse_old_keys(raw)
    if name in ("database_url", "listen_database_url"):  # a pasted URL's newline is no part of it
        return normalize_database_url(str(raw).strip())
    if name in ("sinks", "operator_event_sinks"):
        items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
        return tuple(s.strip() for s in items if str(s).strip())
    if name == "tenant_signing_keys":
        return _parse_tenant_keys(raw)
    if annotation.startswith("bool"):
        return _parse_bool(name, raw)
    try:
        if annotation.startswith("int"):
            # TOML's 2.5 or true for a count; and what int() takes that no one means by a
            # number: "5_0" (50), "٣" (3)
            if isinstance(raw, (bool, float)) or (isinstance(raw, str) and not _WHOLE.fullmatch(raw.strip())):
                raise ValueError(raw)
            return int(raw)
        if annotation.startswith("float"):
            return float(raw)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"{ENV_PREFIX}{name.upper()}: {raw!r} is not a valid {annotation.split(' ')[0]}") from None
    return None if raw in (None, "") and "None" in annotation else str(raw)


def parse_addr(addr: str, variable: str, *, lowest_port: int = 0) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``; an empty host is every interface) as the pair to bind.

    Checked with the settings, so ``outboxd config`` and every command refuse a port the
    socket would silently wrap (99999 is 34463 to the kernel). Port 0 binds a free port:
    fine for ``OUTBOX_METRICS_ADDR``, whose bound address the daemon logs at start, not for
    ``OUTBOX_UI_ADDR``, whose address ``outboxd ui`` prints before binding it.
    """
    host, sep, port = addr.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    # An IPv6 address only in brackets (unbracketed, where would its port start?), else a
    # host name or IPv4 address: "http://h:80" is a URL, not an address to bind.
    good_host = not host or (_is_ipv6(host) if bracketed else bool(_HOST_NAME.fullmatch(host)))
    if not sep or not (port.isascii() and port.isdigit()) or not lowest_port <= int(port) <= 65535 or not good_host:
        raise ConfigurationError(f"{variable} must be host:port ([v6]:port for IPv6) with a port from {lowest_port} "
                                 f"to 65535, got {addr!r}")
    return host or "0.0.0.0", int(port)


_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def is_agent_url(value: str) -> bool:
    """An absolute http(s) URL without credentials: what buyers are sent as the seller agent."""
    parts = urlsplit(value)
    return parts.scheme in ("https", "http") and bool(parts.hostname) and not parts.username and not parts.password


def is_origin(value: str) -> bool:
    """``scheme://host[:port]`` and nothing else: what a revocation list's issuer must be."""
    parts = urlsplit(value)
    return is_agent_url(value) and parts.path == "" and not parts.query and not parts.fragment
