"""A moto S3 server as its own process (``python -m nemo_dcr.chaos.s3server --port P``), so the
chaos harness can SIGKILL it and start it again *empty* on the same port, as a store that lost
its data would look to every client.

Requests are served one at a time: moto checks ``If-Match``/``If-None-Match`` and then writes
without a lock between the two, where real S3 makes each conditional write atomic.
"""
from __future__ import annotations

import argparse
import logging
import threading


class _Serialized:
    def __init__(self, app):
        self.app, self.lock = app, threading.Lock()

    def __call__(self, environ, start_response):
        with self.lock:
            return list(self.app(environ, start_response))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = _Serialized(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", a.port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"s3server ready on {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
