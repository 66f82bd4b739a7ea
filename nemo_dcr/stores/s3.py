"""A store in an S3 bucket (AWS S3 or anything speaking its API: MinIO, Ceph RGW, moto, ...).

The object ``a/b`` of ``S3Store("bkt", "runs/7")`` is ``s3://bkt/runs/7/a/b``.

* Plain writes are atomic on S3 by nature (``PutObject`` and ``CompleteMultipartUpload``
  replace the object whole). Large files go through boto3's managed transfer
  (``upload_file``/``download_file`` with a :class:`boto3.s3.transfer.TransferConfig`):
  multipart, parts in parallel. Downloads land in a hidden temporary file next to the
  destination and are renamed into place only when complete.
* ``open_writer`` streams: the bytes go up as the parts of a multipart upload while the
  writer is still being written (at most ``max_concurrency`` parts in flight), and
  ``CompleteMultipartUpload`` at ``commit`` makes the object appear whole; an object smaller
  than ``multipart_threshold`` is one ``PutObject`` at commit; ``abort`` (or a failed part)
  aborts the upload, so no part is left billed.
* ``put_if_absent`` is ``PutObject`` with ``If-None-Match: *``, ``put_if_match`` is
  ``PutObject`` with ``If-Match: <etag>``; the tag is the ETag. 412 ``PreconditionFailed``
  becomes :class:`PreconditionFailed`; 409 ``ConditionalRequestConflict`` (another
  conditional write to the key in flight) is retried a bounded number of times and then also
  becomes :class:`PreconditionFailed`. The server must implement conditional writes (AWS S3
  does since 2024-08 for If-None-Match and 2024-11 for If-Match; MinIO does; check others):
  this class does not emulate them.
* Retries, two layers: botocore's own (``Config(retries={"total_max_attempts":
  max_attempts, "mode": "standard"})``: throttling, 5xx, connection errors; ``max_attempts``
  counts every request, the first included, per attempt of ours), and around each
  whole operation a bounded loop with exponential backoff and jitter (``retries`` extra
  attempts, delays ``backoff_base * 2**n`` capped at ``backoff_max``, between 50 and 100 %
  of that) for connection errors, throttling (SlowDown, 503, RequestTimeout,
  ThrottlingException, ...) and errors while streaming a body. After that a
  :class:`StoreError` says what failed, where, and after how many attempts.
* A conditional write that was retried after a connection error is ambiguous: the first
  attempt may have been applied before the connection dropped, so the retry reports
  PreconditionFailed against our own write. In that case the object is read back; if it holds
  exactly the bytes we wrote, the write is reported as successful. (If another writer
  changed it in between, the ambiguity cannot be resolved and PreconditionFailed is raised.)
"""

from __future__ import annotations

import functools
import io
import os
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from nemo_dcr.util.atomic import replacing
from nemo_dcr.util.extras import require

from .base import NotFound, PreconditionFailed, Store, StoreError, check_key, check_prefix
from .writer import ObjectWriter

__all__ = ["S3Store"]

T = TypeVar("T")
MiB = 1 << 20

_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_CONFLICT_CODES = {"ConditionalRequestConflict"}
_RETRY_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottled", "RequestThrottledException", "TooManyRequestsException",
    "ProvisionedThroughputExceededException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504",
    "PriorRequestNotComplete", "EC2ThrottledException",
}
_RETRY_STATUS = {429, 500, 502, 503, 504}


def _import_boto():
    require("boto3", "s3", "S3 stores")
    require("botocore", "s3", "S3 stores")


class _Retryable(Exception):
    def __init__(self, cause: BaseException, final: StoreError | None = None):
        self.cause = cause
        self.final = final  # what to raise instead of a generic error when retries run out


