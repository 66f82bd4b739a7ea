"""Transport: moving a store's objects to many receivers.

* :mod:`~nemo_dcr.transport.relay` -- ``nemo-dcr relay``, an HTTP server for a store's read side
  that fetches each object once from its upstream (a store or another relay), passes it on while
  it arrives, keeps it once verified, and long-polls the head pointer. Trees of relays.
* the client side is a store: :class:`nemo_dcr.stores.HttpStore` (``http://relay:port``) and
  :class:`nemo_dcr.stores.FallbackStore` (a relay, its ancestors, the store, tried in order).
"""
from nemo_dcr.transport.relay import Relay, parse_listen, serve

__all__ = ["Relay", "serve", "parse_listen"]
