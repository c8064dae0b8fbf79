"""Which leased message starts its request now: per-origin slots and a short queue of the next.

The claim (``outbox.store.claim``) leases up to ``2 × OUTBOX_ENDPOINT_CONCURRENCY`` messages
per origin: the requests that may be open at once, and as many again waiting their turn in
memory. When a request ends, the next waiting message of its origin starts at once, with no
database round trip between them; the claim refills the queue in batches while requests
run. Without the queue, every slot sat idle for a claim round trip after each request, and
claims came one or two rows at a time (docs/performance.md, "Claiming ahead").

Rules that keep the queue from weakening a promise:

* **A slot frees when its outcome may free it.** A request that ended in a retryable
  failure holds its slot until the completer has recorded it and the breaker has judged it
  (:meth:`Dispatcher.settled`), so a failing endpoint gets no more requests than its
  breaker's threshold plus one round of its concurrency before it trips; once it trips,
  what waits for it is handed back unsent (:meth:`Dispatcher.tripped`).
* **A lease is never outlived.** A waiting message starts only if its whole attempt
  (``connect + read`` timeout) still ends inside its lease, with a margin, its lease's age
  counted from when its claim was sent (``Claimed.claim_sent``, never later than the
  lease began); otherwise it is
  handed back, unsent and uncounted, due again at once. That happens only when an origin's
  requests take many seconds, and costs one cheap claim and release per such message.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable

from outbox.leases import Claimed

# A waiting message's attempt must end this long before its lease does (or half the time a
# lease leaves beyond one attempt, if that is less).
LEASE_MARGIN_SECONDS = 1.0

Start = Callable[[Claimed], None]  # begins the request of a message that got a slot
Release = Callable[[Claimed], None]  # hands a leased message back unsent


class Dispatcher:
    """Per-origin request slots and the queues of messages waiting for one (no I/O here)."""

    def __init__(self, *, concurrency: int, endpoint_concurrency: int, lease_seconds: float,
                 attempt_seconds: float, start: Start, release: Release,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._concurrency = concurrency
        self._cap = endpoint_concurrency
        spare = lease_seconds - attempt_seconds  # > 0: Settings refuses a lease shorter than an attempt
        self._max_wait = spare - min(LEASE_MARGIN_SECONDS, spare / 2)
        self._start = start
        self._release = release
        self._clock = clock
        self._slots: Counter[str] = Counter()  # per origin: requests open, and failures not yet judged
        self._waiting: dict[str, deque[Claimed]] = {}  # per origin: messages in the order leased
        self.queued = 0
        self.running = 0  # requests open now (all origins)

    def waiting(self, origin: str) -> int:
        queue = self._waiting.get(origin)
        return len(queue) if queue else 0

    def held(self, origin: str) -> int:
        """Leases of ``origin`` that this process accounts for: slots taken and messages waiting."""
        return self._slots[origin] + self.waiting(origin)

    def origins(self) -> Iterable[str]:
        return set(self._slots) | set(self._waiting)

    def add(self, message: Claimed) -> None:
        """A message just leased: it starts now if its origin (and the process) has a slot."""
        origin = message.origin or ""
        self._waiting.setdefault(origin, deque()).append(message)
        self.queued += 1
        self._fill(origin)

    def ended(self, message: Claimed, *, holds_slot: bool) -> None:
        """A request ended; ``holds_slot`` keeps its slot until :meth:`settled` (a retryable failure)."""
        self.running -= 1
        if not holds_slot:
            self._free(message.origin or "")
        self._refill(message.origin or "")

    def settled(self, messages: Iterable[Claimed]) -> None:
        """The completer recorded (or gave up on) these retryable failures: their slots free."""
        origins = set()
        for message in messages:
            origin = message.origin or ""
            self._free(origin)
            origins.add(origin)
        for origin in origins:  # only an origin slot freed (no request ended): only its queue can move
            self._fill(origin)

    def tripped(self, endpoints: Iterable[tuple[str, str]]) -> None:
        """These endpoints' breakers opened: hand back what waits for them, unsent."""
        for tenant, origin in set(endpoints):
            queue = self._waiting.pop(origin, deque())
            for message in queue:
                if message.tenant_id == tenant:
                    self.queued -= 1
                    self._release(message)
                else:
                    self._waiting.setdefault(origin, deque()).append(message)

    def release_all(self) -> None:
        """Hand back every waiting message (shutdown)."""
        queues, self._waiting = self._waiting, {}
        for queue in queues.values():
            for message in queue:
                self._release(message)
        self.queued = 0

    # ------------------------------------------------------------------ internals

    def _free(self, origin: str) -> None:
        self._slots[origin] -= 1
        if self._slots[origin] <= 0:
            del self._slots[origin]

    def _refill(self, origin: str) -> None:
        """After a request ended: this origin's next message, or any origin's when the process
        was full (its cap, not the origin's, may have held them)."""
        if self.running + 1 >= self._concurrency:
            for other in list(self._waiting):
                self._fill(other)
        else:
            self._fill(origin)

    def _fill(self, origin: str) -> None:
        queue = self._waiting.get(origin)
        while queue and self._slots[origin] < self._cap and self.running < self._concurrency:
            message = queue.popleft()
            self.queued -= 1
            if self._clock() - message.claim_sent > self._max_wait:
                self._release(message)  # its attempt could outlive its lease now
                continue
            self._slots[origin] += 1
            self.running += 1
            self._start(message)
        if queue is not None and not queue:
            del self._waiting[origin]
