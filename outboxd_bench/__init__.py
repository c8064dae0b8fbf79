"""``outboxd bench``: throughput, latency, isolation, scale and memory, in one bounded run.

Everything runs for real on this machine against the configured PostgreSQL database, over
HTTPS by default (a throwaway CA, :mod:`.certs`):

* the **receivers** are their own processes (``python -m outboxd_receiver``, path ``/ok``)
  started *without* ``--jwks``, so they spend no CPU verifying signatures (the daemon still
  signs every request): one origin, a second for the tenth tenant of the latency runs, and
  one process serving ``--origins`` ports for the many-origins case;
* the **daemons** are real ``outboxd run`` subprocesses with the configured settings (the
  defaults unless the operator tuned them); their CPU and peak RSS come from ``/proc``, and
  so does the CPU of the PostgreSQL backends serving the bench database;
* the **bare loop** (:mod:`.bare`) is an ``httpx.AsyncClient`` POSTing the same body to the
  same receiver at concurrency 1, 8 and 32, in its own process, with no database and no
  signing: the practical ceiling of the HTTP client the daemon uses.

Phases (:mod:`.run`): bare loops; throughput to one origin, from many tenants to one shared
origin, to many origins, and with two daemons (each message delivered once?); bare loops
again; commit-to-arrival latency with and without a hanging tenant; memory with 10,000 due;
the claim's plan and time with ``--scale-rows`` finished rows vs none (:mod:`.scale`).

The bench needs a migrated, **empty** outbox (it truncates the outbox tables between
phases and leaves them empty): point ``OUTBOX_DATABASE_URL`` at a scratch database.
"""

from outboxd_bench.run import run_bench

__all__ = ["run_bench"]
