"""A linearizable DynamoDB emulator for keyfence's local stack and tests.

moto's server answers each request on its own thread, and its DynamoDB
backend evaluates a ConditionExpression and applies the write without a
lock. Two conditional writes on one item can then both pass their condition,
which real DynamoDB never allows and which would make every fencing test
meaningless. This wrapper serves moto's WSGI application behind a single
lock, so each request (including reading its body and producing its whole
response) is one atomic step. Throughput is unchanged: moto is bound by
Python's GIL either way.

Two more departures from stock moto, both towards real DynamoDB:
- Scans of a table without a sort key cost what the page holds. moto sorts
  the whole table and hashes every item's segment on every page, so a full
  scan grows with the square of the table; here the sorted keys of each
  segment are kept until an item is added or removed, and a page starts by
  bisecting to its ExclusiveStartKey. Items, limits, filters and the
  LastEvaluatedKey are still moto's own.
- Connections are kept alive, as DynamoDB's own endpoints keep them:
  werkzeug's development server closes every connection after one reply,
  which would make each SDK call pay for a new TCP connection. Every request
  body is read whole before the application sees it, so the next request on
  the connection starts where werkzeug expects it.
- It exits promptly on SIGTERM and SIGINT, even under load.

And one addition for tests, a fault switch (see localstack/README.md):
``POST /_keyfence/faults`` arms a fault for the next ``count`` requests of
one operation on one table, ``DELETE /_keyfence/faults?table=T`` disarms
that table's faults. Three kinds:
- ``{"table": T, "operation": "DeleteItem", "count": 1, "action":
  "drop_reply", "delay_ms": 1500}``: the request is applied, then its reply
  is held back ``delay_ms`` (other requests are served meanwhile) and the
  connection is closed without one, so the client's SDK retries a write that
  has already landed;
- ``{"table": T, "operation": "PutItem", "count": 3, "action": "error",
  "code": "ThrottlingException"}``: the request is answered with that
  DynamoDB error and not applied (``InternalServerError`` is a 500,
  ``ServiceUnavailable`` a 503, any other code a 400).
- ``{"table": T, "operation": "PutItem", "count": 1000, "action":
  "omit_item"}``: the request is applied as usual, but a failed
  condition is answered without the item it failed on, as dynalite
  answers (it ignores ``ReturnValuesOnConditionCheckFailure``).
"""

import argparse
import bisect
import collections
import io
import itertools
import json
import os
import selectors
import signal
import sys
import threading
import time
from urllib.parse import parse_qs

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.dynamodb.models.dynamo_type import DynamoType
from moto.dynamodb.models.table import Table
import werkzeug.serving
from werkzeug.serving import ThreadedWSGIServer, make_server

ORDER = "_keyfence_scan_order"


FAULTS_PATH = "/_keyfence/faults"
ERROR_STATUS = {"InternalServerError": "500 Internal Server Error", "ServiceUnavailable": "503 Service Unavailable"}


class Faults:
    """Faults armed by tests, each for a number of requests of one operation on one table."""

    def __init__(self):
        self._armed = []
        self._lock = threading.Lock()

    def control(self, environ, start_response):
        method = environ["REQUEST_METHOD"]
        if method == "POST":
            spec = json.loads(read_body(environ) or b"{}")
            missing = {"table", "operation", "count", "action"} - spec.keys()
            if missing or spec["action"] not in ("drop_reply", "error", "omit_item") or (
                spec["action"] == "error" and "code" not in spec
            ):
                return reply(start_response, "400 Bad Request", {"error": f"bad fault {spec}; missing {sorted(missing)}"})
            with self._lock:
                self._armed.append(dict(spec))
            return reply(start_response, "200 OK", spec)
        if method == "DELETE":
            table = parse_qs(environ.get("QUERY_STRING", "")).get("table", [None])[0]
            with self._lock:
                self._armed = [f for f in self._armed if table is not None and f["table"] != table]
            return reply(start_response, "200 OK", {})
        with self._lock:
            return reply(start_response, "200 OK", list(self._armed))

    def take(self, environ):
        """The fault armed for this request, if any (and counts it down)."""
        operation = environ.get("HTTP_X_AMZ_TARGET", "").rpartition(".")[2]
        with self._lock:
            if not operation or not self._armed:
                return None
            body = read_body(environ)
            environ["wsgi.input"] = io.BytesIO(body)
            try:
                table = json.loads(body or b"{}").get("TableName")
            except ValueError:
                return None
            for fault in self._armed:
                if fault["table"] == table and fault["operation"] == operation and fault["count"] > 0:
                    fault["count"] -= 1
                    if fault["count"] == 0:
                        self._armed.remove(fault)
                    return fault
        return None


def omit_item(app, environ, start_response):
    """Runs the request; a failed condition's reply loses the item it
    carries, as some DynamoDB implementations (dynalite) answer."""
    answer = {}

    def capture(status, headers, exc_info=None):
        answer["status"], answer["headers"] = status, headers

    body = b"".join(app(environ, capture))
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and parsed.get("__type", "").endswith("ConditionalCheckFailedException"):
        parsed.pop("Item", None)
        body = json.dumps(parsed).encode()
        headers = [(k, v) for k, v in answer["headers"] if k.lower() not in ("content-length", "x-amz-crc32")]
        answer["headers"] = headers + [("Content-Length", str(len(body)))]
    start_response(answer["status"], answer["headers"])
    return [body]


def read_body(environ):
    length = int(environ.get("CONTENT_LENGTH") or 0)
    return environ["wsgi.input"].read(length) if length else b""


def reply(start_response, status, body, headers=()):
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))] + list(headers))
    return [data]


