import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The official SAGE/RLVER scenario files are not in the repo; they sit in shared/ beside the
# checkout when available (RLVER_DATA overrides).
OFFICIAL_DATA = os.environ.get("RLVER_DATA", os.path.join(ROOT, "..", "shared", "data", "rlver"))


def vllm_here() -> bool:
    """vLLM is installed, or required (CI sets RLVER_REQUIRE_VLLM=1: there a test that needs it
    must run and fail, never skip, when it is missing)."""
    return os.environ.get("RLVER_REQUIRE_VLLM") == "1" or importlib.util.find_spec("vllm") is not None


def bad_json_files(tmp_path) -> dict:
    """Scenario files a new user might pass by mistake: "LATIN1" (a valid first line, then a
    line that is not UTF-8) and "DEEP" (a JSON line nested 200k levels deep)."""
    latin1, deep = tmp_path / "latin1.jsonl", tmp_path / "deep.jsonl"
    latin1.write_bytes(open(os.path.join(ROOT, "data", "scenarios_test.jsonl"), "rb").readline()
                       + '{"id": "caf\u00e9"}\n'.encode("latin-1"))
    deep.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    return {"LATIN1": latin1, "DEEP": deep}


def interruptible():
    """For subprocess.Popen(preexec_fn=...): the child takes Ctrl-C as a terminal would deliver
    it. A shell that starts a job in the background (`cmd &`, nohup, some CI runners) sets SIGINT
    to "ignore", children inherit that, and Python then installs no KeyboardInterrupt handler:
    the SIGINT a test sends would do nothing."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
