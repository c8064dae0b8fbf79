"""``outboxd run`` against receivers on 127.0.0.1 that misuse a keep-alive connection.

Each receiver answers from a script, per request on each connection: it may write bytes
after its answer, drop a reused connection before answering, or break off mid-answer. What
the daemon records must be what each request was answered: never `delivered` for a 503,
no attempt (nor back-off, nor breaker failure) for a connection the receiver had closed
while idle, and an attempt as before for a connection that broke mid-answer.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from outbox.schema import attempts, breakers, messages
from tests import procs
from tests.ledger import enqueue_batch, message_key

pytestmark = pytest.mark.e2e

# (how many requests this connection has carried, how many the receiver has) -> (bytes to
# write, whether to keep the connection open after them).
Script = Callable[[int, int], tuple[bytes, bool]]
KEYS = (message_key("wire", 1), message_key("wire", 2))


def answer(status: int, body: bytes = b"ok") -> bytes:
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


class ScriptedReceiver:
    """An HTTP/1.1 receiver on 127.0.0.1, one thread per connection; logs (key, connection, nth)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.log: list[tuple[str, int, int]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn:
            buffered, nth = b"", 0
            while True:
                while b"\r\n\r\n" not in buffered:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffered += data
                head, buffered = buffered.split(b"\r\n\r\n", 1)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                while len(buffered) < length:
                    buffered += conn.recv(65536)
                body, buffered = buffered[:length], buffered[length:]
                nth += 1
                key = json.loads(body)["idempotency_key"]
                self.log.append((key, number, nth))
                reply, keep = self.script(nth, len(self.log))
                conn.sendall(reply)
                if not keep:
                    return

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


@pytest.fixture
def run(pg_engine, pg_url: str, tmp_path: Path) -> Iterator[Callable[[Script, Callable[[], bool]], ScriptedReceiver]]:
    """Enqueue two messages to one scripted receiver and run the daemon (one request at a
    time per origin, so the later one goes on the connection the earlier one used) until ``done``."""
    key, _ = procs.make_key(tmp_path)
    made: list[ScriptedReceiver] = []

    def start(script: Script, done: Callable[[], bool]) -> ScriptedReceiver:
        receiver = ScriptedReceiver(script)
        made.append(receiver)
        enqueue_batch(pg_engine, [("t1", f"http://127.0.0.1:{receiver.port}/hook", k) for k in KEYS])
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key, endpoint_concurrency=1), tmp_path / "d.log")
        try:
            assert procs.wait_until(lambda: done() or daemon.poll() is not None, 60)
        finally:
            assert procs.stop(daemon) == 0
        return receiver

    yield start
    for receiver in made:
        receiver.close()


def recorded(engine, key: str) -> list[tuple[str, int | None, str | None]]:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(  # type: ignore[misc]
            select(attempts.c.outcome, attempts.c.http_status, attempts.c.error)
            .where(attempts.c.idempotency_key == key).order_by(attempts.c.attempt_number)).all()]


def state(engine, key: str) -> str:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(select(messages.c.state).where(messages.c.idempotency_key == key)).scalar_one()


def window_failures(engine) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return sum(conn.execute(select(breakers.c.window_failures + breakers.c.previous_failures)).scalars())


def everything(engine) -> dict[str, list[tuple[str, int | None, str | None]]]:  # type: ignore[no-untyped-def]
    return {key: recorded(engine, key) for key in KEYS}


def test_bytes_after_an_answer_never_answer_the_next_request(run, pg_engine) -> None:
    """One write holds the first request's 200 and most of the head of another 200, whose
    body would be exactly the next answer; the next request's real answer is 503 and must be
    recorded so."""
    refusal = b"\r\n" + answer(503, b"busy, try again later")  # ends the head below, or is skipped
    swallower = f"HTTP/1.1 200 OK\r\nContent-Length: {len(refusal) - 2}\r\n".encode()  # its body: the 503

    receiver = run(lambda nth, order: (answer(200) + swallower if order == 1 else refusal, True),
                   lambda: all(everything(pg_engine).values()))
    (first, first_connection, _), *later = receiver.log
    second = next(key for key in KEYS if key != first)
    assert recorded(pg_engine, first) == [("success", 200, None)]
    refused = recorded(pg_engine, second)
    assert refused and all(status == 503 for _, status, _ in refused), refused
    assert state(pg_engine, second) != "delivered"
    assert later[0][:2] != (second, first_connection), "the connection with bytes after its answer was reused"


def dropped_then_resent(receiver: ScriptedReceiver) -> str:
    """The key the receiver saw as a connection's second request, and then again on a new one."""
    (key, connection, _), = [entry for entry in receiver.log if entry[2] == 2]
    again = [(number, nth) for k, number, nth in receiver.log if k == key]
    assert again == [(connection, 2), (again[1][0], 1)] and again[1][0] != connection, receiver.log
    return key


def test_a_connection_the_receiver_closed_while_idle_costs_no_attempt(run, pg_engine) -> None:
    """The receiver drops a reused connection as the next request arrives on it, unanswered
    (as a server closing an idle connection just as the request is written): it is sent
    again at once on a new connection; one attempt each, a success, no breaker failure."""
    receiver = run(lambda nth, order: (answer(200), True) if nth == 1 else (b"", False),
                   lambda: all(state(pg_engine, key) == "delivered" for key in KEYS))
    dropped_then_resent(receiver)
    assert everything(pg_engine) == {key: [("success", 200, None)] for key in KEYS}
    assert window_failures(pg_engine) == 0


def test_a_reused_connection_closed_mid_answer_is_a_failed_attempt(run, pg_engine) -> None:
    """A reused connection that breaks after part of an answer is the receiver's failure:
    recorded, counted for the breaker, and retried after back-off, as before."""
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    receiver = run(lambda nth, order: (answer(200), True) if nth == 1 else (partial, False),
                   lambda: all(state(pg_engine, key) == "delivered" for key in KEYS))
    broken = dropped_then_resent(receiver)
    assert everything(pg_engine) == {key: [("success", 200, None)] for key in KEYS if key != broken} | {broken: [
        ("connection_error", None, "RemoteProtocolError: connection closed before the response was complete"),
        ("success", 200, None)]}
    assert window_failures(pg_engine) == 1
