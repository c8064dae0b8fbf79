"""The claim: the one statement that leases due messages, for PostgreSQL and SQLite.

Kept apart from the other statements (outbox/store.py) because it is the longest and the
one every delivery pays for; docs/architecture.md ("Claiming ahead") and docs/performance.md
("Many backlogged endpoints") say why it reads what it reads.
"""

from __future__ import annotations

# When a message's retry horizon ends: counted from enqueue (a forced replay stamps its own).
DEADLINE = "COALESCE(retry_until, created_at + COALESCE(horizon_seconds, :horizon))"
# Every horizon is at least this long (AdCP delivery_retry_horizon_seconds minimum).
MIN_HORIZON_SECONDS = 86_400
# PostgreSQL's tables of due work (migration 0014): new arrivals, and each endpoint's and
# origin's next due time, kept by triggers and the claim's fold rather than by the ORM.
DUE_TABLES = ("outbox_due_arrivals", "outbox_due_endpoints", "outbox_due_origins")
# Arrivals one claim folds at most: 0.16 s of folding on average, 0.24 s at most, on a
# 2-vCPU box (a pile of 5,000,000), where 10,000,000 in one statement took 14.8 s
# (docs/architecture.md, "Claiming ahead").
FOLD_LIMIT = 50_000
# Arrivals left after a claim that make a pile: an idle claimer claims again at once.
PILE = 1_000
# Before each claim: fold what became due since (the arrivals the triggers of migration 0014
# append) into the endpoints and origins the claim walks. Every arrival rewrites its rows,
# even with an unchanged due time, so a claim that read them before cannot write back a due
# time computed without the new work. At most FOLD_LIMIT arrivals a claim: arrivals left by
# hours without a daemon (or by daemons of the release before these tables) are folded over
# the next claims, where one statement folding them all could outlast the server's
# statement timeout, and be cancelled, every time.
GATHER_DUE = f"""
    WITH arrived AS (
        DELETE FROM outbox_due_arrivals
        WHERE ctid = ANY(ARRAY(SELECT ctid FROM outbox_due_arrivals LIMIT {FOLD_LIMIT}))
        RETURNING tenant_id, origin, due
    ),
    endpoints AS (
        INSERT INTO outbox_due_endpoints AS d (origin, tenant_id, due)
        SELECT origin, tenant_id, min(due) FROM arrived GROUP BY origin, tenant_id ORDER BY origin, tenant_id
        ON CONFLICT (origin, tenant_id) DO UPDATE SET due = LEAST(d.due, excluded.due)
    )
    INSERT INTO outbox_due_origins AS d (origin, due)
    SELECT origin, min(due) FROM arrived GROUP BY origin ORDER BY origin
    ON CONFLICT (origin) DO UPDATE SET due = LEAST(d.due, excluded.due)
"""


def _write_back(name: str, source: str, same_key: str, keys: str) -> str:
    """The claim's write-back to ``outbox_due_{name}``: each row ``source`` read gets its new
    due time, or goes when it has none. A row another claim holds is skipped, and so is one
    rewritten since it was read (by ``gather_due``: new work arrived), whose version, and so
    its ctid, is no longer the one read: left early, it is looked at again next time, never
    late. Skipping, never waiting, a claim cannot deadlock with another or with
    ``gather_due``. What is written returns its ``keys`` and due time (:func:`_retired`)."""
    return f"""{name}_taken AS (
                SELECT ctid AS row FROM outbox_due_{name}
                WHERE ctid = ANY(ARRAY(SELECT row FROM {source})) FOR UPDATE SKIP LOCKED
            ),
            {name}_moved AS (
                UPDATE outbox_due_{name} AS d SET due = a.due FROM {source} AS a
                WHERE d.ctid = ANY(ARRAY(SELECT row FROM {name}_taken)) AND d.ctid = a.row
                  AND {same_key} AND a.due <> d.due
                RETURNING {keys}, d.due
            ),
            {name}_done AS (
                DELETE FROM outbox_due_{name} AS d USING {source} AS a
                WHERE d.ctid = ANY(ARRAY(SELECT row FROM {name}_taken)) AND d.ctid = a.row
                  AND {same_key} AND a.due IS NULL
                RETURNING {keys}, d.due
            )"""


def _retired(name: str, keys: str, picked_there: str, now: str) -> str:
    """How many of ``outbox_due_{name}``'s rows this claim took out of what is due now
    (dropped with nothing pending, or moved past now) without leasing anything there: a
    cancel job or the horizon sweep ended their work, or a breaker blocks them. Each such
    row is out until new work or its due time comes, so a claimer told of any claims again
    at once rather than a poll later, and cannot spin (``outbox.store.claim``)."""
    return f"""(SELECT count(*) FROM (
                    SELECT {keys} FROM {name}_moved WHERE due > {now}
                    UNION ALL SELECT {keys} FROM {name}_done) AS r
                WHERE NOT EXISTS (SELECT 1 FROM heads AS h JOIN picked AS p ON p.picked_id = h.id
                                  WHERE {picked_there}))"""


