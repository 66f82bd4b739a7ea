"""What a request path names, checked before anything is read: a key of the relay's store, or
one of its own endpoints. Nothing outside the relay's namespace can be named.

The path is taken raw (as sent, before any normalisation) and split on '/' first; only then is
each component percent-decoded. So an encoded '/' (``%2F``) cannot join components, an encoded
``..`` (``%2e%2e``) is a '..' component and refused, and every key must pass
:func:`nemo_dcr.stores.base.check_key` (relative, no '.' or '..' or hidden components, no NUL
or backslash).
"""
from __future__ import annotations

from urllib.parse import unquote

from nemo_dcr.stores.base import StoreError, check_key
from nemo_dcr.stores.http import LIST_PATH, STATS_PATH

__all__ = ["BadPath", "parse_path", "ENDPOINTS"]

ENDPOINTS = {LIST_PATH: "list", STATS_PATH: "stats"}


class BadPath(ValueError):
    """The request names nothing the relay serves (400 for a malformed path, 404 for another
    namespace)."""

    def __init__(self, message: str, status: int = 400):
        self.status = status
        super().__init__(message)


def _components(raw_path: str) -> list:
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        raise BadPath("the request path must start with '/'")
    out = []
    for part in path[1:].split("/"):
        try:
            text = unquote(part, errors="strict")
        except UnicodeDecodeError:
            raise BadPath("the request path is not UTF-8") from None
        if "/" in text or "\\" in text or "\x00" in text or any(ord(c) < 32 for c in text):
            raise BadPath("encoded '/', backslash or control characters are not allowed in a path")
        out.append(text)
    return out


def parse_path(raw_path: str, mount: str = "") -> tuple:
    """``("key", key)`` or ``(endpoint, "")`` for the raw request path, under the relay's
    ``mount`` prefix ("" or a key-like path). Raises :class:`BadPath`."""
    parts = _components(raw_path)
    want = mount.split("/") if mount else []
    if parts[:len(want)] != want:
        raise BadPath("not in this relay's namespace", 404)
    rest = parts[len(want):]
    if len(rest) == 1 and rest[0] in ENDPOINTS:
        return ENDPOINTS[rest[0]], ""
    try:
        return "key", check_key("/".join(rest))
    except StoreError as e:
        raise BadPath(str(e)) from None
