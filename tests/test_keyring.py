"""The keyring's state machine and CLI on PostgreSQL and SQLite (supervisor/keys/keyring.py).

Times are the database's; a test that needs "later" reads a key's state at a later instant
(state is a pure function of the stored times) instead of sleeping, except where a real
daemon cache must notice a change.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from adcp.signing import CachingRevocationChecker, FetchResult, StaticJwksResolver
from cryptography.hazmat.primitives import serialization

from outbox.config import Settings
from outbox.db import make_async_engine
from outbox.errors import ConfigurationError
from supervisor.keys import keyring
from supervisor.cli import main
from supervisor.keys.keyring import KeyringError, read_snapshot
from supervisor.keys.keyring_cache import CachedKeyring
from supervisor.wire.signing import MAX_VALIDITY_SECONDS, generate_signing_key_pem, load_signing_key

ISSUER = "https://seller.example.com"


def key_file(directory: Path, name: str, alg: str = "ed25519") -> Path:
    path = directory / f"{name}.pem"
    path.write_bytes(generate_signing_key_pem(alg))
    return path


def stage(conn, directory: Path, kid: str, scope: str = "", **kw):
    path = key_file(directory, kid)
    return keyring.stage(conn, scope=scope, key=load_signing_key(path, kid), key_file=str(path), **kw)


def snapshot(engine) -> keyring.Snapshot:
    with engine.connect() as conn:
        return read_snapshot(conn)


def by_kid(snap: keyring.Snapshot) -> dict[str, keyring.KeyRecord]:
    return {r.kid: r for r in snap.records}


def published(snap: keyring.Snapshot, at: float) -> list[str]:
    return [k["kid"] for k in keyring.jwks_document(snap.records, at)["keys"]]


@pytest.fixture
def seeded(engine, tmp_path) -> Settings:
    """Settings with one default key file, registered as the default scope's active key."""
    settings = Settings(signing_key_file=str(key_file(tmp_path, "k1")), signing_key_id="k1")
    with engine.begin() as conn:
        assert [r.kid for r in keyring.bootstrap(conn, settings)] == ["k1"]
    return settings


def test_bootstrap_registers_the_configured_keys_once(engine, tmp_path):
    settings = Settings(signing_key_file=str(key_file(tmp_path, "k1")), signing_key_id="k1",
                        tenant_signing_keys={"acme": (str(key_file(tmp_path, "acme-1", "ecdsa-p256-sha256")),
                                                      "acme-1")})
    with engine.begin() as conn:
        assert sorted(r.kid for r in keyring.bootstrap(conn, settings)) == ["acme-1", "k1"]
    with engine.begin() as conn:
        assert keyring.bootstrap(conn, settings) == []  # each scope has keys now: left alone
    snap = snapshot(engine)
    assert {r.kid: (r.scope, r.state(snap.now)) for r in snap.records} == {"k1": ("", "active"),
                                                                           "acme-1": ("acme", "active")}
    assert snap.scope_of("acme", snap.now) == "acme" and snap.scope_of("other", snap.now) == ""
    assert all(Path(r.key_file).is_absolute() for r in snap.records)
    jwks = keyring.jwks_document(snap.records, snap.now)
    assert [k["kid"] for k in jwks["keys"]] == ["k1", "acme-1"]
    assert all(k["adcp_use"] == "webhook-signing" and "d" not in k for k in jwks["keys"])  # the default purpose