class S3Store(Store):
    """An S3 bucket (optionally under a key prefix) used as an object store.

    ``client``: a ready boto3 S3 client to use as is (its own retry settings then apply);
    otherwise one is made with ``endpoint_url`` and ``region_name`` (credentials the
    standard boto3 way: environment, shared files, instance role, ...).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        client=None,
        max_concurrency: int = 8,
        multipart_threshold: int = 8 * MiB,
        *,
        multipart_chunksize: int | None = None,
        region_name: str | None = None,
        max_attempts: int = 5,
        retries: int = 3,
        backoff_base: float = 0.5,
        backoff_max: float = 20.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ):
        _import_boto()
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not bucket or "/" in bucket:
            raise StoreError(f"invalid S3 bucket name {bucket!r}")
        prefix = (prefix or "").strip("/")
        if prefix:
            try:
                check_key(prefix)
            except StoreError as e:
                raise StoreError(f"invalid S3 prefix {prefix!r}: {e}") from None
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.retries = max(0, int(retries))
        self.backoff_base = float(backoff_base)
        self.backoff_max = float(backoff_max)
        self._rng = random.Random()

        if client is None:
            cfg = Config(
                # total_max_attempts counts the first request too ("max_attempts" in a
                # client Config would count only the retries)
                retries={"total_max_attempts": max(1, int(max_attempts)), "mode": "standard"},
                max_pool_connections=max(10, int(max_concurrency) + 4),
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            )
            try:
                client = boto3.session.Session().client(
                    "s3", endpoint_url=endpoint_url, region_name=region_name, config=cfg
                )
            except Exception as e:
                raise StoreError(f"cannot create an S3 client for {self.url}: {e}") from e
        self.client = client
        self.endpoint_url = client.meta.endpoint_url

        tc = dict(
            multipart_threshold=int(multipart_threshold),
            multipart_chunksize=int(multipart_chunksize or max(5 * MiB, multipart_threshold)),
            max_concurrency=int(max_concurrency),
            use_threads=int(max_concurrency) > 1,
        )
        try:
            self._transfer = TransferConfig(preferred_transfer_client="classic", **tc)
        except TypeError:  # older boto3
            self._transfer = TransferConfig(**tc)
        self._multipart_threshold = int(multipart_threshold)
        self._part_size = tc["multipart_chunksize"]
        self._max_concurrency = max(1, int(max_concurrency))

    # -- keys ------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str) -> str:
        if not key:
            return self.url
        return f"{self.url}/{key}"

    # -- errors and retries ----------------------------------------------------------------

    def _classify(self, op: str, key: str, e: BaseException) -> BaseException:
        """Turn a boto exception into a StoreError to raise, or a _Retryable."""
        from boto3.exceptions import RetriesExceededError, S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError,
            ChecksumError,
            ClientError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
            PartialCredentialsError,
        )
        from botocore.exceptions import (
            ConnectionError as BotoConnectionError,
        )

        where = self._where(key)
        if isinstance(e, S3UploadFailedError) and isinstance(e.__context__, ClientError):
            e = e.__context__
        if isinstance(e, ClientError):
            err = e.response.get("Error", {}) or {}
            meta = e.response.get("ResponseMetadata", {}) or {}
            code = str(err.get("Code", ""))
            status = meta.get("HTTPStatusCode")
            msg = err.get("Message") or str(e)
            if code == "NoSuchBucket":
                return StoreError(f"S3 {op} {where}: bucket {self.bucket!r} does not exist")
            if code in _NOT_FOUND_CODES or status == 404:
                return NotFound(key, self.url)
            if code in _PRECONDITION_CODES or status == 412:
                pf = PreconditionFailed(key, f"{msg} ({code or status})")
                pf.retried = bool(meta.get("RetryAttempts"))
                return pf
            if code in _CONFLICT_CODES or (status == 409 and "Conditional" in code):
                return _Retryable(e, PreconditionFailed(
                    key, f"conflicting conditional write in progress ({code})"))
            if code in _RETRY_CODES or status in _RETRY_STATUS:
                return _Retryable(e)
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return StoreError(f"S3 {op} {where}: access denied ({code}): {msg}")
            return StoreError(f"S3 {op} {where} failed: {code or status}: {msg}")
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(
                f"S3 {op} {where}: no usable AWS credentials ({e}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use an instance/pod role"
            )
        if isinstance(e, (BotoConnectionError, HTTPClientError, IncompleteReadError,
                          ChecksumError, RetriesExceededError)):
            return _Retryable(e)
        if isinstance(e, BotoCoreError):
            return StoreError(f"S3 {op} {where} failed: {e}")
        return e

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one whole operation), retrying transient failures with backoff."""
        attempt = 0
        while True:
            try:
                return fn()
            except StoreError:
                raise
            except Exception as e:
                c = self._classify(op, key, e)
                if isinstance(c, PreconditionFailed):
                    c.retried = getattr(c, "retried", False) or attempt > 0
                if not isinstance(c, _Retryable):
                    if c is e:
                        raise
                    raise c from e
                if attempt >= self.retries:
                    if c.final is not None:
                        c.final.retried = attempt > 0
                        raise c.final from e
                    raise StoreError(
                        f"S3 {op} {self._where(key)} failed after {attempt + 1} attempt(s) "
                        f"(endpoint {self.endpoint_url or 'AWS default'}): "
                        f"{type(c.cause).__name__}: {c.cause}"
                    ) from e
                cap = min(self.backoff_max, self.backoff_base * (2 ** attempt))
                time.sleep(cap * (0.5 + 0.5 * self._rng.random()))
                attempt += 1

    # -- reads -----------------------------------------------------------------------------

    def _get_object(self, key: str) -> tuple[bytes, str]:
        def go():
            r = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
            with r["Body"] as body:
                data = body.read()
            return data, r["ETag"]
        return self._call("get", key, go)

    def get(self, key: str) -> bytes:
        return self._get_object(key)[0]

    def get_with_tag(self, key: str) -> tuple[bytes, str]:
        return self._get_object(key)

    def get_if_changed(self, key: str, tag: str) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        def go():
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._full(key), IfNoneMatch=tag)
            except ClientError as e:
                if (e.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") == 304:
                    return None  # Not Modified: the object's ETag is still ``tag``
                raise
            with r["Body"] as body:
                data = body.read()
            return data, r["ETag"]
        return self._call("get", key, go)

    def get_to_file(self, key: str, path: str | os.PathLike) -> None:
        full = self._full(key)
        dest = os.path.abspath(os.fspath(path))
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
        except OSError as e:
            raise StoreError(f"get_to_file({key!r}) -> {dest}: {e}") from e

        def download(tmp):
            # boto3 downloads parts in parallel with ranged GETs pinned to the first ETag
            # (If-Match), so an object replaced mid-download fails with 412 instead of
            # yielding a mix of two versions; we then start over.
            def go():
                self.client.download_file(self.bucket, full, tmp, Config=self._transfer)

            for n in range(3):
                try:
                    self._call("get_to_file", key, go)
                    return
                except PreconditionFailed:
                    if n == 2:
                        raise StoreError(
                            f"S3 get_to_file {self._where(key)}: the object kept changing "
                            "during the download") from None

        try:
            with replacing(dest) as tmp:  # temp next to dest, fsync, rename; removed on failure
                download(tmp)
        except OSError as e:
            raise StoreError(f"get_to_file({key!r}) -> {dest} failed: {e}") from e

    def get_stream(self, key: str, offset: int = 0) -> tuple[int, Iterator[bytes]]:
        full = self._full(key)
        offset = max(0, int(offset))
        if offset:
            # S3 answers a range starting at the end of the object with 416, not an empty body
            size = self.size(key)
            if offset >= size:
                return size, iter(())
        r = self._call("get_stream", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=full, **({"Range": f"bytes={offset}-"} if offset else {})))
        size = int(r["ContentRange"].rsplit("/", 1)[1]) if offset else int(r["ContentLength"])

        def chunks() -> Iterator[bytes]:
            body = r["Body"]
            # read1: pass on what arrived (up to 1 MiB) without waiting for a whole MiB, as the
            # relay client does: a receiver applies a format-3 object's segments while the rest
            # arrives, and paces its downloads by what the link delivers (botocore's iter_chunks
            # waits for each full chunk: an object under 1 MiB came in one piece, at its end)
            read1 = getattr(getattr(body, "_raw_stream", None), "read1", None)
            try:
                if read1 is None:
                    yield from body.iter_chunks(MiB)
                    return
                got, want = 0, size - offset
                while got < want:
                    b = read1(min(MiB, want - got))
                    if not b:
                        raise StoreError(f"S3 get_stream {self._where(key)}: the download broke off after {got} "
                                         f"of {want} bytes")
                    got += len(b)
                    yield b
            except StoreError:
                raise
            except Exception as e:  # a dropped connection mid-body: the reader may resume
                c = self._classify("get_stream", key, e)
                raise (c if isinstance(c, StoreError) else StoreError(
                    f"S3 get_stream {self._where(key)}: the download broke off: "
                    f"{type(e).__name__}: {e}")) from e
            finally:
                body.close()

        return size, chunks()

    def size(self, key: str) -> int:
        full = self._full(key)
        r = self._call("size", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        return int(r["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        strip = len(base)

        def go():
            keys = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    keys.append(obj["Key"][strip:])
            return keys

        return sorted(self._call("list", prefix, go))

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        data = self._check_data(key, data)
        full = self._full(key)
        if len(data) >= self._multipart_threshold:
            self._call("put", key, lambda: self.client.upload_fileobj(
                io.BytesIO(data), self.bucket, full, Config=self._transfer))
        else:
            self._call("put", key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=full, Body=data))

    def drop_unfinished(self, prefix: str, stale: Callable[[str], bool]) -> int:
        """Aborts the incomplete multipart uploads under ``prefix`` of the keys ``stale`` names
        (their parts are stored, and billed, until then)."""
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        cut = len(self.prefix) + 1 if self.prefix else 0
        uploads: list[tuple[str, str]] = []
        kw: dict = {"Bucket": self.bucket, "Prefix": full}
        while True:
            r = self._call("list", prefix, functools.partial(self.client.list_multipart_uploads, **kw))
            uploads += [(u["Key"], u["UploadId"]) for u in r.get("Uploads", [])]
            if not r.get("IsTruncated"):
                break
            kw.update(KeyMarker=r["NextKeyMarker"], UploadIdMarker=r["NextUploadIdMarker"])
        dropped = 0
        for k, uid in uploads:
            if stale(k[cut:]):
                self._abort_upload(k, uid)
                dropped += 1
        return dropped

    def _abort_upload(self, full_key: str, upload_id: str) -> None:
        key = full_key[len(self.prefix) + 1:] if self.prefix else full_key
        self._call("abort", key, lambda: self.client.abort_multipart_upload(
            Bucket=self.bucket, Key=full_key, UploadId=upload_id))

    def open_writer(self, key: str) -> ObjectWriter:
        if self._put_overridden(S3Store):
            return super().open_writer(key)
        return _S3Writer(self, key)

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        full = self._full(key)
        src = os.fspath(path)
        if not os.path.isfile(src):
            raise StoreError(f"put_file({key!r}): not a readable file: {src}")
        try:
            self._call("put_file", key, lambda: self.client.upload_file(
                src, self.bucket, full, Config=self._transfer))
        except OSError as e:
            raise StoreError(f"put_file({key!r}): cannot read {src}: {e}") from e

    def put_if_absent(self, key: str, data: bytes) -> None:
        data = self._check_data(key, data)
        full = self._full(key)
        try:
            self._call("put_if_absent", key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*"))
        except PreconditionFailed as e:
            if getattr(e, "retried", False) and self._holds(key, data):
                return  # our own earlier attempt landed before its connection dropped
            raise

    def put_if_match(self, key: str, data: bytes, tag: str) -> str:
        tag = self._check_tag(key, tag)
        data = self._check_data(key, data)
        full = self._full(key)
        try:
            r = self._call("put_if_match", key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=full, Body=data, IfMatch=tag))
        except NotFound:
            raise PreconditionFailed(key, "the object does not exist (any more)") from None
        except PreconditionFailed as e:
            if getattr(e, "retried", False):
                try:
                    current, current_tag = self.get_with_tag(key)
                except NotFound:
                    raise e from None
                if current == data:
                    return current_tag
            raise
        return r["ETag"]

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.get(key) == data
        except NotFound:
            return False

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._call("delete", key, lambda: self.client.delete_object(
                Bucket=self.bucket, Key=full))
        except NotFound:
            pass


class _S3Writer(ObjectWriter):
    """A multipart upload fed as the bytes come (see the module docstring). Nothing here waits
    on the server while the writer is written: the upload is created, and each part sent, on
    the writer's own threads (a round trip to a far region would otherwise stall the encode
    that feeds it); ``commit`` waits for them and completes the upload."""

    def __init__(self, store: S3Store, key: str):
        super().__init__(key)
        self.store, self.full = store, store._full(key)
        self._buf = bytearray()
        self._upload: Future | None = None  # -> the upload id
        self._parts: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None

    def _write(self, mv: memoryview) -> None:
        self._buf += mv
        threshold = max(self.store._multipart_threshold, self.store._part_size)
        while len(self._buf) >= (self.store._part_size if self._upload else threshold):
            self._send(bytes(self._buf[:self.store._part_size]))
            del self._buf[:self.store._part_size]

    def _send(self, data: bytes) -> None:
        st = self.store
        if self._upload is None:
            # one more thread than parts in flight: the creation never waits behind a part
            self._pool = ThreadPoolExecutor(st._max_concurrency + 1, thread_name_prefix="nemo-dcr-s3-part")
            self._upload = self._pool.submit(lambda: st._call("open_writer", self.key, lambda: (
                st.client.create_multipart_upload(Bucket=st.bucket, Key=self.full)["UploadId"])))
        assert self._pool is not None
        while len([f for f in self._parts if not f.done()]) >= st._max_concurrency:
            next(f for f in self._parts if not f.done()).result()  # bounded memory: wait for room
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        number, upload = len(self._parts) + 1, self._upload

        def part() -> dict:
            upload_id = upload.result()
            return {"PartNumber": number, "ETag": st._call("write", self.key, lambda: st.client.upload_part(
                Bucket=st.bucket, Key=self.full, UploadId=upload_id, PartNumber=number, Body=data))["ETag"]}

        self._parts.append(self._pool.submit(part))

    def _flush(self) -> None:
        for f in self._parts:
            f.result()

    def _commit(self) -> None:
        st = self.store
        if self._upload is None:  # under the threshold: the store's own put (one PutObject)
            data = bytes(self._buf)
            self._buf = bytearray()
            S3Store.put(st, self.key, data)
            return
        if self._buf or not self._parts:
            self._send(bytes(self._buf))  # the last part may be smaller than a part
            self._buf = bytearray()
        parts = [f.result() for f in self._parts]
        upload_id = self._upload.result()
        st._call("commit", self.key, lambda: st.client.complete_multipart_upload(
            Bucket=st.bucket, Key=self.full, UploadId=upload_id, MultipartUpload={"Parts": parts}))
        self._close_pool()

    def _abort(self) -> None:
        self._buf = bytearray()
        upload, self._upload = self._upload, None
        self._close_pool()
        if upload is not None and not upload.cancelled() and upload.exception() is None:  # (done: pool shut down)
            self.store._abort_upload(self.full, upload.result())

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
