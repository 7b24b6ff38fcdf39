"""Redis channel and key names shared with the workers, for the API's side of them.

The names are defined once, next to their writers in ``workers.stream`` (token frames,
cancels) and ``workers.registry`` (heartbeats); the API reaches them through here, keeping
its imports one-way (api -> tasks -> workers) and torch-free.
"""

from workers.registry import POOL_SET, WORKER_KEY, worker_queue
from workers.stream import CANCEL_CHANNEL, CANCELLED_KEY, tokens_channel

__all__ = [
    "CANCEL_CHANNEL",
    "CANCELLED_KEY",
    "POOL_SET",
    "WORKER_KEY",
    "tokens_channel",
    "worker_queue",
]
