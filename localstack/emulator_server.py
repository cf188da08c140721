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
- It exits promptly on SIGTERM and SIGINT, even under load.
"""

import argparse
import bisect
import itertools
import os
import signal
import sys
import threading

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.dynamodb.models.dynamo_type import DynamoType
from moto.dynamodb.models.table import Table
from werkzeug.serving import ThreadedWSGIServer, make_server

ORDER = "_keyfence_scan_order"


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