def test_stage_publishes_without_signing_and_promotion_waits_for_the_cache_window(engine, tmp_path, seeded):
    with engine.begin() as conn:
        k2 = stage(conn, tmp_path, "k2")
    snap = snapshot(engine)
    assert by_kid(snap)["k2"].state(snap.now) == "next"
    assert published(snap, snap.now) == ["k1", "k2"]
    assert snap.active("", snap.now).kid == "k1"
    with engine.begin() as conn, pytest.raises(KeyringError, match="published for 0 s; buyers may cache the JWKS "
                                                                     "for 1800 s .* or pass --force$"):
        keyring.promote(conn, cache_window=seeded.key_cache_window_seconds)
    with engine.begin() as conn:
        done = keyring.promote(conn, cache_window=0)
    assert (done.new.kid, done.old.kid, done.forced_early) == ("k2", "k1", False)
    snap = snapshot(engine)
    k1, k2 = by_kid(snap)["k1"], by_kid(snap)["k2"]
    switch = done.switch_at
    assert switch == pytest.approx(snap.now + keyring.SWITCH_DELAY_SECONDS, abs=0.5)
    # Before the switch instant nothing changes; at it, every reader sees the new key.
    assert (k1.state(switch - 0.001), k2.state(switch - 0.001)) == ("active", "next")
    assert (k1.state(switch), k2.state(switch)) == ("retiring", "active")
    # The old key stays published for the signature validity, the verifier's skew and the window.
    gone = switch + MAX_VALIDITY_SECONDS + keyring.VERIFIER_SKEW_SECONDS + 0
    assert k1.unpublish_at == pytest.approx(gone)
    assert published(snap, gone - 0.001) == ["k1", "k2"] and published(snap, gone) == ["k2"]
    assert k1.state(gone) == "retired"


def test_force_promotes_early_and_says_so(engine, tmp_path, seeded):
    with engine.begin() as conn:
        stage(conn, tmp_path, "k2")
        done = keyring.promote(conn, cache_window=1800, force=True)
    assert done.forced_early and done.new.kid == "k2"
    with engine.begin() as conn, pytest.raises(KeyringError, match="no next key"):
        keyring.promote(conn, cache_window=0)


def test_refusals_are_one_line(engine, tmp_path, seeded):
    with engine.begin() as conn:
        stage(conn, tmp_path, "k2")
        stage(conn, tmp_path, "k3")
    cases = [
        (lambda c: keyring.promote(c, cache_window=0), "several next keys; name one: k2, k3"),
        (lambda c: keyring.promote(c, kid="k1", cache_window=0), "'k1' is active, only a next key"),
        (lambda c: keyring.promote(c, kid="nope", cache_window=0), "no key 'nope'"),
        (lambda c: keyring.promote(c, scope="acme", kid="k2", cache_window=0),
         "key 'k2' belongs to the default scope, not tenant 'acme': `outboxd keys promote k2`"),
        (lambda c: keyring.stage(c, scope="acme", key=load_signing_key(key_file(tmp_path, "other"), "k1"),
                                 key_file="other.pem"), "'k1' is already in the keyring (the default scope)"),
        (lambda c: keyring.stage(c, scope="", key=load_signing_key(seeded.signing_key_file, "again"),
                                 key_file=seeded.signing_key_file), "already in the keyring as 'k1'"),
        (lambda c: stage(c, tmp_path, "k9", adcp_use="governance-signing"), "adcp_use must be"),
        (lambda c: keyring.revoke(c, "nope"), "no key 'nope'"),
    ]
    for change, message in cases:
        with engine.begin() as conn, pytest.raises(KeyringError) as err:
            change(conn)
        assert message in str(err.value) and "\n" not in str(err.value)
    with engine.begin() as conn:
        keyring.promote(conn, kid="k3", cache_window=0)
    with engine.begin() as conn, pytest.raises(KeyringError, match="already has a switch scheduled"):
        keyring.promote(conn, kid="k2", cache_window=0)


def test_revoke_stops_publishing_at_once_and_lists_the_kid(engine, tmp_path, seeded):
    with engine.begin() as conn:
        stage(conn, tmp_path, "k2")
        keyring.promote(conn, cache_window=0)
    with engine.begin() as conn:
        keyring.revoke(conn, "k1")  # the retiring key
    snap = snapshot(engine)
    assert by_kid(snap)["k1"].state(snap.now) == "revoked"
    assert published(snap, snap.now) == ["k2"]
    with engine.begin() as conn, pytest.raises(KeyringError, match="already revoked"):
        keyring.revoke(conn, "k1")
    # The SDK fetches, verifies and applies the signed list (security page, "Transport revocation").
    signer = snap.signer(snap.now + 2)
    document = keyring.revocation_document(snap.records, snap.now, issuer=ISSUER,
                                           signer=load_signing_key(signer.key_file, signer.kid))
    checker = CachingRevocationChecker(
        revocation_uri=ISSUER + "/.well-known/governance-revocations.json", issuer=ISSUER,
        jwks_resolver=StaticJwksResolver(keyring.jwks_document(snap.records, snap.now + 2)),
        fetcher=lambda uri, **_: FetchResult(body=document, etag=None))
    assert checker("k1") is True and checker("k2") is False


