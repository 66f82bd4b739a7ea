"""Object stores for deltas and checkpoints: a local directory or an S3 bucket.

>>> from nemo_dcr.stores import open_store
>>> store = open_store("s3://bucket/runs/7")      # or "file:///abs/dir", or "some/dir"
>>> store = open_store("http://relay:8470/runs/7")  # a relay's read side (nemo-dcr relay)
>>> store.put("v1/delta.dcr", blob)

See :class:`Store` for the operations and their guarantees.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from .base import NotFound, PreconditionFailed, Store, StoreError
from .fallback import FallbackStore
from .http import HttpStore, StoreUnavailable
from .local import LocalStore
from .s3 import S3Store  # boto3 is imported only when an S3Store is made

__all__ = [
    "Store", "LocalStore", "S3Store", "open_store", "open_reader", "StoreError", "NotFound",
    "PreconditionFailed", "HttpStore", "FallbackStore", "StoreUnavailable",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def open_store(url: str | os.PathLike | list, **kwargs) -> Store:
    """Open the store that ``url`` names.

    * ``file:///abs/path`` or a plain path (relative or absolute): :class:`LocalStore`.
    * ``s3://bucket/prefix``: :class:`S3Store`. The endpoint is ``endpoint_url=`` if given,
      else ``$NEMO_DCR_S3_ENDPOINT``, else ``$AWS_ENDPOINT_URL``, else AWS. Credentials and
      region come the standard boto3 way. Other keyword arguments go to ``S3Store``.
    * ``http://host:port[/prefix]``: :class:`HttpStore`, the read side served by a relay.
    * a list of these: :class:`FallbackStore`, reading from the first that answers (a relay,
      its ancestors, the store itself), read-only; keyword arguments go to every source.

    Anything else raises :class:`StoreError`.
    """
    if isinstance(url, Store):
        return url
    if isinstance(url, (list, tuple)):
        if len(url) == 1:
            return open_store(url[0], **kwargs)
        return FallbackStore([open_store(u, **kwargs) for u in url])
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise StoreError(f"invalid store URL {url!r}: expected a path, file:// or s3:// URL")
    m = _SCHEME.match(url)
    if m is None:
        return LocalStore(url, **kwargs)
    scheme = m.group(1).lower()
    parts = urlsplit(url)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StoreError(
                f"invalid store URL {url!r}: file:// URLs must name a local absolute path "
                "(file:///abs/path), not a host"
            )
        if parts.query or parts.fragment:
            raise StoreError(f"invalid store URL {url!r}: no query or fragment allowed")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise StoreError(f"invalid store URL {url!r}: file:// needs an absolute path")
        return LocalStore(path, **kwargs)
    if scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise StoreError(f"invalid store URL {url!r}: expected s3://bucket[/prefix]")
        if parts.query or parts.fragment:
            raise StoreError(f"invalid store URL {url!r}: no query or fragment allowed")
        if "endpoint_url" not in kwargs:
            kwargs["endpoint_url"] = (
                os.environ.get("NEMO_DCR_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
                or None
            )
        return S3Store(bucket, unquote(parts.path).strip("/"), **kwargs)
    if scheme in ("http", "https"):
        return HttpStore(url, **kwargs)
    raise StoreError(
        f"unsupported store URL {url!r}: unknown scheme {scheme!r} "
        "(supported: file:///abs/path, s3://bucket/prefix, http://relay:port/prefix, "
        "or a plain directory path)"
    )


def open_reader(url, **kwargs) -> Store:
    """:func:`open_store` for a reader (a follower, a rollout loader, ``pull``): a local path that
    does not exist is an error, not a new empty store that the reader would then wait on forever
    (a mistyped path). Only a publisher creates a store."""
    if isinstance(url, (list, tuple)) and len(url) != 1:
        return FallbackStore([open_reader(u, **kwargs) for u in url])
    if isinstance(url, (list, tuple)):
        url = url[0]
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if isinstance(url, str) and (_SCHEME.match(url) is None or url.lower().startswith("file://")):
        return open_store(url, create=False, **kwargs)
    return open_store(url, **kwargs)
