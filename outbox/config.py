"""Settings shared by the producer API and the daemon.

Read from ``OUTBOX_*`` environment variables, optionally layered over a TOML file, so a
seller's app and ``outboxd`` configured from the same environment agree on the database,
the retry horizon and the destination policy.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import tomllib
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from outbox.config_values import ENV_PREFIX, coerce, is_agent_url, is_origin, parse_addr
from outbox.errors import ConfigurationError
from outbox.sealing import SealingKeys, sealing_keys
from outbox.urls import Network, origin

# OUTBOX_ variables that are not settings but are read all the same.
OTHER_VARIABLES = frozenset({"OUTBOX_CONFIG"})
# Settings never printed in clear (``outboxd config``); the database URL loses its password.
SECRET_SETTINGS = frozenset({"encryption_key", "encryption_old_keys", "ui_token"})
MASK = "****"
# docs/protocol.md, "Retry horizon": delivery_retry_horizon_seconds is 86400..604800.
MIN_HORIZON = 86_400
MAX_HORIZON = 604_800
# docs/protocol.md, "Signing": buyers may cache the seller's JWKS this long.
JWKS_CACHE_CEILING = 1800
MIN_ACTIVITY_RETENTION_DAYS = 30  # webhook-activity-record: retained >= 30 days after completed_at

POOLER_MODES = ("none", "transaction")


MAX_SECONDS = 31_536_000.0  # a year: beyond it a timeout no longer fits the OS's timeval
MAX_COUNT = 1_000_000


@dataclass(frozen=True)
class Bounds:
    """The legal range of one numeric setting; NaN and infinities are never legal.

    ``low_open`` makes the lower bound exclusive (a timeout must be > 0, a grace may be 0).
    """

    low: float
    high: float
    low_open: bool = False
    why: str = ""

    def check(self, name: str, value: object) -> None:
        """Raise a one-line :class:`ConfigurationError` naming the variable when out of range."""
        var = ENV_PREFIX + name.upper()
        integral = isinstance(self.low, int) and isinstance(self.high, int)
        kind = (int,) if integral else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigurationError(f"{var} must be {'an integer' if integral else 'a number'}, got {value!r}")
        above = value > self.low if self.low_open else value >= self.low
        if not (math.isfinite(value) and above and value <= self.high):
            low = f"> {self.low:.15g}" if self.low_open else f">= {self.low:.15g}"
            raise ConfigurationError(f"{var} must be {low} and <= {self.high:.15g}{self.why}, got {value!r}")


def _seconds(*, zero: bool = False) -> Bounds:
    return Bounds(0.0, MAX_SECONDS, low_open=not zero)


# Every int and float field of Settings has an entry (tests/test_config_validation.py
# checks it): add one next to a new numeric setting.
NUMERIC_BOUNDS: dict[str, Bounds] = {
    "retry_horizon_seconds": Bounds(MIN_HORIZON, MAX_HORIZON, why=" (AdCP delivery_retry_horizon_seconds)"),
    "concurrency": Bounds(1, MAX_COUNT),
    "endpoint_concurrency": Bounds(1, MAX_COUNT),
    "claim_batch": Bounds(1, MAX_COUNT),
    "connect_timeout_seconds": _seconds(),
    "read_timeout_seconds": _seconds(),
    "lease_seconds": _seconds(),
    "poll_interval_seconds": _seconds(),
    "shutdown_grace_seconds": _seconds(zero=True),
    # Sent to PostgreSQL as statement_timeout in whole milliseconds, a 32-bit integer there.
    # At least a second: under that an ordinary slow statement would count as the database gone.
    "database_outage_seconds": Bounds(1.0, 2_147_483.0, why=" (PostgreSQL's statement_timeout limit)"),
    "database_statement_timeout_seconds": Bounds(1.0, 3600.0),
    "retry_base_seconds": _seconds(),
    "retry_max_seconds": _seconds(),
    "retry_after_cap_seconds": _seconds(zero=True),
    "breaker_failure_threshold": Bounds(1, MAX_COUNT),
    "breaker_success_threshold": Bounds(1, MAX_COUNT),
    "breaker_open_seconds": _seconds(),
    "breaker_max_open_seconds": _seconds(),
    "breaker_failure_ratio": Bounds(0.0, 1.0, low_open=True),
    "breaker_window_seconds": _seconds(),
    "key_cache_window_seconds": _seconds(zero=True),
    "sink_timeout_seconds": _seconds(),
    "proof_max_attempts": Bounds(1, MAX_COUNT),
    "endpoint_metrics_top": Bounds(0, 1000),
    "operator_events_window_seconds": _seconds(),
    # At least the 30 days AdCP requires of webhook_activity[] history (docs/subscribers.md).
    "activity_retention_days": Bounds(MIN_ACTIVITY_RETENTION_DAYS, 36_500, why=" (AdCP webhook_activity retention)"),
}


@dataclass(frozen=True)
class Settings:
    """Every knob of the product, with the defaults a demanding operator expects."""

    database_url: str = "sqlite:///outbox.db"
    signing_key_file: str | None = None
    signing_key_id: str | None = None
    # tenant id -> (key file, key id): a tenant may sign with its own key (TOML only).
    tenant_signing_keys: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    retry_horizon_seconds: int = MIN_HORIZON
    metrics_addr: str | None = None
    allow_http: bool = False
    allowed_cidrs: tuple[Network, ...] = ()
    encryption_key: bytes | None = None  # AES-256-GCM key sealing bodies and credentials at rest
    encryption_old_keys: tuple[bytes, ...] = ()  # older keys that still open (key rotation)
    concurrency: int = 64  # requests in flight per daemon process
    endpoint_concurrency: int = 8  # requests in flight per endpoint origin
    claim_batch: int = 50
    connect_timeout_seconds: float = 10.0
    read_timeout_seconds: float = 10.0
    lease_seconds: float = 30.0
    poll_interval_seconds: float = 1.0
    shutdown_grace_seconds: float = 15.0
    database_outage_seconds: float = 60.0
    # PostgreSQL behind a pooler (docs/pooler.md): "transaction" when the URL goes through a
    # transaction-mode pooler such as PgBouncer; LISTEN then needs a direct URL of its own.
    database_pooler: str = "none"
    listen_database_url: str | None = None
    # Bounds each of the daemon's claim and completion statements, and a dead TCP peer.
    database_statement_timeout_seconds: float = 15.0
    retry_base_seconds: float = 2.0
    retry_max_seconds: float = 3600.0
    retry_after_cap_seconds: float = 3600.0
    # Circuit breakers (supervisor/cycle/breaker.py): open when, over the last window, at least
    # the threshold of attempts failed and they are at least the ratio of all attempts.
    breaker_failure_threshold: int = 10
    breaker_failure_ratio: float = 0.7
    breaker_window_seconds: float = 30.0
    breaker_success_threshold: int = 2
    breaker_open_seconds: float = 30.0
    breaker_max_open_seconds: float = 300.0
    sinks: tuple[str, ...] = ()
    sink_timeout_seconds: float = 5.0
    per_tenant_metrics: bool = False
    # Per-endpoint health series on /metrics for the N busiest endpoints (0: none); bounded
    # cardinality, since tenant and origin become labels (docs/observability.md).
    endpoint_metrics_top: int = 0
    # Operator events (docs/observability.md): delivered through the outbox to this URL (as
    # tenant "outboxd-operator", signed, retried, behind its own breaker), as plain JSON or
    # Slack incoming-webhook JSON, and handed to these callables (dotted paths).
    operator_events_url: str | None = None
    operator_events_format: str = "json"
    operator_event_sinks: tuple[str, ...] = ()
    operator_events_window_seconds: float = 300.0  # aggregation window of dead and expired messages
    # HTTPS trust (supervisor/wire/tls.py): a private CA file or directory, else certifi | system
    tls_ca_file: str | None = None
    tls_ca_dir: str | None = None
    tls_trust: str = "certifi"
    log_format: str = "auto"  # auto | json | console
    # How long a buyer may cache the seller's JWKS: the AdCP ceiling on a verifier's JWKS
    # cache TTL (30 min, https://adcontextprotocol.org/docs/building/by-layer/L1/security).
    # A staged key may start signing only after this long, and a retired key stays
    # published at least this long past its last signature.
    key_cache_window_seconds: float = 1800.0
    # The brand.json origin buyers expect as the revocation list's `issuer`; unset, the
    # signed revocation list is not served.
    revocation_issuer: str | None = None
    ui_addr: str = "127.0.0.1:8465"  # `outboxd ui`: loopback unless the operator says otherwise
    ui_token: str | None = None  # `outboxd ui`: the token for signing in; generated when unset
    # Account-level subscribers (docs/subscribers.md): the seller agent URL named in every
    # webhook.challenge, how many proof attempts a URL gets, and how long attempt history is
    # kept for webhook_activity[] (AdCP: at least 30 days after completed_at).
    seller_agent_url: str | None = None
    proof_max_attempts: int = 8
    activity_retention_days: int = MIN_ACTIVITY_RETENTION_DAYS
    # docs/reporting.md: ``package.module:factory`` returning the seller's
    # ``outbox.reporting.ReportingHandoff``; ``outboxd run`` then drives it.
    reporting_handoff: str | None = None

    def __post_init__(self) -> None:
        for name, bounds in NUMERIC_BOUNDS.items():
            bounds.check(name, getattr(self, name))
        if self.lease_seconds <= self.connect_timeout_seconds + self.read_timeout_seconds:
            raise ConfigurationError(
                f"OUTBOX_LEASE_SECONDS ({self.lease_seconds:g}) must exceed OUTBOX_CONNECT_TIMEOUT_SECONDS + "
                f"OUTBOX_READ_TIMEOUT_SECONDS ({self.connect_timeout_seconds + self.read_timeout_seconds:g}), "
                "or a slow request could outlive its lease and be sent twice at once"
            )
        for low, high in (("retry_base_seconds", "retry_max_seconds"),
                          ("breaker_open_seconds", "breaker_max_open_seconds")):
            if getattr(self, high) < getattr(self, low):
                raise ConfigurationError(f"{ENV_PREFIX}{high.upper()} must be at least {ENV_PREFIX}{low.upper()}")
        if self.retry_base_seconds >= self.retry_horizon_seconds:
            raise ConfigurationError(
                f"OUTBOX_RETRY_BASE_SECONDS ({self.retry_base_seconds:g}) must be below OUTBOX_RETRY_HORIZON_SECONDS "
                f"({self.retry_horizon_seconds}): the first retry would come after the horizon, so a message "
                "would get one attempt")
        if not _DATABASE_URL.match(self.database_url):  # the scheme only: the rest may hold a password
            scheme = _SCHEME.match(self.database_url)
            raise ConfigurationError("OUTBOX_DATABASE_URL must be a postgresql:// or sqlite:/// URL, got "
                                     + (f"one of scheme {scheme.group(1)[:20]!r}" if scheme else "no scheme://"))
        if self.encryption_old_keys and self.encryption_key is None:  # they would be ignored: sealed rows held
            raise ConfigurationError(
                "OUTBOX_ENCRYPTION_OLD_KEYS is set without OUTBOX_ENCRYPTION_KEY: old keys only open what they "
                "sealed, so set OUTBOX_ENCRYPTION_KEY to the key that seals (the newest; `outboxd encryption "
                "generate` makes one) and keep the others in OUTBOX_ENCRYPTION_OLD_KEYS (docs/encryption.md)")
        if self.database_pooler not in POOLER_MODES:
            raise ConfigurationError(
                f"OUTBOX_DATABASE_POOLER must be none or transaction, got {self.database_pooler!r} (behind "
                "PgBouncer in any pool mode, transaction; behind a session pooler that passes libpq's options "
                "through, none)")
        if self.listen_database_url is not None and not _POSTGRESQL_URL.match(self.listen_database_url):
            raise ConfigurationError("OUTBOX_LISTEN_DATABASE_URL must be a postgresql:// URL (a direct connection "
                                     "for LISTEN)")
        if self.seller_agent_url is not None and not is_agent_url(self.seller_agent_url):  # checked now, not at
            raise ConfigurationError(  # the first subscriber's registration
                "OUTBOX_SELLER_AGENT_URL must be the seller agent's absolute http(s) URL, without credentials in it: "
                "every webhook.challenge sends it to buyers")
        if self.tls_trust not in ("certifi", "system"):
            raise ConfigurationError(f"OUTBOX_TLS_TRUST must be certifi or system, got {self.tls_trust!r}")
        if self.operator_events_format not in ("json", "slack"):
            raise ConfigurationError("OUTBOX_OPERATOR_EVENTS_FORMAT must be json or slack")
        if self.operator_events_url is not None:  # checked now, not at the first event
            from outbox.errors import OutboxValidationError
            from outbox.urls import validate_destination

            try:
                validate_destination(self.operator_events_url, allow_http=self.allow_http,
                                     allowed_cidrs=self.allowed_cidrs)
            except OutboxValidationError as exc:
                raise ConfigurationError(f"OUTBOX_OPERATOR_EVENTS_URL {exc.problem}") from None
        if self.log_format not in ("auto", "json", "console"):
            raise ConfigurationError("OUTBOX_LOG_FORMAT must be auto, json or console")
        if self.metrics_addr:  # unset or empty: no metrics endpoint
            parse_addr(self.metrics_addr, "OUTBOX_METRICS_ADDR")
        parse_addr(self.ui_addr, "OUTBOX_UI_ADDR", lowest_port=1)
        if self.revocation_issuer is not None and not is_origin(self.revocation_issuer):
            raise ConfigurationError(
                f"OUTBOX_REVOCATION_ISSUER must be an origin like https://seller.example.com, "
                f"got {self.revocation_issuer!r}"
            )

    def sealing(self) -> SealingKeys | None:
        """The keys that seal bodies and credentials at rest (``None``: stored in plaintext)."""
        return sealing_keys(self.encryption_key, self.encryption_old_keys)

    def is_allowed_private(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        """Whether ``address`` sits in a network the operator exempted from the SSRF block."""
        return any(address.version == net.version and address in net for net in self.allowed_cidrs)


_DATABASE_URL = re.compile(r"(?:postgresql|sqlite)(?:\+\w+)?://", re.IGNORECASE)
_POSTGRESQL_URL = re.compile(r"postgresql(?:\+\w+)?://", re.IGNORECASE)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build :class:`Settings` from a TOML file, then ``OUTBOX_*`` variables, then overrides.

    The environment wins over the file so a container can override one knob without
    rewriting the file; explicit keyword overrides (used by the CLI) win over both.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    known = {f.name: str(f.type) for f in fields(Settings)}
    if config_file is None and env.get(ENV_PREFIX + "CONFIG"):
        config_file = env[ENV_PREFIX + "CONFIG"]
    if config_file is not None:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"config file {path} is not valid TOML: {exc}") from None
        for key, raw in _file_settings(path, data).items():
            if key not in known:
                raise ConfigurationError(f"config file {path}: unknown setting {key!r}{did_you_mean(key, known)}")
            values[key] = coerce(key, known[key], raw)
    for name, annotation in known.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and name != "tenant_signing_keys":
            values[name] = coerce(name, annotation, raw)
    for message in unknown_variables(env):
        warnings.warn(message, ConfigurationWarning, stacklevel=2)
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = Settings(**values)
    if settings.key_cache_window_seconds < JWKS_CACHE_CEILING:
        warnings.warn(f"OUTBOX_KEY_CACHE_WINDOW_SECONDS={settings.key_cache_window_seconds:g} is below the "
                      f"{JWKS_CACHE_CEILING} s AdCP lets buyers cache a JWKS: a promoted key may sign before "
                      "buyers fetch it, and a retired one be unpublished while they still use it (their "
                      "verifiers then reject the webhooks)", ConfigurationWarning, stacklevel=2)
    if settings.endpoint_concurrency > settings.concurrency:
        warnings.warn(f"OUTBOX_ENDPOINT_CONCURRENCY={settings.endpoint_concurrency} is above "
                      f"OUTBOX_CONCURRENCY={settings.concurrency}: a process never has more than "
                      f"{settings.concurrency} requests in flight, to one origin or to all", ConfigurationWarning,
                      stacklevel=2)
    return settings


class ConfigurationWarning(UserWarning):
    """A setting that is probably a mistake but not worth refusing to start over."""


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """One warning per ``OUTBOX_*`` variable that is no setting, with the likely intended name.

    Warned, not refused (unlike a TOML typo): the environment is shared with the seller's
    own programs and assembled from many sources, so an ``OUTBOX_`` name outboxd does not
    own must not stop a daemon from starting; a file given to outboxd is outboxd's alone.
    """
    valid = {ENV_PREFIX + f.name.upper() for f in fields(Settings) if f.name != "tenant_signing_keys"}
    valid |= OTHER_VARIABLES
    return [f"{name} is not an outboxd setting and is ignored{did_you_mean(name, valid)}"
            for name in sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in valid)]


def did_you_mean(name: str, valid: Any) -> str:
    """``"; did you mean X?"`` for the closest of ``valid`` to a misspelt ``name``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _file_settings(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The settings of a TOML file: its top-level keys and those of its ``[outbox]`` table
    (``[outbox.tenant_signing_keys]`` makes one), each given once."""
    table = data.get("outbox", {})
    if not isinstance(table, dict):
        raise ConfigurationError(f"config file {path}: outbox must be a table ([outbox]), not a value")
    top = {k: v for k, v in data.items() if k != "outbox"}
    twice = sorted(set(top) & set(table))
    if twice:
        raise ConfigurationError(f"config file {path}: {twice[0]!r} is set twice, at the top and in [outbox]")
    return {**top, **table}


# libpq parameters a database URL's query may carry that are secrets.
_QUERY_SECRETS = frozenset({"password", "sslpassword"})


def effective(settings: Settings) -> dict[str, Any]:
    """Every setting as ``outboxd config`` prints it: secrets masked, values in their TOML form."""
    from sqlalchemy.engine import make_url

    shown: dict[str, Any] = {}
    for name, value in asdict(settings).items():
        if name in SECRET_SETTINGS:
            value = MASK if value else None
        elif name in ("database_url", "listen_database_url") and value:
            url = make_url(value)
            url = url.update_query_dict({k: MASK for k in url.query if k.lower() in _QUERY_SECRETS}, append=False)
            value = url.render_as_string(hide_password=True)
        elif name == "operator_events_url" and value:  # a chat webhook's path is its secret
            value = f"{origin(value)}/{MASK}"
        elif name == "allowed_cidrs":
            value = [str(n) for n in value]
        elif name == "tenant_signing_keys":
            value = {t: {"file": f, "key_id": k} for t, (f, k) in value.items()}
        elif isinstance(value, tuple):
            value = list(value)
        shown[name] = value
    return shown


def with_overrides(settings: Settings, **changes: Any) -> Settings:
    """A copy of ``settings`` with some fields changed (validated again)."""
    return replace(settings, **changes)