class FairLock:
    """A lock granted in the order it was asked for.

    threading.Lock makes no promise of order: under steady load from a few
    busy connections, a request arriving on another can wait for seconds,
    which DynamoDB never does to anyone.
    """

    def __init__(self):
        self._mutex = threading.Lock()
        self._waiting = collections.deque()
        self._held = False

    def __enter__(self):
        with self._mutex:
            if not self._held:
                self._held = True
                return self
            turn = threading.Lock()
            turn.acquire()
            self._waiting.append(turn)
        turn.acquire()  # released by the holder before us, which hands the lock on
        return self

    def __exit__(self, *exc):
        with self._mutex:
            if self._waiting:
                self._waiting.popleft().release()
            else:
                self._held = False


class Serialized:
    """WSGI middleware that runs one request at a time, start to finish, in
    the order they arrive, and applies the faults tests arm."""

    def __init__(self, app):
        self._app = app
        self._lock = FairLock()
        self._faults = Faults()

    def __call__(self, environ, start_response):
        if not environ.get("wsgi.input_terminated"):
            environ["wsgi.input"] = io.BytesIO(read_body(environ))
        if environ.get("PATH_INFO") == FAULTS_PATH:
            return self._faults.control(environ, start_response)
        fault = self._faults.take(environ)
        if fault and fault["action"] == "error":
            code = fault["code"]
            body = {"__type": f"com.amazonaws.dynamodb.v20120810#{code}", "message": "injected by the keyfence emulator"}
            status = ERROR_STATUS.get(code, "400 Bad Request")
            return reply(start_response, status, body, [("x-amzn-ErrorType", code)])
        with self._lock:
            # Materialize the body inside the lock: a lazy iterator would let
            # the backend run part of the request after the lock is released.
            if fault and fault["action"] == "omit_item":
                return omit_item(self._app, environ, start_response)
            if not (fault and fault["action"] == "drop_reply"):
                return [b"".join(self._app(environ, start_response))]
            b"".join(self._app(environ, lambda *args, **kwargs: None))
        # Applied; now the reply is lost on the way back.
        time.sleep(fault.get("delay_ms", 0) / 1000)
        sock = environ.get("werkzeug.socket")
        if sock is not None:
            try:
                sock.shutdown(2)
            except OSError:
                pass
        raise ConnectionResetError("reply dropped by a keyfence emulator fault")


class KeepAliveHandler(MotoRequestHandler):
    """moto's request handler without werkzeug's ``Connection: close``."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle's algorithm the
    # second waits for the client's delayed ACK (40 ms) on a kept connection.
    disable_nagle_algorithm = True

    def send_header(self, keyword, value):
        # werkzeug closes after every reply because it cannot drain a body
        # the application left unread; Serialized reads every body whole.
        # A chunked request still closes, as werkzeug would have it.
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if keyword.lower() == "connection" and value.lower() == "close" and not chunked:
            return
        super().send_header(keyword, value)


class NothingLeftToDrain:
    """Stands in for the ``selectors`` module in werkzeug.serving.

    After each reply werkzeug reads whatever the client sent next until the
    socket goes quiet, which is safe only because it then closes the
    connection; on a kept-alive connection it would swallow the next request.
    Serialized has read every framed body whole, so there is nothing to drain.
    """

    EVENT_READ = selectors.EVENT_READ

    class DefaultSelector:
        def register(self, *args):
            pass

        def select(self, timeout=None):
            return []

        def close(self):
            pass


def forget_order_on_resize(write):
    """Wraps a Table write so that adding or removing a key drops the order."""

    def wrapped(table, *args, **kwargs):
        count = len(table.items)
        try:
            return write(table, *args, **kwargs)
        finally:
            if len(table.items) != count:
                table.__dict__.pop(ORDER, None)

    return wrapped


def segment_keys(table, segments):
    """The table's keys in scan order, only those of the requested segment."""
    order = table.__dict__.setdefault(ORDER, {})
    if segments not in order:
        keys = sorted(table.items)
        if segments != (None, None):
            keys = [k for k in keys if table.items[k].is_within_segment(segments)]
        order[segments] = keys
    return order[segments]


def linear_scans() -> None:
    """Makes each scan page of a hash-only table cost its own size."""
    scan = Table.scan

    def paged_scan(table, filters, limit, exclusive_start_key, filter_expression=None,
                   index_name=None, *rest, segments=(None, None)):
        start_key = (exclusive_start_key or {}).get(table.hash_key_attr)
        if index_name or table.range_key_attr or (exclusive_start_key and start_key is None):
            return scan(table, filters, limit, exclusive_start_key, filter_expression, index_name,
                        *rest, segments=segments)
        keys = segment_keys(table, tuple(segments))
        first = 0 if start_key is None else bisect.bisect_right(keys, DynamoType(start_key))
        items = table.items
        # moto pages through whatever all_items() yields: here only this
        # segment's keys after the start key, already in scan order.
        table.all_items = lambda: (items[k] for k in itertools.islice(keys, first, None))
        try:
            return scan(table, filters, limit, None, filter_expression, index_name, *rest,
                        segments=(None, None))
        finally:
            del table.all_items

    Table.scan = paged_scan
    Table.put_item = forget_order_on_resize(Table.put_item)
    Table.delete_item = forget_order_on_resize(Table.delete_item)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4566)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))
    linear_scans()
    werkzeug.serving.selectors = NothingLeftToDrain

    # 200 clients connecting at once must not overflow the accept queue.
    ThreadedWSGIServer.request_queue_size = 1024
    ThreadedWSGIServer.daemon_threads = True
    app = Serialized(DomainDispatcherApplication(create_backend_app))
    server = make_server(
        args.host, args.port, app, threaded=True, request_handler=KeepAliveHandler
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