def claim_sql(pg: bool, now: str) -> str:
    """The claim: one statement that leases only what may be sent now.

    Per endpoint (tenant, origin) it takes the oldest due messages, none while its breaker
    is open or its half-open probe is out, one (the probe) once the open period is over.
    Per origin it then deals slots round-robin across that origin's tenants, up to the
    caller's per-origin lease budget (``:cap``; the claimer passes two rounds of
    ``OUTBOX_ENDPOINT_CONCURRENCY``, see ``supervisor/cycle/dispatch.py``) minus what this daemon
    already holds there (``:held``: its open requests, the retryable failures its breaker has
    not judged yet and the messages waiting their turn, as the daemon counts them), and across
    origins it takes everyone's first slot before anyone's second: fair, and nothing is
    claimed that would have to be handed back.

    PostgreSQL reads the origins with due work longest-waiting first (``outbox_due_origins``,
    at most ``:limit`` of them, passing over those where this daemon is at its budget), and
    of each as many of its endpoints due longest as it has free slots
    (``outbox_due_endpoints``); due heads come through LATERAL scans of
    ``outbox_messages_endpoint_due_idx``. An origin with at least as many open, due
    endpoints as free slots fills them in the first round, one row each; otherwise each is
    read as deep as the origin's free slots. The statement then writes back the due time of
    everything it visited. The cost is what is claimed (at most ``:limit`` origins and their
    free slots), never how many endpoints have a backlog, the history or a long backlog (the
    CTEs are MATERIALIZED: inlined, the planner may re-run the per-endpoint scans once per
    candidate row). The two tables are kept by triggers and :attr:`_Statements.gather_due`
    (migration 0014, docs/architecture.md "Claiming ahead"). SQLite (a single host's
    outbox) ranks the due rows with a window function.
    """
    room = f"""CASE WHEN b.state = 'open' AND b.open_until > {now} THEN 0
                    WHEN b.state = 'half_open' AND b.probe_until > {now} THEN 0
                    WHEN b.state IN ('open', 'half_open') THEN 1 ELSE :cap END"""
    # What the daemon holds per origin, as it counts it (``:held``, a JSON object): reading
    # it from this daemon's in-flight rows cost a scan of the lease index's dead entries,
    # one per message delivered since the last vacuum (docs/performance.md).
    each = "jsonb_each_text(CAST(:held AS jsonb))" if pg else "json_each(:held)"
    held = f"""
        held AS {"MATERIALIZED " if pg else ""}(
            SELECT key AS o, CAST(value AS {"integer" if pg else "INTEGER"}) AS n FROM {each}
        ),"""
    if pg:
        heads = f"""{held}
            origins AS MATERIALIZED (
                SELECT d.origin AS o, d.ctid AS row, :cap - COALESCE(h.n, 0) AS free
                FROM outbox_due_origins AS d LEFT JOIN held AS h ON h.o = d.origin
                WHERE d.due <= {now} AND COALESCE(h.n, 0) < :cap
                ORDER BY d.due LIMIT :limit
            ),
            visited AS MATERIALIZED (
                SELECT e.t, g.o, e.due, e.row, g.free, {room} AS room,
                       CASE b.state WHEN 'open' THEN b.open_until WHEN 'half_open' THEN b.probe_until END AS shut_until
                FROM origins AS g CROSS JOIN LATERAL (
                    SELECT d.tenant_id AS t, d.due, d.ctid AS row FROM outbox_due_endpoints AS d
                    WHERE d.origin = g.o AND d.due <= {now} ORDER BY d.due LIMIT g.free) AS e
                LEFT JOIN outbox_breakers AS b ON b.tenant_id = e.t AND b.origin = g.o
            ),
            gates AS MATERIALIZED (
                SELECT t, o, LEAST(room, CASE WHEN count(*) OVER (PARTITION BY o) >= free THEN 1 ELSE free END) AS depth
                FROM visited WHERE room > 0
            ),
            fetched AS MATERIALIZED (  -- one row past the depth: the endpoint's next due time after the claim
                SELECT h.id, h.next_attempt_at, g.t, g.o, h.nth, h.nth <= g.depth AND h.next_attempt_at <= {now} AS head
                FROM gates AS g CROSS JOIN LATERAL (
                    SELECT m.id, m.next_attempt_at, row_number() OVER (ORDER BY m.next_attempt_at, m.id) AS nth
                    FROM outbox_messages AS m
                    WHERE m.state = 'pending' AND m.tenant_id = g.t AND COALESCE(m.origin, '') = g.o
                    ORDER BY m.next_attempt_at, m.id LIMIT g.depth + 1) AS h
            ),
            heads AS (SELECT id, next_attempt_at, t, o, nth FROM fetched WHERE head),"""
        # What was visited is written back (_write_back): each endpoint's next due time once
        # this claim's rows are gone (its breaker's end while that blocks it), each origin's
        # the earliest of its endpoints'.
        repair = f""",
            ahead AS MATERIALIZED (
                SELECT v.t, v.o, v.row, CASE WHEN v.room > 0 THEN n.due ELSE v.shut_until END AS due
                FROM visited AS v LEFT JOIN (
                    SELECT t, o, min(next_attempt_at) AS due FROM fetched
                    WHERE id NOT IN (SELECT picked_id FROM picked) GROUP BY t, o) AS n ON n.t = v.t AND n.o = v.o
            ),
            origins_ahead AS MATERIALIZED (
                SELECT g.o, g.row, LEAST(
                    (SELECT min(a.due) FROM ahead AS a WHERE a.o = g.o),
                    (SELECT d.due FROM outbox_due_endpoints AS d
                     WHERE d.origin = g.o AND d.tenant_id NOT IN (SELECT v.t FROM visited AS v WHERE v.o = g.o)
                     ORDER BY d.due LIMIT 1)) AS due
                FROM origins AS g
            ),
            {_write_back("endpoints", "ahead", "d.origin = a.o AND d.tenant_id = a.t", "d.origin, d.tenant_id")},
            {_write_back("origins", "origins_ahead", "d.origin = a.o", "d.origin")}"""
        lock = "FOR UPDATE OF m SKIP LOCKED"
    else:
        heads = f"""
            heads AS (
                SELECT id, next_attempt_at, t, o, nth FROM (
                    SELECT m.id, m.next_attempt_at, m.tenant_id AS t, COALESCE(m.origin, '') AS o, {room} AS room,
                           row_number() OVER (PARTITION BY m.tenant_id, COALESCE(m.origin, '')
                                              ORDER BY m.next_attempt_at, m.id) AS nth
                    FROM outbox_messages AS m
                    LEFT JOIN outbox_breakers AS b ON b.tenant_id = m.tenant_id AND b.origin = m.origin
                    WHERE m.state = 'pending' AND m.next_attempt_at <= {now}) AS ranked_rows
                WHERE nth <= room
            ),{held}"""
        repair = ""
        lock = ""
    # The target table is not aliased: SQLite resolves RETURNING only so.
    breaker = ("(SELECT b.{col} FROM outbox_breakers AS b WHERE b.tenant_id = outbox_messages.tenant_id"
               " AND b.origin = outbox_messages.origin)")
    within_cap = "s.slot + COALESCE(h.n, 0) <= :cap"
    update = f"""
        UPDATE outbox_messages
        SET state = 'in_flight', lease_token = :token, lease_expires_at = {now} + :lease,
            leased_by = :daemon, attempts = attempts + 1,
            first_attempt_at = COALESCE(first_attempt_at, {now}),
            retry_until = {DEADLINE}
        FROM picked WHERE outbox_messages.id = picked.picked_id
        RETURNING id, next_attempt_at, tenant_id, url, origin, idempotency_key, body, body_sha256, body_key_id,
                  auth_mode, auth_secret, sequence_number, notification_type, attempts, retry_until, created_at,
                  trigger,
                  {now} AS claimed_at, {breaker.format(col="state")} AS breaker_state,
                  {breaker.format(col="open_until")} AS breaker_open_until, traceparent, subscriber_ref"""
    if pg:
        # How many rows the claim meant to lease, on a row of its own when it leased none:
        # fewer leased means another claim took (or held) some of them, so due work may be
        # left (see ``outbox.store.claim``); and how many due rows it retired (_retired).
        retired = (_retired("endpoints", "origin, tenant_id", "h.o = r.origin AND h.t = r.tenant_id", now)
                   + " + " + _retired("origins", "origin", "h.o = r.origin", now))
        update = f""",
        claimed AS ({update}
        )
        SELECT c.*, w.wanted, {retired} AS retired FROM (
            SELECT count(*) AS wanted FROM (
                SELECT 1 FROM slots AS s LEFT JOIN held AS h ON h.o = s.o WHERE {within_cap} LIMIT :limit) AS x
        ) AS w LEFT JOIN claimed AS c ON true"""
    return f"""
        WITH {heads}
        slots AS {"MATERIALIZED " if pg else ""}(
            SELECT id, next_attempt_at, o, row_number() OVER (PARTITION BY o ORDER BY nth, next_attempt_at, id) AS slot
            FROM heads
        ),
        picked AS (
            SELECT m.id AS picked_id FROM slots AS s JOIN outbox_messages AS m ON m.id = s.id
            LEFT JOIN held AS h ON h.o = s.o
            WHERE {within_cap} AND m.state = 'pending'
            ORDER BY s.slot, s.next_attempt_at, s.id
            LIMIT :limit {lock}
        ){repair}{update}
    """