def test_revoking_a_pending_promotion_keeps_the_current_key(engine, tmp_path, seeded):
    with engine.begin() as conn:
        stage(conn, tmp_path, "k2")
        keyring.promote(conn, cache_window=0)
        keyring.revoke(conn, "k2")
    snap = snapshot(engine)
    later = snap.now + 3600
    assert by_kid(snap)["k1"].state(later) == "active" and by_kid(snap)["k2"].state(later) == "revoked"


def test_a_tenants_own_keys_take_over_only_once_active_and_never_fall_back(engine, tmp_path, seeded):
    with engine.begin() as conn:
        stage(conn, tmp_path, "acme-1", scope="acme")
    snap = snapshot(engine)
    assert snap.scope_of("acme", snap.now) == ""  # a staged first key: acme still signs with k1
    with engine.begin() as conn:
        done = keyring.promote(conn, scope="acme", cache_window=0)
    snap = snapshot(engine)
    assert done.old is None and snap.scope_of("acme", done.switch_at) == "acme"
    assert snap.active("", done.switch_at).kid == "k1"  # the default scope did not move
    time.sleep(max(done.switch_at - snap.now, 0) + 0.05)  # revoked once it has signed, not while pending
    with engine.begin() as conn:
        keyring.revoke(conn, "acme-1")
    snap = snapshot(engine)
    assert snap.scope_of("acme", snap.now + 5) == "acme" and snap.active("acme", snap.now + 5) is None


@pytest.fixture
def database_url(engine, request) -> str:
    return request.getfixturevalue("pg_url" if engine.dialect.name == "postgresql" else "sqlite_url")


async def test_daemon_cache_follows_the_database(engine, database_url, tmp_path, seeded):
    async_engine = make_async_engine(database_url)
    try:
        cache = CachedKeyring(seeded)
        await cache.start(async_engine)
        assert cache.resolve("acme").key_id == "k1"
        assert await cache.refresh(async_engine) is False  # version unchanged: no reread
        assert abs(cache.now() - snapshot(engine).now) < 1.0
        with engine.begin() as conn:
            stage(conn, tmp_path, "k2")
            keyring.promote(conn, cache_window=0)
        assert await cache.refresh(async_engine) is True
        assert cache.resolve("acme").key_id == "k1"  # the switch is scheduled, not yet due
        assert [k["kid"] for k in cache.jwks()["keys"]] == ["k1", "k2"]
        assert cache.revocations() is None  # no OUTBOX_REVOCATION_ISSUER
        with engine.begin() as conn:
            keyring.revoke(conn, "k2")  # cancels the switch
            stage(conn, tmp_path, "k3")
        (tmp_path / "k3.pem").write_bytes(generate_signing_key_pem())  # the file no longer matches
        await cache.refresh(async_engine)
        with engine.begin() as conn:
            keyring.promote(conn, cache_window=0)
        await cache.refresh(async_engine)
        cache._offset += keyring.SWITCH_DELAY_SECONDS + 0.1  # look just past the switch instant
        with pytest.raises(ConfigurationError, match="k3.pem no longer holds the key published as 'k3'"):
            cache.resolve("acme")
    finally:
        await async_engine.dispose()


async def test_a_tenant_whose_first_key_is_only_staged_reads_as_signing(engine, database_url, tmp_path, seeded):
    """Its webhooks are signed with the default scope's key until its own is promoted, so its
    scope's ``outbox_signing_active_keys`` reads the default's 1: a 0 fired the critical "no
    active signing key: webhooks are held" alert for the whole cache window of every new
    tenant key, whose runbook says to promote early (what makes buyers reject webhooks)."""
    async_engine = make_async_engine(database_url)
    try:
        with engine.begin() as conn:
            stage(conn, tmp_path, "acme-1", scope="acme")
        cache = CachedKeyring(seeded)
        await cache.start(async_engine)
        assert cache.resolve("acme").key_id == "k1"
        assert cache.signing_scopes() == {"": 1, "acme": 1}
        with engine.begin() as conn:
            keyring.revoke(conn, "k1")  # the default scope now signs nothing: neither does acme
        await cache.refresh(async_engine)
        assert cache.signing_scopes() == {"": 0, "acme": 0}
    finally:
        await async_engine.dispose()


