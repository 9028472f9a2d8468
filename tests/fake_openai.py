"""A real HTTP server on 127.0.0.1 that speaks the chat-completions protocol, for tests and
benchmarks. It plays a trivial simulated user and can inject faults per request:
"500", "429", "timeout" (sleeps past the client's timeout), "garbage" (unparseable content),
"blank" (empty content), "badbody" (HTTP 200 with a body that is not JSON), "nan" / "inf" (an
appraisal whose change is the JSON literal NaN / Infinity), "list" / "number" (`content` that is
a list of parts / a number, not a string), "deep" (JSON nested 100k levels deep), and what real servers
sometimes send: "surrogate" (every
string of the answer's JSON holds a lone surrogate escape, \\ud83d: valid JSON, not UTF-8 text),
"surrogate_raw" (the content string itself holds one), "length" (an appraisal cut off mid-JSON,
finish_reason "length", its prose saying "change: -8"), "400" (a 400 that is not about JSON
mode: context too long), "trickle" (the body one byte every `trickle` seconds), "huge" (an answer
whose every string is padded to 5 MB), "echo_key" (a 500 whose body echoes the Authorization header), "dup" (the change
twice), "str55" (the change as the string "5.5").

An endpoint that cannot work: `api_key` (every request without that bearer key is answered
401, /models too) and `models` (a chat request for another model is answered 404).

Two ways to choose faults: a fixed list consumed one per request (`faults=[...]`), or
`fault_rate=p`: each request draws a fault from `fault_kinds` with probability p, decided by a
hash of (seed, request messages, how many times these messages were seen), so the draw is the
same whatever order concurrent requests arrive in. At most `max_faults_in_a_row` faults hit the
same messages in a row, so a client that retries enough always gets a good answer, and the
final scores must equal those of a fault-free run exactly.

It also adds a latency per call, fixed or varying (log-normal around `latency`, with a share of
calls `slow_factor` times slower: an LLM server under load), and records the peak number of
requests in flight."""
from __future__ import annotations

import hashlib
import json
import math
import random
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
            "deep": "[" * 100_000 + "]" * 100_000,
            "length": '{"analysis": "That hurt. I would say change: -8, because',
            "dup": '{"analysis": "x", "change": 3, "change": -8}', "str55": '{"analysis": "x", "change": "5.5"}'}


def padded(answer: str, tail: str) -> str:
    """The answer's JSON with `tail` appended to every string value."""
    obj = json.loads(answer)
    return json.dumps({k: v + tail if isinstance(v, str) else v for k, v in obj.items()})


