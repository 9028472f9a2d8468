import json
import os

import pytest

from evaluate import CachedBackend, format_table, load_transcripts, main, summarize
from fake_openai import FakeOpenAIServer

HAND_MADE = [
    {"scenario_id": "a", "emotion": 100, "outcome": "success", "turns": 3, "emotion_trace": [40, 70, 90, 100],
     "reply_lengths": [10, 20, 30]},
    {"scenario_id": "b", "emotion": 5, "outcome": "failure", "turns": 2, "emotion_trace": [40, 20, 5], "reply_lengths": [4, 6]},
    {"scenario_id": "c", "emotion": 50, "outcome": "max_turns", "turns": 10, "emotion_trace": [40] * 10 + [50],
     "reply_lengths": [10] * 10},
    {"scenario_id": "d", "emotion": 60, "outcome": "goodbye", "turns": 5, "emotion_trace": [40, 60], "reply_lengths": [50] * 5},
    {"scenario_id": "e", "emotion": 40, "outcome": "simulator_error", "turns": 0, "valid": False, "emotion_trace": [40],
     "reply_lengths": []},
    # Never appraised (the token budget stopped it before the first turn): no score, not an error.
    {"scenario_id": "f", "emotion": 40, "outcome": "max_tokens", "turns": 0, "valid": False, "emotion_trace": [40],
     "reply_lengths": []},
]


def test_metrics_of_hand_made_transcripts_exact(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in HAND_MADE))
    s = summarize(load_transcripts(str(p)))
    assert s == {"dialogues": 6, "scored": 4, "sentient_score": (100 + 5 + 50 + 60) / 4, "success_rate": 0.25,
                 "failure_rate": 0.25, "mean_turns": (3 + 2 + 10 + 5) / 4,
                 "mean_reply_length": (60 + 10 + 100 + 250) / 20, "simulator_errors": 1, "unscored": 1}


def test_other_systems_format_and_json_list(tmp_path):
    p = tmp_path / "other.json"
    p.write_text(json.dumps([{"id": "x", "emo_point": 80, "dialog": [{"role": "user", "content": "hi"},
                                                                      {"role": "assistant", "content": "hello!"}]},
                             {"id": "y", "emo_point": 0}]))
    s = summarize(load_transcripts(str(p)))
    assert (s["sentient_score"], s["failure_rate"], s["mean_reply_length"], s["mean_turns"]) == (40.0, 0.5, 6.0, 0.5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"emotion": 3}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no numeric final emotion"):
        load_transcripts(str(bad))


def test_score_cli_prints_table_and_writes_summary_and_plot(tmp_path, capsys):
    p = tmp_path / "hand.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in HAND_MADE))
    assert main(["--score", str(p), "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Sentient" in out and "53.8" in out and "25.0%" in out
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert summary["results"]["hand"]["sentient_score"] == 53.75
    assert os.path.getsize(tmp_path / "out" / "emotion_trajectories.png") > 1000


def test_tiny_model_plays_the_protocol(tmp_path, capsys):
    out = tmp_path / "ev"
    rc = main(["--model", "tiny", "--limit", "3", "--max-new-tokens", "16", "--output-dir", str(out)])
    assert rc == 0
    recs = load_transcripts(str(out / "tiny" / "transcripts.jsonl"))
    assert len(recs) == 3
    for r in recs:
        assert r["emotion_trace"][0] == 40 and 1 <= r["turns"] <= 10 and len(r["emotion_trace"]) == r["turns"] + 1
        assert r["history"][0]["role"] == "user"
    assert "tiny" in capsys.readouterr().out


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert main(["--model", "./nope", "--output-dir", str(tmp_path)]) == 2
    assert "--model ./nope: no model there" in capsys.readouterr().err
    assert main(["--score", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such transcript file" in capsys.readouterr().err


def test_interrupted_evaluation_resumes_without_repaying_calls(tmp_path):
    args = ["--model", "tiny", "--limit", "3", "--max-new-tokens", "8", "--max-turns", "3", "--batch-size", "1",
            "--simulator", "openai", "--simulator-model", "fake", "--output-dir", str(tmp_path / "a")]
    with FakeOpenAIServer() as srv:
        full = args[:-1] + [str(tmp_path / "full")]
        assert main(full + ["--simulator-base-url", srv.base_url]) == 0
        n_full = len(srv.requests)
    assert n_full == 3 * (2 * 3 - 1)  # 3 dialogues x (3 appraisals + 2 replies)

    # Interrupt the same evaluation in the middle of the second dialogue.
    calls = {"n": 0}
    orig = CachedBackend.chat
    def crashing(self, messages, **kw):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return orig(self, messages, **kw)
    with FakeOpenAIServer() as srv:
        CachedBackend.chat = crashing
        try:
            with pytest.raises(KeyboardInterrupt):
                main(args + ["--simulator-base-url", srv.base_url])
        finally:
            CachedBackend.chat = orig
        first = len(srv.requests)
        assert first == 7 and len(load_transcripts(str(tmp_path / "a" / "tiny" / "transcripts.jsonl"))) == 1
        assert main(args + ["--simulator-base-url", srv.base_url]) == 0
        assert len(srv.requests) == n_full  # nothing paid twice
        assert main(args + ["--simulator-base-url", srv.base_url]) == 0  # a finished run costs nothing
        assert len(srv.requests) == n_full
    a = load_transcripts(str(tmp_path / "a" / "tiny" / "transcripts.jsonl"))
    b = load_transcripts(str(tmp_path / "full" / "tiny" / "transcripts.jsonl"))
    assert [(r["scenario_id"], r["emotion_trace"]) for r in a] == [(r["scenario_id"], r["emotion_trace"]) for r in b]


def test_table_format():
    t = format_table({"m": summarize([{**r, "valid": r.get("valid", True)} for r in HAND_MADE])})
    assert t.splitlines()[0].split()[:3] == ["model", "n", "Sentient"]
