"""The outbox tables, as SQLAlchemy Core metadata, and the database clock.

Times are stored as Unix epoch seconds (``DOUBLE PRECISION`` / ``REAL``) and always taken
from the database (:class:`db_now`), never from a daemon's clock: several daemons with
skewed clocks then agree on leases, due times and horizons (docs/architecture.md, "Time
comes from the database"), and the same arithmetic works on PostgreSQL and SQLite.

The Alembic migrations in ``outbox/migrations`` create these tables; this module is the
runtime view used by the producer API, the store and the CLI.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    false,
    text,
    true,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

STATES = ("pending", "in_flight", "delivered", "dead")
DEAD_REASONS = ("expired", "conflict", "signature_rejected", "gone", "rejected", "invalid", "blocked", "proof_failed",
                "cancelled")
AUTH_MODES = ("rfc9421", "hmac", "bearer")
TRIGGERS = ("scheduled", "replay")
BREAKER_STATES = ("closed", "open", "half_open")
SUBSCRIBER_STATES = ("pending_proof", "active", "paused", "proof_failed")

PG_NOW = "extract(epoch from now())::float8"
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


class db_now(FunctionElement[float]):
    """The database's current time in epoch seconds (transaction start on PostgreSQL)."""

    type = Float(53)
    inherit_cache = True


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: object, **kw: object) -> str:
    return PG_NOW


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: object, **kw: object) -> str:
    return SQLITE_NOW


def _enum_check(column: str, values: tuple[str, ...], name: str, nullable: bool = False) -> CheckConstraint:
    listed = ", ".join(f"'{v}'" for v in values)
    expr = f"{column} IN ({listed})"
    return CheckConstraint(f"{column} IS NULL OR {expr}" if nullable else expr, name=name)


metadata = MetaData()
_Id = BigInteger().with_variant(Integer(), "sqlite")  # SQLite rowid aliasing needs INTEGER
_Epoch = Float(53)

messages = Table(
    "outbox_messages",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("tenant_id", Text, nullable=False),
    Column("url", Text, nullable=False),
    # scheme://authority (outbox.urls.origin: no userinfo); the circuit-breaker and
    # connection-pool key. On PostgreSQL a trigger computes it when an insert leaves it NULL; the daemon
    # recomputes it for every claimed row and writes back any difference (outbox.store.claim).
    Column("origin", Text),
    Column("idempotency_key", Text, nullable=False),
    # The exact bytes to POST, or those bytes sealed (AES-256-GCM, outbox/sealing.py) under
    # the key named by body_key_id; NULL body_key_id means stored in plaintext.
    Column("body", LargeBinary, nullable=False),
    Column("body_sha256", LargeBinary),  # SHA-256 of the stored bytes (sealed or not)
    Column("body_key_id", Text),
    # What the idempotency key is bound to (outbox/identity.py: binding_digest). NULL from
    # plain-SQL producers and older releases: then it is computed from the stored row.
    Column("binding_digest", LargeBinary),
    Column("auth_mode", Text, nullable=False, server_default="rfc9421"),
    Column("auth_secret", LargeBinary),  # sealed legacy credential (outbox/sealing.py)
    Column("task_id", Text),
    Column("task_type", Text),
    Column("task_status", Text),
    Column("notification_type", Text),
    Column("operation_id", Text),
    Column("sequence_key", Text),
    Column("sequence_number", BigInteger),
    Column("state", Text, nullable=False, server_default="pending"),
    Column("dead_reason", Text),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("horizon_seconds", Integer),
    Column("trigger", Text, nullable=False, server_default="scheduled"),
    Column("created_at", _Epoch, nullable=False, server_default=db_now()),
    Column("next_attempt_at", _Epoch, nullable=False, server_default=db_now()),
    Column("first_attempt_at", _Epoch),
    Column("retry_until", _Epoch),
    Column("lease_token", Text),
    Column("lease_expires_at", _Epoch),
    Column("leased_by", Text),
    Column("last_status", Integer),
    Column("last_error", Text),
    Column("finished_at", _Epoch),
    # Who the fire belongs to (webhook_activity scoping and filters; docs/subscribers.md).
    Column("principal_id", Text),
    Column("account_id", Text),
    Column("subscriber_id", Text),
    Column("notification_id", Text),
    Column("media_buy_id", Text),
    Column("subscriber_ref", BigInteger),  # outbox_subscribers.id of an account-level fire or challenge
    # A fire waiting for its subscriber's URL proof: also due only in the far future, so no
    # claim (of this release or an older one) ever takes it before it is released.
    Column("held", Boolean, nullable=False, server_default=false()),
    # The enqueuing caller's W3C trace context: attempts' spans are its children (outbox/tracecontext.py).
    Column("traceparent", Text),
    _enum_check("state", STATES, "outbox_messages_state_check"),
    _enum_check("dead_reason", DEAD_REASONS, "outbox_messages_dead_reason_check", nullable=True),
    _enum_check("auth_mode", AUTH_MODES, "outbox_messages_auth_mode_check"),
    _enum_check("trigger", TRIGGERS, "outbox_messages_trigger_check"),
    CheckConstraint("(state = 'dead') = (dead_reason IS NOT NULL)", name="outbox_messages_dead_has_reason"),
    CheckConstraint(
        "horizon_seconds IS NULL OR horizon_seconds BETWEEN 86400 AND 604800",
        name="outbox_messages_horizon_check",
    ),
    # Identity is per tenant: another tenant's identical key string is another message.
    Index("outbox_messages_key_tenant_key", "idempotency_key", "tenant_id", unique=True),
    # The claim path: only what is due is indexed, so millions of delivered rows cost
    # nothing (docs/architecture.md, "The message state machine").
    Index(
        "outbox_messages_due_idx",
        "next_attempt_at",
        "id",
        postgresql_where=text("state = 'pending'"),
        sqlite_where=text("state = 'pending'"),
    ),
    Index(
        "outbox_messages_lease_idx",
        "lease_expires_at",
        postgresql_where=text("state = 'in_flight'"),
        sqlite_where=text("state = 'in_flight'"),
    ),
    Index("outbox_messages_finished_idx", "finished_at", postgresql_where=text("finished_at IS NOT NULL"),
          sqlite_where=text("finished_at IS NOT NULL")),
    Index("outbox_messages_tenant_idx", "tenant_id", "created_at"),
    # The claim walks each endpoint's due head (tenant, origin, due order), and the expiry
    # sweep finds pending rows by enqueue time: neither reads finished history.
    Index("outbox_messages_endpoint_due_idx", "tenant_id", text("COALESCE(origin, '')"), "next_attempt_at", "id",
          postgresql_where=text("state = 'pending'"), sqlite_where=text("state = 'pending'")),
    Index("outbox_messages_pending_created_idx", "created_at", postgresql_where=text("state = 'pending'"),
          sqlite_where=text("state = 'pending'")),
    Index("outbox_messages_held_idx", "subscriber_ref", postgresql_where=text("held"), sqlite_where=text("held")),
    Index("outbox_messages_activity_idx", "tenant_id", "principal_id", "created_at",
          postgresql_where=text("notification_type IS NOT NULL"), sqlite_where=text("notification_type IS NOT NULL")),
    # The re-sealer finds rows not under the active key by range scans, not a table scan.
    Index("outbox_messages_body_key_idx", "body_key_id", "id"),
)