class FakeOpenAIServer:
    def __init__(self, faults=None, latency: float = 0.0, hang: float = 2.0, responder=default_user,
                 json_mode: bool = True, fault_rate: float = 0.0, fault_kinds=FAULT_KINDS,
                 max_faults_in_a_row: int = 2, seed: int = 0, port: int = 0, api_key: str | None = None,
                 models=None, trickle: float = 0.2, latency_sigma: float = 0.0, slow_share: float = 0.0,
                 slow_factor: float = 5.0, schema: bool = True, schema_refusal=(400, "response_format json_schema "
                                                                                   "unsupported"),
                 json_object: bool = True):
        self.faults = list(faults or [])  # consumed one per chat request, then "ok"
        self.fault_rate, self.fault_kinds, self.seed = fault_rate, tuple(fault_kinds), seed
        self.max_faults_in_a_row, self.seen = max_faults_in_a_row, {}
        self.latency, self.hang, self.responder = latency, hang, responder
        self.json_mode = json_mode  # False: answer 400 to response_format, like some servers
        self.schema = schema  # False: JSON mode only, a json_schema response_format refused:
        self.schema_refusal = schema_refusal  # with this (status, message)
        self.json_object = json_object  # False: a json_object response_format refused (400), a schema taken
        self.api_key, self.models, self.trickle = api_key, models, trickle
        self.latency_sigma, self.slow_share, self.slow_factor = latency_sigma, slow_share, slow_factor
        self.rng = random.Random(seed)
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

            def refused(self) -> bool:
                if server.api_key is not None and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._send(401, b'{"error": {"message": "Incorrect API key provided"}}')
                    return True
                return False

            def do_GET(self):
                if self.refused():
                    return
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
                    if self.refused():
                        return
                    if server.models is not None and req.get("model") not in server.models:
                        return self._send(404, json.dumps({"error": {"message": f"model {req.get('model')} does "
                                                                                "not exist"}}).encode())
                    if server.latency:
                        time.sleep(server.call_latency())
                    if "response_format" in req and not server.json_mode:
                        return self._send(400, b'{"error": {"message": "response_format unsupported"}}')
                    if req.get("response_format", {}).get("type") == "json_object" and not server.json_object:
                        return self._send(400, b'{"error": {"message": "response_format json_object unsupported"}}')
                    if req.get("response_format", {}).get("type") == "json_schema" and not server.schema:
                        status, message = server.schema_refusal
                        return self._send(status, json.dumps({"error": {"message": message}}).encode())
                    if fault == "500":
                        return self._send(500, b'{"error": {"message": "boom"}}', [("retry-after-ms", "10")])
                    if fault == "429":
                        return self._send(429, b'{"error": {"message": "slow down"}}', [("retry-after-ms", "10")])
                    if fault == "timeout":
                        time.sleep(server.hang)
                        return self._send(500, b'{"error": {"message": "late"}}')
                    if fault == "badbody":
                        return self._send(200, b"this is not json{")
                    if fault == "400":
                        return self._send(400, b'{"error": {"message": "maximum context length exceeded"}}')
                    if fault == "400format":  # a refusal that names the format, whatever was asked
                        return self._send(400, b'{"error": {"message": "response_format unsupported"}}')
                    if fault == "echo_key":
                        echo = json.dumps(
                            {"error": {"message": f"bad request from {self.headers.get('Authorization')}"}})
                        return self._send(500, echo.encode())
                    content = _CONTENT[fault] if fault in _CONTENT else server.responder(req["messages"])
                    if fault == "echo_key_ok":  # a 200 whose answer does not parse, and echoes the key
                        content = f"cannot read a request from {self.headers.get('Authorization')}"
                    if fault == "surrogate":  # an escape in the JSON text: "\\ud83d"
                        content = padded(content, "\ud83d")
                    if fault == "surrogate_raw":  # the character itself in the content string
                        content = content.replace('": "', '": "\ud83d', 1)
                    if fault == "huge":
                        content = padded(content, "x" * 5_000_000)
                    body = {"id": "x", "object": "chat.completion", "created": 0, "model": req.get("model", "fake"),
                            "choices": [{"index": 0, "finish_reason": "length" if fault == "length" else "stop",
                                         "message": {"role": "assistant", "content": content}}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                    data = json.dumps(body).encode()
                    if fault != "trickle":
                        return self._send(200, data)
                    self.send_response(200)  # the headers at once, then one byte at a time
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    for i in range(len(data)):
                        try:
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                        except (BrokenPipeError, ConnectionResetError):
                            return
                        time.sleep(server.trickle)
                finally:
                    with server.lock:
                        server.in_flight -= 1

        ThreadingHTTPServer.request_queue_size = 256  # bursts of 64+ concurrent connections
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def call_latency(self) -> float:
        """This call's latency: `latency` x exp(N(0, sigma)), slow_factor times that for a
        slow_share of the calls."""
        with self.lock:
            t = self.latency * math.exp(self.rng.gauss(0.0, self.latency_sigma)) if self.latency_sigma else self.latency
            if self.slow_share and self.rng.random() < self.slow_share:
                t *= self.slow_factor
        return t

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
    ap.add_argument("--latency-sigma", type=float, default=0.0)
    ap.add_argument("--slow-share", type=float, default=0.0)
    ap.add_argument("--slow-factor", type=float, default=5.0)
    a = ap.parse_args()
    with FakeOpenAIServer(latency=a.latency, latency_sigma=a.latency_sigma, slow_share=a.slow_share,
                          slow_factor=a.slow_factor) as srv:
        print(srv.base_url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
