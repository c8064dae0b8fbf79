"""Where delivery attempts go: the ``DeliveryAttempt`` record and the sinks that take it.

The SQL attempt table is not a sink here: it is written in the daemon's completion
transaction, with the message's new state, so it can never disagree with it. Sinks receive
each attempt after that commit, best effort, with a timeout.
"""

from sinks.attempt import DeliveryAttempt, DeliveryLogSink
from sinks.fanout import SinkFanout, load_sink

__all__ = ["DeliveryAttempt", "DeliveryLogSink", "SinkFanout", "load_sink"]
