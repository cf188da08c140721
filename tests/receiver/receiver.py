"""A webhook receiver for keyfence's tests: a real HTTP server that checks
every delivery with the Standard Webhooks reference library
(`standardwebhooks` from PyPI) and tells the test what arrived.

    python receiver.py          prints "listening on PORT", then serves

Each endpoint is a path, /hooks/NAME, set up by the test first:

    PUT /endpoints/NAME   {"secret": "whsec_...", "fail": 0, "status": 500,
                           "retry_after": null, "delay_ms": 0}
        The first `fail` attempts of each webhook-id (or every attempt, with
        "fail": "all") are answered `status` (with `Retry-After` if given);
        later ones 204. Every answer waits `delay_ms` first. A PUT again
        changes the behaviour and keeps what arrived.
    GET /endpoints/NAME/log
        Every attempt in arrival order: webhook_id, at, type, data, valid (the
        library verified it), error, answered (null while it is being
        answered), overlapping (another attempt of the same webhook-id was
        being answered when it arrived).
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

lock = threading.Lock()
endpoints = {}  # name -> {"behaviour": {...}, "log": [...], "seen": {id: attempts}, "busy": {id: n}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, body=b"", headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        if body:
            self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def body(self):
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def do_PUT(self):
        parts = self.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "endpoints":
            return self.answer(404)
        behaviour = json.loads(self.body())
        with lock:
            endpoint = endpoints.setdefault(parts[1], {"log": [], "seen": {}, "busy": {}})
            endpoint["behaviour"] = behaviour
        self.answer(204)

    def do_GET(self):
        parts = self.path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "endpoints" or parts[2] != "log":
            return self.answer(404)
        with lock:
            log = list(endpoints.get(parts[1], {}).get("log", []))
        self.answer(200, json.dumps(log).encode())

    def do_POST(self):
        parts = self.path.strip("/").split("/")
        with lock:
            endpoint = endpoints.get(parts[1]) if len(parts) == 2 and parts[0] == "hooks" else None
        if endpoint is None:
            return self.answer(404)
        body = self.body()
        behaviour = endpoint["behaviour"]
        entry = {"webhook_id": self.headers.get("webhook-id"), "valid": False, "error": None, "answered": None,
                 "at": time.time()}
        try:
            event = Webhook(behaviour["secret"]).verify(body, dict(self.headers.items()))
            entry.update(valid=True, type=event.get("type"), data=event.get("data"), timestamp=event.get("timestamp"))
        except (WebhookVerificationError, ValueError, KeyError) as e:
            entry["error"] = str(e) or type(e).__name__
        hook_id = entry["webhook_id"]
        with lock:
            attempt = endpoint["seen"].get(hook_id, 0) + 1
            endpoint["seen"][hook_id] = attempt
            entry["overlapping"] = endpoint["busy"].get(hook_id, 0) > 0
            endpoint["busy"][hook_id] = endpoint["busy"].get(hook_id, 0) + 1
            endpoint["log"].append(entry)
        try:
            time.sleep(behaviour.get("delay_ms", 0) / 1000)
            fail = behaviour.get("fail", 0)
            headers = []
            if not entry["valid"]:
                status = 400
            elif fail == "all" or attempt <= fail:
                status = behaviour.get("status", 500)
                if behaviour.get("retry_after") is not None:
                    headers.append(("retry-after", str(behaviour["retry_after"])))
            else:
                status = 204
            entry["answered"] = status
            self.answer(status, headers=headers)
        finally:
            with lock:
                endpoint["busy"][hook_id] -= 1


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
