"""A local AdCP webhook receiver for the demo, the end-to-end tests and ``outboxd bench``.

It verifies every RFC 9421 signature independently of the daemon's signer (with the
``http_message_signatures`` library, or the ``adcp`` SDK's verifier when asked), records
every arrival as a JSON line, and behaves as the URL path says (:mod:`.server`). It is a
test and demo tool, not part of the daemon: run it as ``python -m outboxd_receiver``.
"""

from outboxd_receiver.server import Receiver, serve
from outboxd_receiver.verifiers import Verifier, adcp_verifier, library_verifier

__all__ = ["Receiver", "Verifier", "adcp_verifier", "library_verifier", "serve"]
