"""A real S3-compatible HTTP server (moto) on 127.0.0.1, and ``S3Store``s on it for tests.

The fixtures ``moto_s3`` (one server per session) and ``store`` (local and S3) in tests/conftest.py
are built from these.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

BUCKET = "nemo-dcr-test"
_counter = itertools.count()


@dataclass(frozen=True)
class MotoS3:
    endpoint_url: str
    bucket: str


class _Serialized:
    """WSGI wrapper handling one request at a time.

    moto checks ``If-Match``/``If-None-Match`` and then writes, without a lock between the
    two, so under a threaded server two racing conditional writes can both pass (measured with
    moto 5.2.5 and sys.setswitchinterval(1e-5): a 16-thread compare-and-set counter lost an
    increment in 4 of 30 runs, and moto raised "I/O operation on closed file" internally).
    Real S3 makes each conditional write atomic; serializing the requests gives the test
    server that property without changing what the client sees.
    """

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        with self.lock:
            return list(self.app(environ, start_response))


# dummy credentials and a config that cannot reach AWS: what a client of the test server needs
DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/nemo-dcr-test-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/nemo-dcr-test-aws-credentials",
}


@contextmanager
def moto_server(host: str = "127.0.0.1"):
    """A moto S3 server on ``host`` (default 127.0.0.1; bench/netenv.py puts one inside an
    emulated region) over HTTP with one bucket; dummy credentials in the environment while it
    runs. Skips the test when boto3 or moto's server is not installed."""
    pytest.importorskip("boto3", reason="S3 store tests need boto3 (pip install boto3)")
    pytest.importorskip("moto.moto_server.werkzeug_app",
                        reason="S3 store tests need pip install 'moto[server]'")
    import boto3
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    mp = pytest.MonkeyPatch()
    for name, value in DUMMY_AWS_ENV.items():
        mp.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "NEMO_DCR_S3_ENDPOINT"):
        mp.delenv(name, raising=False)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    app = _Serialized(DomainDispatcherApplication(create_backend_app))
    server = make_server(host, 0, app, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
    thread.start()
    endpoint = f"http://{host}:{server.server_port}"
    try:
        boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name="us-east-1"
        ).create_bucket(Bucket=BUCKET)
        yield MotoS3(endpoint, BUCKET)
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()
        mp.undo()


def make_s3_store(moto: MotoS3, request, **kwargs):
    """A fresh S3Store under a prefix unique to this test; fast retries for tests."""
    from nemo_dcr.stores import S3Store

    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60].strip("-")
    kwargs.setdefault("max_attempts", 2)
    kwargs.setdefault("retries", 3)
    kwargs.setdefault("backoff_base", 0.01)
    kwargs.setdefault("backoff_max", 0.1)
    return S3Store(moto.bucket, f"t{next(_counter):04d}-{name}", endpoint_url=moto.endpoint_url,
                   **kwargs)
