"""A linearizable DynamoDB emulator for keyfence's local stack and tests.

moto's server answers each request on its own thread, and its DynamoDB
backend evaluates a ConditionExpression and applies the write without a
lock. Two conditional writes on one item can then both pass their condition,
which real DynamoDB never allows and which would make every fencing test
meaningless. This wrapper serves moto's WSGI application behind a single
lock, so each request (including reading its body and producing its whole
response) is one atomic step. Throughput is unchanged: moto is bound by
Python's GIL either way.

It also exits promptly on SIGTERM and SIGINT, even under load.
"""

import argparse
import os
import signal
import sys
import threading

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import ThreadedWSGIServer, make_server


class Serialized:
    """WSGI middleware that runs one request at a time, start to finish."""

    def __init__(self, app):
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        with self._lock:
            # Materialize the body inside the lock: a lazy iterator would let
            # the backend run part of the request after the lock is released.
            return [b"".join(self._app(environ, start_response))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4566)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))

    # 200 clients connecting at once must not overflow the accept queue.
    ThreadedWSGIServer.request_queue_size = 1024
    ThreadedWSGIServer.daemon_threads = True
    app = Serialized(DomainDispatcherApplication(create_backend_app))
    server = make_server(
        args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler
    )

    def stop(signum, frame):
        # shutdown() blocks until serve_forever returns, so call it elsewhere.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"keyfence emulator listening on http://{args.host}:{args.port}", flush=True)
    server.serve_forever(poll_interval=0.2)
    sys.exit(0)


if __name__ == "__main__":
    main()
