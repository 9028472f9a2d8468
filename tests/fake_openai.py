"""A real HTTP server on 127.0.0.1 that speaks the chat-completions protocol, for tests and
benchmarks. It plays a trivial simulated user and can inject faults per request:
"500", "429", "timeout" (sleeps past the client's timeout), "garbage" (unparseable content),
"blank" (empty content), "badbody" (HTTP 200 with a body that is not JSON), "nan" / "inf" (an
appraisal whose change is the JSON literal NaN / Infinity), "list" / "number" (`content` that is
a list of parts / a number, not a string), "deep" (JSON nested 100k levels deep).

Two ways to choose faults: a fixed list consumed one per request (`faults=[...]`), or
`fault_rate=p`: each request draws a fault from `fault_kinds` with probability p, decided by a
hash of (seed, request messages, how many times these messages were seen), so the draw is the
same whatever order concurrent requests arrive in. At most `max_faults_in_a_row` faults hit the
same messages in a row, so a client that retries enough always gets a good answer, and the
final scores must equal those of a fault-free run exactly.

It also adds an optional fixed latency per call and records the peak number of requests in
flight."""
from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def default_user(messages: list[dict]) -> str:
    """A trivial LLM user: answers each of the simulator's three prompts in JSON."""
    system = messages[0]["content"]
    if "Appraise the friend" in system or "评估朋友" in system:
        return json.dumps({"analysis": "They listened.", "change": 3})
    return json.dumps({"thinking": "a bit better", "reply": "Thanks, that helps.", "goodbye": False})


def varied_user(messages: list[dict]) -> str:
    """A user whose emotion change depends on the agent's words (in [-4, 5]): a replayed or
    misrouted answer would change the scores, so 'scores equal the fault-free run' means something."""
    system, last = messages[0]["content"], messages[-1]["content"]
    h = int(hashlib.sha256(last.encode()).hexdigest(), 16)
    if "Appraise the friend" in system or "评估朋友" in system:
        return json.dumps({"analysis": "hm", "change": h % 10 - 4})
    return json.dumps({"thinking": "t", "reply": f"I see ({h % 97}).", "goodbye": False})


FAULT_KINDS = ("500", "429", "garbage", "blank", "badbody", "nan", "inf", "list", "number")
# What a fault sends as the message content (None: the fault is not about the content).
_CONTENT = {"garbage": "I feel... hmm, not sure what to say", "blank": "",
            "nan": '{"analysis": "x", "change": NaN}', "inf": '{"analysis": "x", "change": Infinity}',
            "list": [{"type": "text", "text": '{"analysis": "x", "change": 1}'}], "number": 42,
            "deep": "[" * 100_000 + "]" * 100_000}


class FakeOpenAIServer:
    def __init__(self, faults=None, latency: float = 0.0, hang: float = 2.0, responder=default_user,
                 json_mode: bool = True, fault_rate: float = 0.0, fault_kinds=FAULT_KINDS,
                 max_faults_in_a_row: int = 2, seed: int = 0):
        self.faults = list(faults or [])  # consumed one per chat request, then "ok"
        self.fault_rate, self.fault_kinds, self.seed = fault_rate, tuple(fault_kinds), seed
        self.max_faults_in_a_row, self.seen = max_faults_in_a_row, {}
        self.latency, self.hang, self.responder = latency, hang, responder
        self.json_mode = json_mode  # False: answer 400 to response_format, like some servers
        self.lock = threading.Lock()
        self.requests, self.in_flight, self.peak_in_flight = [], 0, 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

            def log_message(self, *a):  # keep test output quiet
                pass

            def _send(self, code, body: bytes, headers=()):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                if self.path.endswith("/models"):
                    self._send(200, json.dumps({"object": "list", "data": [
                        {"id": "fake", "object": "model", "created": 0, "owned_by": "test"}]}).encode())
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n) or b"{}")
                with server.lock:
                    fault = server.faults.pop(0) if server.faults else server.draw(req.get("messages"))
                    server.requests.append({"body": req, "fault": fault,
                                            "auth": self.headers.get("Authorization", "")})
                    server.in_flight += 1
                    server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
                try:
                    if server.latency:
                        time.sleep(server.latency)
                    if "response_format" in req and not server.json_mode:
                        return self._send(400, b'{"error": {"message": "response_format unsupported"}}')
                    if fault == "500":
                        return self._send(500, b'{"error": {"message": "boom"}}', [("retry-after-ms", "10")])
                    if fault == "429":
                        return self._send(429, b'{"error": {"message": "slow down"}}', [("retry-after-ms", "10")])
                    if fault == "timeout":
                        time.sleep(server.hang)
                        return self._send(500, b'{"error": {"message": "late"}}')
                    if fault == "badbody":
                        return self._send(200, b"this is not json{")
                    content = _CONTENT[fault] if fault in _CONTENT else server.responder(req["messages"])
                    body = {"id": "x", "object": "chat.completion", "created": 0, "model": req.get("model", "fake"),
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": content}}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                    self._send(200, json.dumps(body).encode())
                finally:
                    with server.lock:
                        server.in_flight -= 1

        ThreadingHTTPServer.request_queue_size = 256  # bursts of 64+ concurrent connections
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def draw(self, messages) -> str:
        """The fault-rate mode's choice for this request (called under the lock)."""
        if not self.fault_rate:
            return "ok"
        key = json.dumps(messages, sort_keys=True)
        k = self.seen.get(key, 0)  # faults these messages got in a row so far
        h = hashlib.sha256(f"{self.seed}|{k}|{key}".encode()).digest()
        if k < self.max_faults_in_a_row and int.from_bytes(h[:4], "little") < self.fault_rate * 2 ** 32:
            self.seen[key] = k + 1
            return self.fault_kinds[h[4] % len(self.fault_kinds)]
        self.seen[key] = 0
        return "ok"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":  # a stand-alone server (benchmarks run it in its own process)
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency", type=float, default=0.0)
    a = ap.parse_args()
    with FakeOpenAIServer(latency=a.latency) as srv:
        print(srv.base_url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
