"""A fork server for test receivers: the adcp SDK's verifier is imported once, not per test.

Importing ``adcp.signing`` takes 15 s of CPU or more (its pydantic models); two dozen
end-to-end tests each start a receiver, and paying that every time was a third of the
suite. This process imports the receiver and its verifiers, then forks one child per
request: each child is a real, separate receiver process (its own pid, killed for real),
running ``python -m outboxd_receiver`` with the arguments it was given.

Protocol, one JSON line each way on stdin/stdout: ``{"argv": [...]}`` in, ``{"pid": N}`` out.
Children are reaped automatically (SIGCHLD ignored), so a dead child's pid is gone at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def main() -> None:
    import adcp.signing.webhook_verifier  # noqa: F401 - the expensive import, once, before any fork
    import http_message_signatures  # noqa: F401
    import outboxd_receiver.__main__ as receiver_main

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        argv = json.loads(line)["argv"]
        pid = os.fork()
        if pid == 0:  # the receiver: detach from the server's pipes, then run as the module would
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1):
                os.dup2(devnull, fd)
            code = 0
            try:
                receiver_main.main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                code = 1
            os._exit(code)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
