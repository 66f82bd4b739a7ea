"""A store that passes every operation to another one: the base of wrappers that change a few."""
from __future__ import annotations

from collections.abc import Iterator

from .base import Store


class PassThroughStore(Store):
    """Every read and write goes to ``inner``; subclasses override what they change (a verified
    store checks HEAD and manifests as they are read)."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_with_tag(self, key: str) -> tuple[bytes, str]:
        return self.inner.get_with_tag(key)

    def get_if_changed(self, key: str, tag: str) -> tuple[bytes, str] | None:
        return self.inner.get_if_changed(key, tag)

    def get_stream(self, key: str, offset: int = 0) -> tuple[int, Iterator[bytes]]:
        return self.inner.get_stream(key, offset)

    def get_to_file(self, key: str, path) -> None:
        self.inner.get_to_file(key, path)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def put_file(self, key: str, path) -> None:
        self.inner.put_file(key, path)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(key, data)

    def put_if_match(self, key: str, data: bytes, tag: str) -> str:
        return self.inner.put_if_match(key, data, tag)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def drop_unfinished(self, prefix: str, stale) -> int:
        return self.inner.drop_unfinished(prefix, stale)

    def report(self, receiver: str, version: int | None) -> None:
        self.inner.report(receiver, version)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


__all__ = ["PassThroughStore"]
