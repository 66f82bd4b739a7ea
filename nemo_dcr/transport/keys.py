"""What a request path names, checked before anything is read: a key of the relay's store, or
one of its own endpoints. Nothing outside the relay's namespace can be named, and nothing but
the store's own key space (:func:`nemo_dcr.sync.versions.is_store_key`: HEAD, manifests, parts)
is forwarded upstream.

The path is taken raw (as sent, before any normalisation) and split on '/' first; only then is
each component percent-decoded. So an encoded '/' (``%2F``) cannot join components, an encoded
``..`` (``%2e%2e``) is a '..' component and refused, and every key must pass
:func:`nemo_dcr.stores.base.check_key` (relative, no '.' or '..' or hidden components, no NUL
or backslash).

``/metrics`` (Prometheus) and ``/healthz`` are the relay's own, at the root whatever its mount.
"""
from __future__ import annotations

from urllib.parse import unquote

from nemo_dcr.stores.base import StoreError, check_key
from nemo_dcr.stores.http import LIST_PATH, STATS_PATH
from nemo_dcr.sync.versions import is_store_key

__all__ = ["BadPath", "parse_path", "ENDPOINTS", "ROOT_ENDPOINTS", "MAX_PATH"]

ENDPOINTS = {LIST_PATH: "list", STATS_PATH: "stats"}   # under the mount, beside the keys
ROOT_ENDPOINTS = {"metrics": "metrics", "healthz": "healthz"}
MAX_PATH = 1024  # bytes of a raw path: a store key is far shorter (S3's own limit is 1024)


class BadPath(ValueError):
    """The request names nothing the relay serves (400 for a malformed path, 404 for another
    namespace or a key outside the store's layout, 414 for a path too long to be a key)."""

    def __init__(self, message: str, status: int = 400):
        self.status = status
        super().__init__(message)


def _components(raw_path: str) -> list:
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        raise BadPath("the request path must start with '/'")
    if len(path) > MAX_PATH:
        raise BadPath(f"the request path is {len(path)} bytes long; no key of a store is longer than {MAX_PATH}",
                      414)
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
    if len(parts) == 1 and parts[0] in ROOT_ENDPOINTS:
        return ROOT_ENDPOINTS[parts[0]], ""
    want = mount.split("/") if mount else []
    if parts[:len(want)] != want:
        raise BadPath("not in this relay's namespace", 404)
    rest = parts[len(want):]
    if len(rest) == 1 and rest[0] in ENDPOINTS:
        return ENDPOINTS[rest[0]], ""
    try:
        key = check_key("/".join(rest))
    except StoreError as e:
        raise BadPath(str(e)) from None
    if not is_store_key(key):
        raise BadPath("not a key of a nemo-dcr store (HEAD, versions/<v>/<id>/manifest.json or a part): a relay "
                      "forwards nothing else", 404)
    return "key", key