attempts = Table(
    "outbox_attempts",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("message_id", BigInteger, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("url", Text, nullable=False),  # without query or fragment (docs/protocol.md "Attempt records")
    Column("attempt_number", Integer, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("http_status", Integer),
    Column("error", Text),
    Column("response_time_ms", Integer),
    Column("will_retry", Boolean, nullable=False),
    Column("next_retry_at", _Epoch),
    Column("payload_size", Integer),
    Column("sequence_number", BigInteger),
    Column("idempotency_key", Text, nullable=False),
    Column("notification_type", Text),
    Column("trigger", Text, nullable=False),
    Column("daemon_id", Text),
    Column("occurred_at", _Epoch, nullable=False, server_default=db_now()),
    Column("trace_id", Text),  # the attempt's span (OpenTelemetry), when tracing is on
    Column("span_id", Text),
    # The start of a failed answer's body: one line, masked, <= 200 characters (outbox/masking.py).
    Column("response_excerpt", Text),
    Index("outbox_attempts_message_idx", "message_id", "attempt_number"),
    Index("outbox_attempts_occurred_idx", "occurred_at"),
)

sequences = Table(
    "outbox_sequences",
    metadata,
    Column("stream_key", Text, primary_key=True),
    Column("last_value", BigInteger, nullable=False),
)

breakers = Table(
    "outbox_breakers",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("origin", Text, nullable=False),
    Column("state", Text, nullable=False, server_default="closed"),
    Column("failures", Integer, nullable=False, server_default="0"),
    Column("successes", Integer, nullable=False, server_default="0"),
    Column("trips", Integer, nullable=False, server_default="0"),
    Column("open_until", _Epoch),
    Column("probe_until", _Epoch),
    Column("updated_at", _Epoch, nullable=False, server_default=db_now()),
    # The failure-rate window (supervisor/cycle/breaker.py): current bucket and the previous one.
    Column("window_started_at", _Epoch),
    Column("window_attempts", Integer, nullable=False, server_default="0"),
    Column("window_failures", Integer, nullable=False, server_default="0"),
    Column("previous_attempts", Integer, nullable=False, server_default="0"),
    Column("previous_failures", Integer, nullable=False, server_default="0"),
    PrimaryKeyConstraint("tenant_id", "origin", name="outbox_breakers_pkey"),
    _enum_check("state", BREAKER_STATES, "outbox_breakers_state_check"),
)

# Account-level notification channels (``notification_configs[]`` on ``sync_accounts``).
subscribers = Table(
    "outbox_subscribers",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("tenant_id", Text, nullable=False),
    Column("account_id", Text, nullable=False),
    Column("subscriber_id", Text, nullable=False),
    Column("principal_id", Text),
    Column("url", Text, nullable=False),
    Column("event_types", Text, nullable=False),  # JSON array, sorted
    Column("auth_mode", Text, nullable=False, server_default="rfc9421"),
    Column("auth_secret", LargeBinary),  # sealed legacy credentials (write-only)
    Column("active", Boolean, nullable=False, server_default=true()),
    Column("state", Text, nullable=False),
    Column("config_sha256", Text, nullable=False),  # URL, events and auth as registered
    Column("proven_sha256", Text),  # the configuration whose URL proof succeeded last
    Column("challenge_message_id", BigInteger),  # the proof in progress (or last made)
    Column("created_at", _Epoch, nullable=False, server_default=db_now()),
    Column("updated_at", _Epoch, nullable=False, server_default=db_now()),
    Column("proven_at", _Epoch),
    _enum_check("state", SUBSCRIBER_STATES, "outbox_subscribers_state_check"),
    _enum_check("auth_mode", AUTH_MODES, "outbox_subscribers_auth_mode_check"),
    Index("outbox_subscribers_key", "tenant_id", "account_id", "subscriber_id", unique=True),
    Index("outbox_subscribers_challenge_idx", "challenge_message_id"),
)

ADCP_USES = ("request-signing", "webhook-signing")

# The keyring (supervisor/keys/keyring.py): a key's state is derived from its times, so every
# replica reading the same rows agrees on which key signs at any instant.
signing_keys = Table(
    "outbox_signing_keys",
    metadata,
    Column("kid", Text, primary_key=True),
    Column("scope", Text, nullable=False),  # "" is the default scope, else a tenant id
    Column("alg", Text, nullable=False),
    Column("key_file", Text, nullable=False),  # where the private key lives: never its content
    Column("public_jwk", Text, nullable=False),  # JSON, without adcp_use
    Column("adcp_use", Text, nullable=False, server_default="request-signing"),
    Column("published_at", _Epoch, nullable=False),
    Column("activates_at", _Epoch),
    Column("deactivates_at", _Epoch),
    Column("unpublish_at", _Epoch),
    Column("revoked_at", _Epoch),
    _enum_check("adcp_use", ADCP_USES, "outbox_signing_keys_adcp_use_check"),
    Index("outbox_signing_keys_scope_idx", "scope"),
)

# One row (id 1): bumped by every keyring change, so daemons poll one integer.
keyring = Table(
    "outbox_keyring",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("version", BigInteger, nullable=False),
)

# Body-encryption keys, by public id (outbox/keyset.py): when each was announced and from
# when it seals. No key material: the keys stay in each process's configuration.
encryption_keys = Table(
    "outbox_encryption_keys",
    metadata,
    Column("key_id", Text, primary_key=True),
    Column("announced_at", _Epoch, nullable=False),
    Column("seals_from", _Epoch),  # NULL: announced, not sealing yet
)

# What each live process (daemon or producer) can open, and what it seals under: a new key
# seals only once every live process reports it can open it.
encryption_readers = Table(
    "outbox_encryption_readers",
    metadata,
    Column("reader_id", Text, primary_key=True),
    Column("role", Text, nullable=False),  # daemon | producer
    Column("key_ids", Text, nullable=False),  # the key ids it can open, comma-separated
    Column("sealing_key_id", Text),  # the key it seals under now (NULL: none configured)
    Column("unopenable", Integer, nullable=False, server_default="0"),  # rows it found it cannot open
    Column("seen_at", _Epoch, nullable=False),
)

# Every breaker transition, once (the row behind the log line and the metric).
breaker_transitions = Table(
    "outbox_breaker_transitions",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("tenant_id", Text, nullable=False),
    Column("origin", Text, nullable=False),
    Column("from_state", Text, nullable=False),
    Column("to_state", Text, nullable=False),
    Column("window_attempts", Float(53)),
    Column("window_failures", Float(53)),
    Column("open_until", _Epoch),
    Column("daemon_id", Text),
    Column("occurred_at", _Epoch, nullable=False, server_default=db_now()),
    Index("outbox_breaker_transitions_key_idx", "tenant_id", "origin", "occurred_at"),
)

# Upper bounds (ms) of the latency histogram of outbox_endpoint_stats: column le_i counts
# attempts that took at most LATENCY_BOUNDS_MS[i]; the last column counts the slower ones.
LATENCY_BOUNDS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)

# Endpoint health (supervisor/observe/health_stats.py): per minute, endpoint and daemon, what the
# completer recorded. A window's health is the sum of its rows, whatever the attempt history.
endpoint_stats = Table(
    "outbox_endpoint_stats",
    metadata,
    Column("minute", BigInteger, nullable=False),  # floor(epoch seconds / 60), the database's clock
    Column("tenant_id", Text, nullable=False),
    Column("origin", Text, nullable=False),
    Column("daemon_id", Text, nullable=False),  # each daemon adds to its own row: no hot row across replicas
    Column("attempts", Integer, nullable=False, server_default="0"),  # requests made
    Column("successes", Integer, nullable=False, server_default="0"),  # 2xx answers
    Column("deaths", Integer, nullable=False, server_default="0"),  # messages that ended dead
    Column("latency_ms_sum", BigInteger, nullable=False, server_default="0"),
    *(Column(f"le_{i}", Integer, nullable=False, server_default="0") for i in range(len(LATENCY_BOUNDS_MS) + 1)),
    # Attempts answered non-2xx, timed out or refused (not the daemon's own abandoned ones), and
    # the slowest answer: what the console's charts draw (migration 0016; 0 from older daemons).
    Column("failures", Integer, nullable=False, server_default="0"),
    Column("latency_ms_max", Integer, nullable=False, server_default="0"),
    PrimaryKeyConstraint("minute", "tenant_id", "origin", "daemon_id", name="outbox_endpoint_stats_pkey"),
    # A tenant's or an endpoint's minutes (its console charts), without reading every endpoint's.
    Index("outbox_endpoint_stats_endpoint_idx", "tenant_id", "origin", "minute"),
)

# Operator events (supervisor/observe/events.py): one row per state change, its unique key chosen so
# replicas noticing the same change insert one row; aggregated kinds count up until due_at.
operator_events = Table(
    "outbox_operator_events",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("kind", Text, nullable=False),
    Column("dedup_key", Text, nullable=False),
    Column("tenant_id", Text),
    Column("origin", Text),
    Column("detail", Text, nullable=False, server_default="{}"),  # JSON object
    Column("count", Integer, nullable=False, server_default="1"),
    Column("first_at", _Epoch, nullable=False),
    Column("last_at", _Epoch, nullable=False),
    Column("due_at", _Epoch, nullable=False),  # published from then on (the end of an aggregation window)
    Column("published_at", _Epoch),
    Column("message_id", BigInteger),  # its delivery to the operator URL
    Index("outbox_operator_events_dedup_key", "dedup_key", unique=True),
    Index("outbox_operator_events_due_idx", "due_at", postgresql_where=text("published_at IS NULL"),
          sqlite_where=text("published_at IS NULL")),
)

JOB_STATES = ("running", "paused", "cancelled", "done")

# Recovery jobs (supervisor/operator/jobs.py): a replay the daemons run in the background, in chunks,
# each committed with the job's progress; a crash resumes from the last chunk.
jobs = Table(
    "outbox_jobs",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("kind", Text, nullable=False),  # replay
    Column("state", Text, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("origin", Text),
    Column("reason", Text),  # dead reason; NULL: any
    Column("since", _Epoch, nullable=False),  # messages ended dead from then ...
    Column("until", _Epoch, nullable=False),  # ... until the job was made
    Column("force", Boolean, nullable=False),
    Column("rate", Float(53), nullable=False),  # messages per second at most
    Column("total", Integer, nullable=False),  # the dry-run count when the job was made
    Column("done", Integer, nullable=False, server_default="0"),
    Column("skipped", Integer, nullable=False, server_default="0"),  # matched but not replayable (horizon, proof)
    Column("cursor", BigInteger, nullable=False, server_default="0"),  # every message id up to it is handled
    Column("leased_by", Text),
    Column("lease_until", _Epoch),
    Column("created_at", _Epoch, nullable=False),
    Column("updated_at", _Epoch, nullable=False),
    _enum_check("state", JOB_STATES, "outbox_jobs_state_check"),
)

# What each job replayed: the primary key makes "at most once per job" the database's rule.
job_items = Table(
    "outbox_job_items",
    metadata,
    Column("job_id", BigInteger, nullable=False),
    Column("message_id", BigInteger, nullable=False),
    PrimaryKeyConstraint("job_id", "message_id", name="outbox_job_items_pkey"),
)

# One row per migration (from 0006 on): the oldest code revision that can still run on a
# database at that revision. Lets a daemon one release behind keep delivering during a
# rolling upgrade (outbox.migrate.check_schema; docs/architecture.md, "Rolling upgrades").
schema_compat = Table(
    "outbox_schema_compat",
    metadata,
    Column("revision", Text, primary_key=True),
    Column("min_reader_revision", Text, nullable=False),
)
