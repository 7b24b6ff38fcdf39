"""Redis channel and key names of the token stream, for the API's side of it.

The names are defined once, next to the publisher in ``workers.stream``; the API reaches
them through here, keeping its imports one-way (api -> tasks -> workers) and torch-free.
"""

from workers.stream import CANCEL_CHANNEL, CANCELLED_KEY, tokens_channel

__all__ = ["CANCEL_CHANNEL", "CANCELLED_KEY", "tokens_channel"]