async def test_daemon_start_needs_a_key(database_url):
    async_engine = make_async_engine(database_url)
    try:
        with pytest.raises(ConfigurationError, match="^no signing key: set OUTBOX_SIGNING_KEY_FILE"):
            await CachedKeyring(Settings()).start(async_engine)
    finally:
        await async_engine.dispose()


def run_cli(capsys, monkeypatch, url: str, *args: str, **env: str) -> tuple[int, str, str]:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    for name, value in env.items():
        monkeypatch.setenv(f"OUTBOX_{name.upper()}", value)
    code = main(["keys", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_rotation_from_the_config_key(database_url, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OUTBOX_SIGNING_KEY_FILE", str(key_file(tmp_path, "k1")))
    monkeypatch.setenv("OUTBOX_SIGNING_KEY_ID", "k1")
    cli = lambda *a, **e: run_cli(capsys, monkeypatch, database_url, *a, **e)  # noqa: E731
    code, out, _ = cli("rotate", "--generate", str(tmp_path / "k2.pem"), "--kid", "k2")
    assert code == 0 and out.startswith("staged k2 for the default scope as next")
    assert out.rstrip().endswith("with `outboxd keys promote`")
    assert (tmp_path / "k2.pem").stat().st_mode & 0o777 == 0o600
    code, _, err = cli("promote")
    assert code == 1 and err.count("\n") == 1 and "or pass --force" in err
    code, out, _ = cli("list", "--json")
    assert {r["kid"]: r["state"] for r in json.loads(out)} == {"k1": "active", "k2": "next"}
    code, out, err = cli("promote", "--json", key_cache_window_seconds="0")
    assert code == 0 and json.loads(out)["retiring"] == "k1" and err.count("\n") == 1
    assert "OUTBOX_KEY_CACHE_WINDOW_SECONDS=0 is below the 1800 s" in err  # a window buyers outlast
    code, out, _ = cli("jwks")
    assert [k["kid"] for k in json.loads(out)["keys"]] == ["k1", "k2"]
    code, out, err = cli("revoke", "k1")
    assert code == 0 and "revoked k1" in out and "OUTBOX_REVOCATION_ISSUER is not set" in err
    code, out, _ = cli("list")
    assert out.splitlines()[0].split()[:3] == ["KID", "SCOPE", "STATE"] and " revoked " in out
    code, _, err = cli("revocations")
    assert code == 1 and "set OUTBOX_REVOCATION_ISSUER" in err
    code, out, _ = cli("revocations", revocation_issuer=ISSUER)
    assert code == 0 and json.loads(out)["signatures"][0]["protected"]
    code, _, err = cli("revoke", "k2")  # the active one: the warning is the line `status` gives, same fix
    [paused] = [line for line in err.splitlines() if "has no active signing key" in line]
    assert code == 0 and "`outboxd keys rotate --generate FILE`, then `outboxd keys promote`" in paused
    code, out, _ = cli("rotate", "--tenant", "acme", "--generate", str(tmp_path / "a1.pem"), "--kid", "a1")
    assert code == 0 and out.rstrip().endswith("with `outboxd keys promote --tenant acme`"), out  # the key staged


def test_cli_stages_a_jwk_with_its_kid_and_warns_on_the_purpose_3_0_buyers_reject(database_url, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv("OUTBOX_SIGNING_KEY_FILE", str(key_file(tmp_path, "k1")))
    monkeypatch.setenv("OUTBOX_SIGNING_KEY_ID", "k1")
    jwk = {**load_signing_key(key_file(tmp_path, "j"), "from-jwk").public_jwk(), "d": None}
    private = load_signing_key(tmp_path / "j.pem", "x").private_key
    raw = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    jwk["d"] = keyring._b64url(raw)
    (tmp_path / "j.jwk").write_text(json.dumps(jwk))
    code, out, err = run_cli(capsys, monkeypatch, database_url, "rotate", "--tenant", "acme", "--key-file",
                             str(tmp_path / "j.jwk"), "--adcp-use", "request-signing", "--json")
    assert code == 0 and json.loads(out)["staged"] == "from-jwk" and "webhook_mode_mismatch" in err
    code, out, err = run_cli(capsys, monkeypatch, database_url, "rotate", "--generate", str(tmp_path / "g.pem"),
                             "--kid", "generated", "--json")
    assert code == 0 and err == ""  # the default purpose verifies for every buyer: nothing to warn about
    code, out, _ = run_cli(capsys, monkeypatch, database_url, "jwks")
    keys = {k["kid"]: k for k in json.loads(out)["keys"]}
    assert {kid: k["adcp_use"] for kid, k in keys.items()} == {
        "k1": "webhook-signing", "generated": "webhook-signing", "from-jwk": "request-signing"}
    code, _, err = run_cli(capsys, monkeypatch, database_url, "rotate", "--key-file", str(tmp_path / "absent.pem"))
    assert code == 1 and "cannot read it" in err


def test_a_scope_without_an_active_key_is_paused_with_the_fix_it_needs() -> None:
    """Only scopes that sign for someone: the default, and a tenant once it owned a key (a
    tenant with only a staged key still signs with the default scope's)."""
    def record(kid: str, scope: str, **times: float) -> keyring.KeyRecord:
        return keyring.KeyRecord(kid=kid, scope=scope, alg="ed25519", key_file="/k.pem", public_jwk={},
                                 adcp_use=keyring.ADCP_USE_REQUEST, published_at=0.0, **times)

    snapshot = keyring.Snapshot(1, 100.0, (
        record("d1", "", activates_at=10.0, revoked_at=50.0),  # the default scope's only key, revoked
        record("d2", "", ),  # staged: promoting it is the fix
        record("a1", "acme", activates_at=10.0, revoked_at=60.0),  # acme owned a key: paused, never the default's
        record("b1", "beta"),  # beta only staged one: it still signs with the default scope
        record("c1", "cargo", activates_at=10.0),  # active
    ))
    paused = snapshot.paused(100.0)
    assert set(paused) == {"", "acme"}
    assert paused[""].startswith("the default scope has no active signing key: its deliveries are paused")
    assert paused[""].endswith("`outboxd keys promote`")
    assert paused["acme"].endswith("`outboxd keys rotate --tenant acme --generate FILE`, then "
                                   "`outboxd keys promote --tenant acme`")
    assert snapshot.paused(20.0) == {}, "before the revocations every scope had its key"


@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o604, True), (0o640, False), (0o600, False)])
def test_a_key_file_anyone_on_the_host_can_read_is_warned_about(engine, database_url, tmp_path, capsys,
                                                                  monkeypatch, mode, warned):
    import asyncio

    from structlog.testing import capture_logs

    configured = key_file(tmp_path, "k1")
    configured.chmod(0o600)
    monkeypatch.setenv("OUTBOX_SIGNING_KEY_FILE", str(configured))
    monkeypatch.setenv("OUTBOX_SIGNING_KEY_ID", "k1")
    staged = key_file(tmp_path, "k2")
    staged.chmod(mode)
    code, _, err = run_cli(capsys, monkeypatch, database_url, "rotate", "--key-file", str(staged), "--kid", "k2")
    assert code == 0 and (f"chmod 600 {staged}" in err) is warned, err

    async def daemon_start() -> None:  # the daemon loads the staged key: it may sign soon
        async_engine = make_async_engine(database_url)
        try:
            await CachedKeyring(Settings()).start(async_engine)
        finally:
            await async_engine.dispose()

    with capture_logs() as logs:
        asyncio.run(daemon_start())
    readable = [(e["kid"], e["hint"]) for e in logs if e["event"] == "keyring.key_file_readable_by_others"]
    assert readable == ([("k2", f"chmod 600 {staged}")] if warned else [])
