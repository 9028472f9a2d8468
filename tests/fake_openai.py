"""A real HTTP server on 127.0.0.1 that speaks the chat-completions protocol, for tests and
benchmarks. It plays a trivial simulated user and can inject faults per request:
"500", "429", "timeout" (sleeps past the client's timeout), "garbage" (unparseable content),
"blank" (empty content), "badbody" (HTTP 200 with a body that is not JSON). It also adds an
optional fixed latency per call and records the peak number of requests in flight."""
from __future__ import annotations

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


class FakeOpenAIServer:
    def __init__(self, faults=None, latency: float = 0.0, hang: float = 2.0, responder=default_user,
                 json_mode: bool = True):
        self.faults = list(faults or [])  # consumed one per chat request, then "ok"
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
                    fault = server.faults.pop(0) if server.faults else "ok"
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
                    content = {"garbage": "I feel... hmm, not sure what to say",
                               "blank": ""}.get(fault) or server.responder(req["messages"])
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
