"""A request on a reused keep-alive connection, against receivers on 127.0.0.1 that drop it.

A server may close an idle keep-alive connection just as the next request is written
(RFC 9112 section 9.3.1). When that request fails before any byte of an answer, the
sender sends it once more, at once, on a new connection; every other failure (a reused
connection that broke mid-answer, a new connection that failed, the retry failing too)
is the attempt's own, reported as before.
"""

from __future__ import annotations

import asyncio

import pytest

from supervisor.wire.http1 import STALE_WINDOW_SECONDS
from tests.wire_peers import (BODY, HEADERS, IMPATIENT, Request, answers_garbage, hangs_up, loopback_settings,
                              never_answers, ok, resets, sends_half_a_body)
from tests.wire_peers import connects, event_loop_policy, peers, senders  # noqa: F401 - pytest fixtures



def second_request_on_a_connection(handler):  # type: ignore[no-untyped-def]
    """Answer a connection's first request; hand its second to ``handler`` (the dropping peer)."""
    seen: dict[int, int] = {}

    async def serve(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        count = seen[id(writer)] = seen.get(id(writer), 0) + 1
        return await (ok if count == 1 else handler)(request, reader, writer)

    return serve


@pytest.mark.parametrize("drop", [hangs_up, resets], ids=["closed", "reset"])
async def test_a_reused_connection_dropped_before_any_answer_byte_is_retried_at_once_on_a_new_one(
        peers, senders, drop) -> None:  # noqa: F811
    peer = await peers(second_request_on_a_connection(drop))
    sender = senders()
    url = f"http://127.0.0.1:{peer.port}/hook"
    assert (await sender.post(url, BODY, HEADERS)).status == 200
    result = await sender.post(url, BODY, HEADERS)  # one post: the second send is inside it, at once
    assert (result.status, result.error_kind, result.error) == (200, None, None)
    assert peer.connections == 2 and len(peer.requests) == 3, "sent once more, on a new connection"
    assert [r.body for r in peer.requests] == [BODY] * 3, "the same bytes"


@pytest.mark.parametrize(("broken", "kind", "error"), [
    (sends_half_a_body, "connection_error", "RemoteProtocolError: connection closed before the response was complete"),
    (answers_garbage, "protocol_error", "RemoteProtocolError: response is not valid HTTP/1.1"),
    (never_answers, "timeout", "ReadTimeout: no response data within the read timeout"),
], ids=["closed-mid-answer", "garbage", "never-answers"])
async def test_any_other_failure_on_a_reused_connection_is_the_attempts(peers, senders, broken, kind,  # noqa: F811
                                                                        error) -> None:
    peer = await peers(second_request_on_a_connection(broken))
    sender = senders(loopback_settings(**(IMPATIENT if kind == "timeout" else {})))  # waits for its timeout
    url = f"http://127.0.0.1:{peer.port}/hook"
    assert (await sender.post(url, BODY, HEADERS)).status == 200
    result = await sender.post(url, BODY, HEADERS)
    assert (result.status, result.error_kind, result.error) == (None, kind, error)
    assert len(peer.requests) == 2, "no second send"


async def test_a_new_connection_dropped_before_any_answer_is_not_retried(peers, senders) -> None:  # noqa: F811
    peer = await peers(hangs_up)
    result = await senders().post(f"http://127.0.0.1:{peer.port}/hook", BODY, HEADERS)
    assert result.error_kind == "connection_error" and len(peer.requests) == 1


async def test_the_retry_is_made_once(peers, senders) -> None:  # noqa: F811
    """The first request is answered; every later one is dropped unanswered: one retry, then the failure."""
    async def first_only(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        return await ok(request, reader, writer) if len(peer.requests) == 1 else False

    peer = await peers(first_only)
    sender = senders()
    url = f"http://127.0.0.1:{peer.port}/hook"
    assert (await sender.post(url, BODY, HEADERS)).status == 200
    result = await sender.post(url, BODY, HEADERS)
    assert (result.error_kind, result.error) == (
        "connection_error", "RemoteProtocolError: connection closed before the response was complete")
    assert len(peer.requests) == 3 and peer.connections == 2
    # the slot of the dropped connection was handed on, not leaked: the pool still opens connections
    assert (await sender.post(url, BODY, HEADERS)).error_kind == "connection_error"
    assert len(peer.requests) == 4


async def test_a_reused_connection_dropped_long_after_the_request_is_the_attempts_failure(peers, senders) -> None:  # noqa: F811
    """No idle close: the receiver held the request past the stale window, then dropped it. It
    may have acted on it, so the failure is recorded (and retried after back-off), not resent."""
    async def holds_then_drops(request, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        await asyncio.sleep(STALE_WINDOW_SECONDS + 0.3)
        return False

    peer = await peers(second_request_on_a_connection(holds_then_drops))
    sender = senders()
    url = f"http://127.0.0.1:{peer.port}/hook"
    assert (await sender.post(url, BODY, HEADERS)).status == 200
    result = await sender.post(url, BODY, HEADERS)
    assert (result.status, result.error_kind) == (None, "connection_error")
    assert len(peer.requests) == 2, "no second send"
