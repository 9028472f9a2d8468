import json
import logging
import os

import pytest
import torch

from conftest import OFFICIAL_DATA, ROOT, bad_json_files
from evaluate import format_table, load_transcripts, main, reply_stats, summarize
from fake_openai import FakeOpenAIServer, varied_user
from plumbing.backends import CachedBackend

HAND_MADE = [
    {"scenario_id": "a", "emotion": 100, "outcome": "success", "turns": 3, "emotion_trace": [40, 70, 90, 100],
     "reply_lengths": [10, 20, 30]},
    {"scenario_id": "b", "emotion": 5, "outcome": "failure", "turns": 2, "emotion_trace": [40, 20, 5],
     "reply_lengths": [4, 6]},
    {"scenario_id": "c", "emotion": 50, "outcome": "max_turns", "turns": 10, "emotion_trace": [40] * 10 + [50],
     "reply_lengths": [10] * 10},
    {"scenario_id": "d", "emotion": 60, "outcome": "goodbye", "turns": 5, "emotion_trace": [40, 60],
     "reply_lengths": [50] * 5},
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
    recs = load_transcripts(str(p))
    s = summarize(recs)
    assert (s["sentient_score"], s["failure_rate"], s["mean_reply_length"], s["mean_turns"]) == (40.0, 0.5, 6.0, 0.5)
    # The dialogue under "dialog" is read as ours, "history", by --reply-stats and the judges (was:
    # validated, then left under "dialog", so --reply-stats counted 0 replies and judges saw none).
    assert recs[0]["history"][1]["content"] == "hello!" and reply_stats(recs)["replies"] == 1
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
    text = capsys.readouterr().out
    summary = json.load(open(out / "summary.json"))
    # the run ends with what it measured and where everything went
    assert text.rstrip().endswith(
        f"done: 1 rows (Sentient: tiny {summary['results']['tiny']['sentient_score']:.1f})\n"
        f"  figures:     {out / 'summary.json'}\n  dialogues:   {out / 'tiny' / 'transcripts.jsonl'}\n"
        f"  plot:        {out / 'emotion_trajectories.png'}"), text[-600:]


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert main(["--model", "./nope", "--output-dir", str(tmp_path)]) == 2
    assert "--model ./nope: no model there" in capsys.readouterr().err
    assert main(["--score", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such transcript file" in capsys.readouterr().err


def test_interrupted_evaluation_resumes_without_repaying_calls(tmp_path, capsys):
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
        try:  # issue 23 item 8: Ctrl-C is one line saying what was saved (it was a traceback)
            assert main(args + ["--simulator-base-url", srv.base_url]) == 130
        finally:
            CachedBackend.chat = orig
        line = capsys.readouterr().err.splitlines()[-1]
        assert line.startswith("evaluate.py: interrupted; saved in") and "1 of 3 dialogues of tiny" in line
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


def test_tiny_model_scores_lower_against_the_challenging_user(tmp_path):
    # 2 turns: the random model's replies sink both users (its replies end no sentence, which the
    # rule user docks since issue 39), and by turn 3 the standard user nears the floor the
    # challenging one ends at, which would hide the gap between them.
    scores = {}
    for user in ("standard", "challenging"):
        out = tmp_path / user
        assert main(["--model", "tiny", "--limit", "3", "--max-new-tokens", "8", "--max-turns", "2",
                     "--user", user, "--output-dir", str(out)]) == 0
        summary = json.load(open(out / "summary.json"))
        assert summary["protocol"]["user"] == user
        assert summary["protocol"]["initial_emotion"] == {"standard": 40, "challenging": 30}[user]
        recs = load_transcripts(str(out / "tiny" / "transcripts.jsonl"))
        assert all(r["emotion_trace"][0] == summary["protocol"]["initial_emotion"] for r in recs)
        scores[user] = summary["results"]["tiny"]["sentient_score"]
    assert scores["challenging"] < scores["standard"] - 10, scores


def test_evaluation_ignores_the_checkpoints_generation_config(tmp_path, monkeypatch):
    """A checkpoint's generation_config.json (Qwen2.5: repetition_penalty 1.05, top_k 20, ...)
    must not shape evaluation decoding: greedy is the argmax of the raw logits at every step,
    and summary.json records the complete sampling recipe."""
    import evaluate
    from test_rollout import recording_policy
    model, tok, calls = recording_policy(seed=2)
    monkeypatch.setattr(evaluate, "load_for_eval", lambda m, seed: (model.eval(), tok))
    assert main(["--model", "tiny", "--limit", "2", "--max-new-tokens", "12", "--max-turns", "2",
                 "--output-dir", str(tmp_path)]) == 0
    assert calls
    for out in calls:
        for scores, logits in zip(out.scores, out.logits):
            assert torch.equal(scores, logits)
    sampling = json.load(open(tmp_path / "summary.json"))["protocol"]["sampling"]
    assert sampling["do_sample"] is False and sampling["repetition_penalty"] == 1.0
    assert main(["--score", str(tmp_path / "tiny" / "transcripts.jsonl"), "--temperature", "0.7",
                 "--output-dir", str(tmp_path / "s")]) == 0
    sampling = json.load(open(tmp_path / "s" / "summary.json"))["protocol"]["sampling"]
    assert sampling == {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0, "typical_p": 1.0,
                        "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0,
                        "no_repeat_ngram_size": 0, "num_beams": 1}


# ---------------------------------------------------------------- issue 14: faults, reruns, bad input

SMALL = ["--model", "tiny", "--max-new-tokens", "8", "--max-turns", "2", "--batch-size", "4"]
OPENAI = ["--simulator", "openai", "--simulator-model", "fake", "--simulator-timeout", "5"]


def transcript(d, label="tiny"):
    return [(r["scenario_id"], r["outcome"], r["emotion_trace"]) for r in
            load_transcripts(os.path.join(d, label, "transcripts.jsonl"))]


def test_fault_rate_evaluation_scores_exactly_as_fault_free_and_counts_retries(tmp_path, caplog):
    """Items 1, 2, 9: 40% of the simulator's answers are faults of every kind (500, 429,
    unparseable, blank, NaN/Infinity change, list/number content). The cache used to store each
    answer before it was parsed, so a retry replayed the same bad answer and the dialogue was
    lost (and NaN crashed the run). Now the scores equal a fault-free run's exactly, each fault
    is one counted retry, a rerun pays nothing, and no per-request HTTP line is logged."""
    caplog.set_level(logging.INFO)
    args = SMALL + ["--limit", "4"] + OPENAI
    with FakeOpenAIServer(responder=varied_user) as srv:
        assert main(args + ["--simulator-base-url", srv.base_url, "--output-dir", str(tmp_path / "clean")]) == 0
    with FakeOpenAIServer(responder=varied_user, fault_rate=0.4) as srv:
        out = str(tmp_path / "faulty")
        assert main(args + ["--simulator-base-url", srv.base_url, "--output-dir", out]) == 0
        n = len(srv.requests)
        assert main(args + ["--simulator-base-url", srv.base_url, "--output-dir", out]) == 0
        assert len(srv.requests) == n  # the rerun replays every paid call from the cache
    assert transcript(out) == transcript(tmp_path / "clean")
    assert all(o != "simulator_error" for _, o, _ in transcript(out))
    kinds = [r["fault"] for r in srv.requests]
    first = json.load(open(os.path.join(out, "summary.json")))  # (the rerun's summary: 0 retries)
    assert first["results"]["tiny"]["parse_retries"] == 0
    faulty_log = [r.getMessage() for r in caplog.records if r.name == "simulator"]
    assert sum("unparseable" in m or "backend error" in m for m in faulty_log) == sum(
        k not in ("ok", "500", "429") for k in kinds) > 0
    assert not [r for r in caplog.records if r.name.startswith("httpx")]  # item 9: httpx2 silenced


def test_retry_counts_reach_the_summary(tmp_path):
    """Item 9: per-model transport and parse retries in summary.json."""
    with FakeOpenAIServer(faults=["500", "garbage", "429", "429", "blank"]) as srv:
        assert main(SMALL + ["--limit", "1", "--batch-size", "1"] + OPENAI +
                    ["--simulator-base-url", srv.base_url, "--output-dir", str(tmp_path)]) == 0
    s = json.load(open(tmp_path / "summary.json"))["results"]["tiny"]
    assert (s["transport_retries"], s["parse_retries"], s["simulator_errors"]) == (3, 2, 0)


def test_never_appraised_dialogues_are_not_scored(tmp_path, capsys):
    """Item 5: a token budget too small for one turn: no dialogue is appraised; it used to be
    scored with its initial emotion (Sentient 40.0). Issue 46 item 2: a model with no scored
    dialogue exits 1, its table and files written."""
    assert main(["--model", "tiny", "--limit", "2", "--max-total-tokens", "20", "--output-dir", str(tmp_path)]) == 1
    s = json.load(open(tmp_path / "summary.json"))["results"]["tiny"]
    assert (s["scored"], s["unscored"], s["simulator_errors"], s["sentient_score"]) == (0, 2, 0, None)
    out, err = capsys.readouterr()
    row = [line for line in out.splitlines() if line.startswith("tiny")][0].split()
    assert row[1:3] == ["0", "-"]
    assert err.strip().splitlines()[-1] == ("evaluate.py: error: no dialogue of tiny was scored (0 simulator errors, 2 "
                                            "never appraised; no reply was appraised: play again with a larger "
                                            "--max-total-tokens or --max-new-tokens, into another --output-dir or "
                                            f"after removing {tmp_path / 'tiny'})")


def test_rerun_replays_simulator_errors_once_the_simulator_is_back(tmp_path):
    """Item 6: a simulator_error dialogue is replayed on a rerun (the transcript keeps one line
    per scenario); --no-replay-errors keeps the old behaviour."""
    args = SMALL + ["--limit", "2"] + OPENAI
    down = dict(fault_rate=1.0, fault_kinds=("garbage",), max_faults_in_a_row=10 ** 9)
    for d, replay in (("a", []), ("b", ["--no-replay-errors"])):
        out = ["--output-dir", str(tmp_path / d)]
        with FakeOpenAIServer(**down) as srv:
            assert main(args + ["--simulator-base-url", srv.base_url] + out) == 1  # nothing scored (issue 46)
            port = srv.port
        assert [o for _, o, _ in transcript(tmp_path / d)] == ["simulator_error"] * 2
        with FakeOpenAIServer(port=port) as srv:  # back, at the same address
            assert main(args + ["--simulator-base-url", srv.base_url] + out + replay) == (1 if replay else 0)
        t = transcript(tmp_path / d)
        assert len(t) == 2
        assert all((o == "simulator_error") == bool(replay) for _, o, _ in t), t


def test_a_torn_transcript_line_is_dropped_and_its_dialogue_replayed(tmp_path):
    """Item 6: a kill in the middle of writing a transcript line used to stop every rerun with
    a traceback."""
    args = SMALL + ["--limit", "3", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    path = tmp_path / "tiny" / "transcripts.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) - len(whole.splitlines()[-1]) // 2 - 1])  # half the last line
    assert main(args) == 0
    assert path.read_bytes() == whole


@pytest.mark.parametrize("flags,msg", [
    (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
    (["--limit", "-1"], "--limit -1: must be >= 1"),
    (["--max-turns", "0"], "--max-turns 0: must be >= 1"),
    (["--initial-emotion", "500"], "--initial-emotion 500: must be in [0, 100]"),
    (["--simulator-concurrency", "0"], "--simulator-concurrency 0: must be >= 1"),
    (["--simulator-timeout", "-1"], "--simulator-timeout -1.0: must be a number in (0, 86400]"),
    (["--scenarios", "LATIN1"], "latin1.jsonl:2: not UTF-8"),
    (["--scenarios", "DEEP"], "deep.jsonl:1: JSON nested too deeply"),
    # issue 38 item 8: passed the check, then OverflowError in plumbing/engines.py
    (["--engine", "vllm", "--vllm-kv-cache-gb", "inf"], "--vllm-kv-cache-gb inf: must be a number in (0, 10000]"),
    (["--fluency-model", "tiny"], "--fluency-model: give --reply-stats too"),
    (["--reply-stats", "--fluency-model", "./nope"], "--fluency-model ./nope"),
])
def test_bad_flags_are_one_line_errors(flags, msg, tmp_path, capsys):
    """Item 10: each used to be a traceback (after the model loaded) or accepted silently."""
    bad = bad_json_files(tmp_path)
    flags = [str(bad.get(f, f)) for f in flags]
    assert main(["--model", "tiny", "--output-dir", str(tmp_path / "out")] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "tiny").exists()


@pytest.mark.parametrize("line,msg", [
    ("5", "expected a JSON object"), ('["emotion"]', "expected a JSON object"),
    ('{"history": 5, "emotion": 3}', "must be a list"), ('{"turns": "x", "emotion": 3}', "'turns' must be"),
    ('{"emotion": NaN}', "not in [0, 100]"), ('{"emotion": 1000}', "not in [0, 100]"),
    ('{"emotion": -50}', "not in [0, 100]"), ("DEEP", "nested too deeply"),
])
def test_bad_score_files_are_one_line_errors(line, msg, tmp_path, capsys):
    """Item 10: `--score` lines that used to raise a traceback or be scored (Sentient 475.0)."""
    p = tmp_path / "s.jsonl"
    p.write_text('{"emotion": 50}\n' + ("[" * 200_000 if line == "DEEP" else line) + "\n")
    assert main(["--score", str(p), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "s.jsonl:2: " in err and msg in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------- issue 16: the paper's full evaluation
def _systems_seen(monkeypatch):
    """Record the system prompt of every dialogue the agent starts."""
    import rollout
    seen, orig = [], rollout.prompt_ids
    def spy(tok, system, first_user):
        seen.append(system)
        return orig(tok, system, first_user)
    monkeypatch.setattr(rollout, "prompt_ids", spy)
    return seen


@pytest.mark.parametrize("choice", ["sage", "train", "file"])
def test_eval_prompt_choice_reaches_the_agent_and_the_summary(tmp_path, monkeypatch, choice):
    """Item 5: the agent's prompt is a named choice (sage by default), recorded in summary.json."""
    from evaluate import SAGE_PROMPTS
    from rollout import build_system_prompt
    seen = _systems_seen(monkeypatch)
    want = {"sage": SAGE_PROMPTS["en"], "train": build_system_prompt(False, "en"), "file": "Be kind. Be brief."}[choice]
    arg = []
    if choice == "file":
        (tmp_path / "p.txt").write_text(want + "\n")
        arg = ["--eval-prompt", str(tmp_path / "p.txt")]
    elif choice == "train":
        arg = ["--eval-prompt", "train"]
    assert main(SMALL + ["--limit", "2", "--max-turns", "1", "--output-dir", str(tmp_path / "o")] + arg) == 0
    assert seen == [want, want]
    rec = json.load(open(tmp_path / "o" / "summary.json"))["protocol"]["eval_prompt"]
    assert rec["choice"] == (arg[1] if arg else "sage") and rec["en"] == want


def test_eval_prompt_bad_value_is_one_line_error(tmp_path, capsys):
    assert main(SMALL + ["--eval-prompt", str(tmp_path / "nope.txt"), "--output-dir", str(tmp_path)]) == 2
    assert "--eval-prompt" in capsys.readouterr().err


def _dialogue(sid, replies, users=None, trace=None):
    users = users or [f"I feel awful about my exam, turn {i}" for i in range(len(replies))]
    hist = []
    for u, a in zip(users, replies):
        hist += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    trace = trace or [40] * (len(replies) + 1)
    return {"scenario_id": sid, "emotion": trace[-1], "outcome": "max_turns", "turns": len(replies),
            "emotion_trace": trace, "history": hist}


CARING = ["That sounds really hard, it makes sense you feel awful about the exam. What happened?",
          "You worked hard for that exam. Maybe you could try talking to your teacher about a plan?",
          "I'm here for you. How are you feeling about the next exam now?"]
CARELESS = ["ok", "ok", "ok"]


def test_rule_judge_scores_caring_above_careless_and_is_deterministic():
    from judge import DIMENSIONS, RuleJudge, rule_labels
    j = RuleJudge()
    good, bad = j.judge_record(_dialogue("g", CARING)), j.judge_record(_dialogue("b", CARELESS))
    assert good == RuleJudge().judge_record(_dialogue("g", CARING))
    assert all(1 <= good["capability"][d] <= 5 and 1 <= bad["capability"][d] <= 5 for d in DIMENSIONS)
    for d in ("empathic_depth", "core_insight", "solution_crafting", "dialogue_guidance"):
        assert good["capability"][d] > bad["capability"][d], d
    assert bad["capability"]["empathic_depth"] == 1 and bad["strategies"] == [[], [], []]
    assert rule_labels("You could try a walk?", "") == ["questioning", "advice"]
    assert "validation" in good["strategies"][0] and "reflection" in good["strategies"][0]


def test_parse_judgement_is_strict():
    from judge import DIMENSIONS, parse_judgement
    full = {d: {"evaluation": "fine", "score": 3} for d in DIMENSIONS}
    assert parse_judgement(json.dumps(full)) == {d: 3 for d in DIMENSIONS}
    named = {"Empathic Depth": 5, "Core Insight": "4", "Solution Crafting": 3.0, "Dialogue Guidance": 2,
             "Style Adaptability": {"score": 1}}
    assert parse_judgement("```json\n" + json.dumps(named) + "\n```") == dict(zip(DIMENSIONS, [5, 4, 3, 2, 1]))
    for bad in (0, 6, 3.5, True, None, "3/5", float("nan")):
        assert parse_judgement(json.dumps({**full, "core_insight": {"score": bad}})) is None, bad
    assert parse_judgement(json.dumps({d: 3 for d in DIMENSIONS[:4]})) is None
    assert parse_judgement("great dialogue, 5/5") is None


def test_strategy_frequency_and_contribution_exact():
    from judge import strategy_stats
    r1 = {**_dialogue("a", ["x", "y", "z"], trace=[40, 45, 43, 53]), "strategies": [["validation"], ["advice"],
                                                                                   ["validation", "advice"]]}
    # the second dialogue's last turn was never appraised: it counts in frequency, not in SC
    r2 = {**_dialogue("b", ["u", "v"], trace=[40, 30]), "strategies": [["advice"], ["questioning"]]}
    s = strategy_stats([r1, r2, {**r1, "outcome": "simulator_error"}])
    assert s["validation"]["frequency"] == 2 / 5 and s["validation"]["contribution"] == (5 + 10) / 2
    assert s["advice"]["frequency"] == 3 / 5 and s["advice"]["contribution"] == (-2 + 10 - 10) / 3
    assert s["questioning"] == {"family": "exploratory", "turns": 1, "frequency": 1 / 5, "contribution": None}
    assert s["reframing"]["frequency"] == 0 and s["reframing"]["contribution"] is None


def judge_server(messages):
    """A fake LLM judge: scores from a hash of the conversation; never-parseable for 'BROKEN'."""
    import hashlib

    from fake_openai import default_user
    system, convo = messages[0]["content"], messages[-1]["content"]
    if "BROKEN" in convo:
        return "I would rate this dialogue quite highly overall."
    h = int(hashlib.sha256(convo.encode()).hexdigest(), 16)
    from judge import DIMENSIONS
    if system.startswith("You evaluate"):
        return json.dumps({d: {"evaluation": "ok", "score": 1 + (h >> (3 * i)) % 5} for i, d in enumerate(DIMENSIONS)})
    if system.startswith("You label"):
        n = convo.count("SUPPORTER [")
        return json.dumps({"turns": [["validation", "questioning"] if (h >> k) & 1 else ["advice"] for k in range(n)]})
    return default_user(messages)


def test_llm_judge_on_fake_server_with_faults(tmp_path, monkeypatch, caplog):
    """Item 1: the LLM judge through the local chat-completions server. 40% of answers are faults
    (500, 429, garbage, blank, NaN, lists, ...): the scores equal a fault-free run's exactly. A
    dialogue the judge never answers parseably is counted in judge_errors and left out of the
    means, never scored. A rerun replays every judgement from the cache; the key is never logged."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("JUDGE_KEY", "sk-secret-123")
    recs = [_dialogue("a", CARING, trace=[40, 50, 55, 70]), _dialogue("b", CARELESS, trace=[40, 35, 30, 20]),
            _dialogue("c", ["BROKEN reply", "again"], trace=[40, 41, 42])]
    p = tmp_path / "sys.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    summ = {}
    for mode, kw in (("clean", {}), ("faulty", {"fault_rate": 0.4})):
        with FakeOpenAIServer(responder=judge_server, **kw) as srv:
            args = ["--score", str(p), "--judge-base-url", srv.base_url, "--judge-model", "fake",
                    "--judge-api-key-env", "JUDGE_KEY", "--judge-tries", "3", "--judge-timeout", "5",
                    "--output-dir", str(tmp_path / mode)]
            assert main(args) == 0
            n = len(srv.requests)
            assert main(args) == 0
            # the rerun pays only the BROKEN dialogue's (failed, never cached) calls again
            assert len(srv.requests) - n == 2 * 3
            assert all(r["auth"] == "Bearer sk-secret-123" for r in srv.requests)
        summ[mode] = json.load(open(tmp_path / mode / "summary.json"))
        judged = load_transcripts(str(tmp_path / mode / "sys" / "judged.jsonl"))
        assert [r["capability"] is None for r in judged] == [False, False, True]
        assert judged[2]["judge_error"].startswith("unparseable")
    assert summ["clean"]["results"] == summ["faulty"]["results"]
    assert summ["clean"]["strategies"] == summ["faulty"]["strategies"]
    res = summ["clean"]["results"]["sys"]
    assert res["judged"] == 2 and res["judge_errors"] == 1 and summ["clean"]["judge"] == "llm:fake"
    caps = [r["capability"] for r in judged[:2]]
    assert res["empathic_depth"] == (caps[0]["empathic_depth"] + caps[1]["empathic_depth"]) / 2
    assert "sk-secret-123" not in caplog.text


def test_tiny_run_with_rule_judge_and_score_of_judged_file(tmp_path, capsys):
    """Items 1, 2, 6: the offline path judges every dialogue, the table and summary.json gain
    the capability columns and strategy statistics, a strategy chart is drawn, and --score of
    the judged file (without judging again) reproduces the same columns."""
    out = tmp_path / "o"
    assert main(SMALL + ["--limit", "3", "--output-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "EmpDepth" in text and "validation (affective)" in text
    s = json.load(open(out / "summary.json"))
    assert s["judge"] == "rule" and s["results"]["tiny"]["judged"] == 3
    assert set(s["strategies"]["tiny"]) == {"validation", "reassurance", "questioning", "reflection", "reframing",
                                            "advice", "sharing"}
    assert os.path.getsize(out / "strategies.png") > 1000
    assert main(["--score", str(out / "tiny" / "judged.jsonl"), "--judge", "none",
                 "--output-dir", str(tmp_path / "s")]) == 0
    s2 = json.load(open(tmp_path / "s" / "summary.json"))
    for k in ("judged", "judge_errors", "empathic_depth", "style_adaptability"):
        assert s2["results"]["judged"][k] == s["results"]["tiny"][k]
    assert s2["strategies"]["judged"] == s["strategies"]["tiny"]


def test_judge_llm_without_url_is_one_line_error(tmp_path, capsys):
    p = tmp_path / "h.jsonl"
    p.write_text(json.dumps(HAND_MADE[0]) + "\n")
    assert main(["--score", str(p), "--judge", "llm", "--output-dir", str(tmp_path)]) == 2
    assert "--judge llm needs --judge-base-url" in capsys.readouterr().err
    assert main(["--score", str(p), "--judge-tries", "0", "--output-dir", str(tmp_path)]) == 2
    assert "--judge-tries 0" in capsys.readouterr().err


CHITCHAT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "chitchat_test.jsonl")


def test_chitchat_set_and_its_simulator_prompt():
    """Item 3: >= 20 English everyday-chat scenarios, every intention covered, hidden in the goal;
    the simulator frames them as casual chat (not a problem), other scenarios are unchanged."""
    from plumbing.scenarios import load_scenarios
    from simulator import CHITCHAT_GOALS, Scenario, Simulator, UserState, appraisal_messages, reply_messages
    rows = load_scenarios(CHITCHAT)
    assert len(rows) >= 20 and len({s.id for s in rows}) == len(rows)
    assert {s.goal_type for s in rows} == set(CHITCHAT_GOALS)
    assert all(s.language == "en" and s.first_message and s.hidden_goal for s in rows)
    chat = rows[0]
    support = Scenario(id="s", persona="p", background="b", hidden_goal="g", goal_type="advice")
    for sc, casual in ((chat, True), (support, False)):
        st = UserState(scenario=sc, emotion=40, history=[{"role": "user", "content": "hi"}])
        for msgs in (appraisal_messages(st, "hello"), reply_messages(st, False)):
            system = msgs[0]["content"]
            assert ("casual, everyday chat" in system) == casual
            assert ("something that has been bothering you" in system) == (not casual)
            assert sc.hidden_goal in system
    # the offline rule user plays them too
    from rule_user import RuleBackend
    st = Simulator(RuleBackend(seed=0)).reset(chat)
    assert st.history[0]["content"] == chat.first_message


def test_chitchat_evaluation_runs_offline(tmp_path):
    out = tmp_path / "chat"
    assert main(SMALL + ["--scenarios", CHITCHAT, "--limit", "4", "--max-turns", "1", "--output-dir", str(out)]) == 0
    s = json.load(open(out / "summary.json"))
    assert s["protocol"]["scenarios"] == CHITCHAT and s["results"]["tiny"]["scored"] == 4
    ids = [r["scenario_id"] for r in load_transcripts(str(out / "tiny" / "transcripts.jsonl"))]
    assert ids == ["chat-001", "chat-002", "chat-003", "chat-004"]


def test_eval_prompt_with_think_keeps_the_format_instruction(tmp_path):
    from evaluate import SAGE_PROMPTS, eval_prompt
    from rollout import build_system_prompt
    fn, rec = eval_prompt("sage", True)
    assert fn("en").startswith(SAGE_PROMPTS["en"]) and "<think>" in fn("en") and "<think>" in rec["zh"]
    assert eval_prompt("sage", False)[0]("zh") == SAGE_PROMPTS["zh"]
    assert eval_prompt("train", True)[0]("zh") == build_system_prompt(True, "zh")


# ---------------------------------------------------------------- issue 23: faults, round three
def test_a_lone_surrogate_is_retried_never_cached_and_a_rerun_pays_again(tmp_path):
    """Item 1: a lone surrogate escape in the user's reply crashed evaluate.py (the tokenizer),
    in another field it crashed the cache's write; a rerun against a healthy server then
    crashed again with 0 requests, replaying the bad answer from simulator_cache.jsonl."""
    args = SMALL + ["--limit", "2"] + OPENAI + ["--output-dir", str(tmp_path)]
    bad = dict(fault_rate=1.0, fault_kinds=("surrogate", "surrogate_raw"), max_faults_in_a_row=10 ** 9)
    with FakeOpenAIServer(**bad) as srv:
        assert main(args + ["--simulator-base-url", srv.base_url]) == 1  # nothing scored (issue 46)
        port = srv.port
    assert [o for _, o, _ in transcript(tmp_path)] == ["simulator_error"] * 2
    cache = tmp_path / "simulator_cache.jsonl"
    assert not cache.exists() or "ud83d" not in cache.read_text().lower()
    with FakeOpenAIServer(port=port) as srv:
        assert main(args + ["--simulator-base-url", srv.base_url]) == 0
        assert len(srv.requests) > 0
    assert [o for _, o, _ in transcript(tmp_path)] == ["max_turns"] * 2


@pytest.mark.parametrize("case", ["no key", "wrong model"])
def test_an_endpoint_that_cannot_work_is_one_line(case, tmp_path, capsys, monkeypatch):
    """Item 2, for evaluate.py: found by the check (no key) or at the first call (wrong model)."""
    monkeypatch.delenv("RLVER_TEST_KEY", raising=False)
    monkeypatch.setenv("RLVER_RIGHT_KEY", "sk-right")
    env = "RLVER_TEST_KEY" if case == "no key" else "RLVER_RIGHT_KEY"
    args = SMALL + ["--limit", "2", "--simulator", "openai", "--simulator-api-key-env", env,
                    "--simulator-model", "fake" if case == "no key" else "nope", "--output-dir", str(tmp_path)]
    with FakeOpenAIServer(api_key="sk-right", models=["fake"]) as srv:
        assert main(args + ["--simulator-base-url", srv.base_url]) == 2
        # no key: nothing but the check; wrong model: at most the first call of each of the 2
        # dialogues (the second may be cancelled before it is sent), no retry
        assert len(srv.requests) == 0 if case == "no key" else 1 <= len(srv.requests) <= 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("evaluate.py: error:") and (env if case == "no key" else "--simulator-model") in line


@pytest.mark.parametrize("change", [["--max-turns", "3"], ["--initial-emotion", "50"]])
def test_a_rerun_under_another_protocol_is_refused(change, tmp_path, capsys):
    """Item 3: a rerun with another --max-turns or --initial-emotion reused the old dialogues
    and labelled them with the new protocol (mean turns 2.0 under max_turns 4)."""
    args = SMALL + ["--limit", "2", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + change) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds dialogues played under another protocol" in line and change[0][2:].replace("-", "_") in line
    assert main(args) == 0  # the same protocol reuses them


def test_the_simulator_cache_is_keyed_by_endpoint_and_model(tmp_path):
    """Item 3: after deleting transcripts.jsonl, a rerun against another server and model sent it
    0 requests and reproduced the first server's scores from simulator_cache.jsonl."""
    args = SMALL + ["--limit", "2", "--simulator", "openai", "--output-dir", str(tmp_path)]
    with FakeOpenAIServer() as srv:
        assert main(args + ["--simulator-base-url", srv.base_url, "--simulator-model", "a"]) == 0
    for name in ("transcripts.jsonl", "protocol.json"):
        os.remove(tmp_path / "tiny" / name)
    with FakeOpenAIServer(responder=varied_user) as srv:
        assert main(args + ["--simulator-base-url", srv.base_url, "--simulator-model", "b"]) == 0
        assert len(srv.requests) > 0


def test_ctrl_c_is_one_line_saying_what_was_saved(tmp_path):
    """Item 8: SIGINT ended evaluate.py in a 33-frame traceback."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, interruptible
    with FakeOpenAIServer(latency=0.3) as srv:
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "evaluate.py"), *SMALL, "--batch-size", "1",
                              "--limit", "20", *OPENAI, "--simulator-base-url", srv.base_url,
                              "--output-dir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
        path, deadline = tmp_path / "tiny" / "transcripts.jsonl", time.time() + 300
        while not (path.exists() and path.read_text().count("\n") >= 1):
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("evaluate.py:")]
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("evaluate.py: interrupted; saved in") and \
        "of 20 dialogues" in lines[0]


# ---------------------------------------------------------------- issue 29: SAGE's protocol and leaderboard
SAGE_DATA = os.path.join(os.path.dirname(OFFICIAL_DATA), "sage")
# SAGE's published leaderboard (its README; DeepSeek-V3 2024-12-27 as the simulated user):
# Sentient score, successes, failures over the 100 dialogues of each released file.
PUBLISHED = {"gpt-4.1": ("68.2", 35, 13), "gpt-4.5": ("62.7", 23, 15), "claude3.7": ("54.8", 19, 24),
             "deepseek-v3-1227": ("37.6", 5, 39), "llama3.3-70b": ("33.3", 7, 47), "gpt-4o-0808": ("31.8", 7, 51),
             "openai-o1": ("29.0", 5, 51), "qwen2.5-72b": ("19.1", 4, 70)}


def test_scores_round_half_up_as_sage_publishes_them():
    from evaluate import half_up
    assert [half_up(x) for x in (37.55, 33.25, 28.95, 68.15, 19.1, 0.05, 99.95)] == \
        ["37.6", "33.3", "29.0", "68.2", "19.1", "0.1", "100.0"]


@pytest.mark.skipif(not os.path.isdir(SAGE_DATA), reason="SAGE's released results are not here (shared/data/sage)")
def test_sages_eight_released_results_reproduce_the_published_leaderboard(tmp_path, capsys):
    """Score, successes and failures, all eight exactly (37.6 / 33.3 / 29.0 included: round half up)."""
    from evaluate import half_up, load_leaderboard
    board = load_leaderboard(SAGE_DATA)
    got = {}
    for name, recs in board.items():
        s = summarize(recs)
        got[name] = (half_up(s["sentient_score"]), round(s["success_rate"] * 100), round(s["failure_rate"] * 100))
    assert got == PUBLISHED
    assert main(["--leaderboard", SAGE_DATA, "--judge", "none", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert " 1. gpt-4.1" in out and " 8. qwen2.5-72b" in out and "DeepSeek-V3 (2024-12-27)" in out


@pytest.mark.skipif(not os.path.isdir(SAGE_DATA), reason="SAGE's released results are not here (shared/data/sage)")
def test_a_leaderboard_run_on_other_profiles_is_refused(tmp_path, capsys):
    assert main(["--leaderboard", SAGE_DATA, "--model", "tiny", "--scenarios", os.path.join(OFFICIAL_DATA,
                 "test_profile.jsonl"), "--limit", "5", "--output-dir", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("evaluate.py: error: --leaderboard") and "not the same ids" in line


def test_our_run_is_ranked_among_a_leaderboard(tmp_path, capsys):
    """The runnable example at toy size: a folder of two 'released' results on 3 profiles, and
    the tiny model (rule user) played on the same 3, ranked among them, with the chart."""
    board = tmp_path / "board"
    board.mkdir()
    ids = ["en-041", "en-042", "en-043"]
    for name, emo in (("a_result", 90), ("b_result", 5)):
        (board / f"{name}.jsonl").write_text("".join(json.dumps({"id": i, "emo_point": emo}) + "\n" for i in ids))
    scen = tmp_path / "s.jsonl"
    scen.write_text("".join(line for line in open(os.path.join(ROOT, "data", "scenarios_test.jsonl")) if
                            json.loads(line)["id"] in ids))
    out = tmp_path / "out"
    assert main(SMALL + ["--leaderboard", str(board), "--scenarios", str(scen), "--judge", "none",
                         "--output-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert " 1. a" in text and "* tiny" in text and " 3. b" in text and (out / "leaderboard.png").exists()


def test_the_default_protocol_judges_at_most_nine_replies(tmp_path):
    """SAGE's runner makes at most 10 agent replies and appraises the first 9; ours judged 10
    (emotion traces of 11 values). The default --max-turns is now 9."""
    assert main(["--model", "tiny", "--limit", "4", "--max-new-tokens", "6", "--judge", "none",
                 "--output-dir", str(tmp_path)]) == 0
    recs = transcript(tmp_path)
    assert recs and all(len(trace) <= 10 for _, _, trace in recs)
    assert json.load(open(tmp_path / "summary.json"))["protocol"]["max_turns"] == 9


def test_the_start_line_names_the_models_and_the_simulated_user(tmp_path, caplog):
    """Issue 28 item 4: evaluate.py printed no start line at all."""
    caplog.set_level(logging.INFO, logger="evaluate")
    with FakeOpenAIServer() as srv:
        assert main(SMALL + ["--limit", "1", *OPENAI, "--simulator-base-url", srv.base_url,
                             "--output-dir", str(tmp_path)]) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("models "))
    assert "models tiny" in line and srv.base_url in line and "model fake" in line and "standard user" in line


def test_rates_follow_the_rules_that_ended_the_dialogue(tmp_path):
    """Under --rules rlver a dialogue fails at emotion <= 0 and nothing ends at 100: the failure
    rate counts `outcome`, not SAGE's thresholds (they counted emotion 5 at the turn limit a
    failure). A success is SAGE's: the emotion reached 100, also where the dialogue went on
    (issue 38: under rlver the success rate was always 0). Our own transcripts may end below 0
    (no floor) and are read back (a rerun, --score)."""
    recs = [{"scenario_id": "a", "emotion": 100, "outcome": "max_turns", "turns": 3},
            {"scenario_id": "b", "emotion": 5, "outcome": "max_turns", "turns": 3},
            {"scenario_id": "c", "emotion": -4, "outcome": "failure", "turns": 2},
            {"scenario_id": "d", "emotion": 80, "outcome": "goodbye", "turns": 3, "emotion_trace": [30, 70, 100, 80]}]
    p = tmp_path / "rlver.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summarize(load_transcripts(str(p)))
    assert (s["success_rate"], s["failure_rate"], s["sentient_score"]) == (0.5, 0.25, 181 / 4)
    # another system's result (no outcome) is read by SAGE's thresholds, and must be in [0, 100]
    other = tmp_path / "other.jsonl"
    other.write_text('{"emo_point": 100}\n{"emo_point": 5}\n')
    s = summarize(load_transcripts(str(other)))
    assert (s["success_rate"], s["failure_rate"]) == (0.5, 0.5)
    other.write_text('{"emo_point": -4}\n')
    with pytest.raises(ValueError, match="not in"):
        load_transcripts(str(other))


def test_an_rlver_run_below_zero_resumes(tmp_path, capsys):
    """An interrupted evaluation under --rules rlver whose transcript holds emotion -4 is read
    back on the rerun (it exited 2: "final emotion -4 is not in [0, 100]")."""
    flags = ["--model", "tiny", "--limit", "2", "--max-turns", "2", "--max-new-tokens", "8", "--rules", "rlver",
             "--judge", "none", "--output-dir", str(tmp_path / "out")]
    assert main(flags) == 0
    path = tmp_path / "out" / "tiny" / "transcripts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["emotion"], rows[0]["outcome"] = -4, "failure"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(flags) == 0, capsys.readouterr().err
    summary = json.load(open(tmp_path / "out" / "summary.json"))["results"]["tiny"]
    assert summary["failure_rate"] == 0.5


def test_reply_stats_count_questions_sentences_and_repeats_by_hand():
    """Issue 39: --reply-stats reports what gaming the rule user looks like: questions per reply,
    the share of replies that end a sentence, the repeat rate, and the rule user's features (here
    `stacked`), each checked against numbers worked out by hand."""
    from evaluate import reply_stats
    history = [{"role": "user", "content": "I failed my exam."},
               {"role": "assistant", "content": "That sounds hard. What happened? Why? How?"},  # 3 questions, ends
               {"role": "user", "content": "I froze."},
               {"role": "assistant", "content": "Freezing sounds hard, and then you"}]  # cut off, no question
    rec = {"scenario_id": "x", "history": history, "valid": True, "outcome": "max_turns"}
    s = reply_stats([rec, {**rec, "outcome": "simulator_error"}])  # the error is left out
    assert s["replies"] == 2
    assert s["questions_per_reply"] == 1.5 and s["sentence_share"] == 0.5
    assert s["words_per_reply"] == (7 + 6) / 2
    # content words (4+ letters): {that, sounds, hard, what, happened} then {freezing, sounds, hard, then}:
    # the second repeats 2 of its 4
    assert s["repeat_rate"] == (0 + 2 / 4) / 2
    assert s["rule_stacked"] == (1.0 + 0.0) / 2 and s["rule_unfinished"] == 0.5


def test_reply_fluency_is_the_mean_logprob_of_the_reply_tokens_under_the_reader(tmp_path, capsys):
    """Issue 50, run 3: the rule user paid broken sentences that name a feeling ("It feels
    overwhelming to put - right?"); --fluency-model reports each reply's mean log-probability
    per token under a reader model given the dialogue before it. Checked against a forward pass
    worked out here (log_softmax of the logits, the reply's tokens), and end to end: the
    summary's `fluency` is the mean over the transcripts' replies."""
    from evaluate import reply_fluency, reply_stats
    from plumbing.models import make_tiny_policy
    model, tok = make_tiny_policy(seed=3, words=True)
    model.eval()
    history = [{"role": "user", "content": "I failed my exam."}, {"role": "assistant", "content": "That sounds hard."},
               {"role": "user", "content": "I froze."}, {"role": "assistant", "content": "What happened then?"},
               {"role": "assistant", "content": ""}]
    got = reply_fluency(model, tok, history)
    assert len(got) == 3 and got[2] is None
    assert reply_fluency(model, tok, [{"role": "npc", "content": "Hi."}] + history[:2])[0] is None  # nothing before it
    for k, value in ((1, got[0]), (3, got[1])):
        before = [{"role": m["role"], "content": m["content"]} for m in history[:k]]
        prompt = tok(tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids
        reply = tok(history[k]["content"], add_special_tokens=False).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reply])).logits[0].double().log_softmax(-1)
        want = sum(logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(reply)) / len(reply)
        assert value == pytest.approx(want, abs=1e-5) and value < 0
    rec = {"scenario_id": "x", "history": history[:4], "valid": True, "outcome": "max_turns"}
    assert reply_stats([rec], fluency=lambda h: reply_fluency(model, tok, h))["fluency"] == pytest.approx(
        (got[0] + got[1]) / 2)
    out = tmp_path / "out"
    assert main(["--model", "tiny", "--limit", "2", "--max-new-tokens", "8", "--max-turns", "2", "--reply-stats",
                 "--fluency-model", "tiny", "--output-dir", str(out)]) == 0
    assert "fluency" in capsys.readouterr().out
    reader, reader_tok = make_tiny_policy(seed=0, words=True)  # --fluency-model tiny at --seed 0
    reader.eval()
    recs = [json.loads(line) for line in open(out / "tiny" / "transcripts.jsonl")]
    values = [v for r in recs for v in reply_fluency(reader, reader_tok, r["history"]) if v is not None]
    assert json.load(open(out / "summary.json"))["reply_stats"]["tiny"]["fluency"] == \
        pytest.approx(sum(values) / len(values))


def test_a_fluency_reader_without_a_chat_template_is_refused_before_any_play(tmp_path, capsys):
    """Review of --fluency-model: the reader loads after every model has played, so a reader it
    cannot use (no chat template: a base, not instruct, model) was a traceback at the very end."""
    save_tiny(tmp_path / "reader", seed=0)
    os.remove(tmp_path / "reader" / "chat_template.jinja")
    out = tmp_path / "out"
    capsys.readouterr()  # the save's progress bar
    assert main(["--model", "tiny", "--limit", "1", "--reply-stats", "--fluency-model", str(tmp_path / "reader"),
                 "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--fluency-model" in err and "no chat template" in err and len(err.splitlines()) == 1, err
    assert not (out / "tiny").exists()


# ---------------------------------------------------------------- issue 38: faults, round four
def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def save_tiny(folder, seed):
    from plumbing.models import make_tiny_policy
    model, tok = make_tiny_policy(seed=seed, words=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def test_another_model_at_the_same_path_is_refused(tmp_path, capsys):
    """Item 1: a different model saved to the same --model path scored as one model with the
    first one's dialogues (n 5 = 4 of the first, 1 of the second). The weights' fingerprint is
    in protocol.json; the same weights saved again (a copy) are still the same model."""
    model = tmp_path / "final"
    save_tiny(model, seed=0)
    flags = ["--model", str(model), "--max-new-tokens", "6", "--max-turns", "2", "--judge", "none",
             "--output-dir", str(tmp_path / "out")]
    assert main(flags + ["--limit", "2"]) == 0
    save_tiny(model, seed=0)  # written again, the same weights: reused
    assert main(flags + ["--limit", "3"]) == 0
    save_tiny(model, seed=1)  # another model at the same path
    capsys.readouterr()
    assert main(flags + ["--limit", "4"]) == 2
    line = last_error(capsys)
    assert f"the weights at {model} changed since they were played" in line


def test_a_second_evaluation_in_the_same_output_dir_is_refused(tmp_path, capsys):
    """Item 2: two evaluations at once in one --output-dir played and paid every dialogue twice."""
    from plumbing.checks import lock_output_dir
    out = tmp_path / "out"
    out.mkdir()
    held = lock_output_dir(str(out))  # the other evaluation, still running
    assert main(SMALL + ["--limit", "1", "--output-dir", str(out)]) == 2
    line = last_error(capsys)
    assert f"--output-dir {out}: in use by another run (pid {os.getpid()})" in line
    held.close()
    assert main(SMALL + ["--limit", "1", "--output-dir", str(out)]) == 0


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_a_dialogue_id_twice_is_refused_naming_both_places(kind, tmp_path, capsys):
    """Item 3: repeated ids were counted twice (SAGE's gpt-4.1 file with 30 lines repeated ranked
    75.5 over "130" dialogues)."""
    rows = [{"id": "x", "emo_point": 80}, {"id": "y", "emo_point": 10}, {"id": "x", "emo_point": 80}]
    p = tmp_path / f"dup.{kind}"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) if kind == "jsonl" else json.dumps(rows))
    assert main(["--score", str(p), "--output-dir", str(tmp_path / "o")]) == 2
    where = "line 1 and line 3" if kind == "jsonl" else "item [0] and item [2]"
    assert last_error(capsys) == f"evaluate.py: error: {p}: dialogue 'x' appears twice ({where}): a score counts " \
                                 f"each dialogue once"


@pytest.mark.skipif(not os.path.isdir(SAGE_DATA), reason="SAGE's released results are not here (shared/data/sage)")
def test_sages_file_with_repeated_lines_is_refused_on_the_leaderboard(tmp_path, capsys):
    board = tmp_path / "board"
    board.mkdir()
    lines = open(os.path.join(SAGE_DATA, "gpt-4.1_result.jsonl"), encoding="utf-8").read().split("\n")
    lines = [line for line in lines if line.strip()]
    (board / "gpt-4.1_result.jsonl").write_text("\n".join(lines + lines[:30]) + "\n", encoding="utf-8")
    assert main(["--leaderboard", str(board), "--judge", "none", "--output-dir", str(tmp_path / "o")]) == 2
    assert "appears twice (line 1 and line 101)" in last_error(capsys)


def test_the_engines_context_length_is_part_of_the_protocol(tmp_path):
    """Item 4: --vllm-max-model-len was not recorded: a rerun with another value mixed dialogues
    cut at 80 tokens with dialogues played to their last turn."""
    import argparse

    from evaluate import check_protocol, protocol
    from plumbing.checks import InputError
    from rule_user import RuleBackend
    args = argparse.Namespace(scenarios=os.path.join(ROOT, "data", "scenarios_test.jsonl"), user="standard",
                              rules="sage", initial_emotion=40, max_turns=9, think=False, temperature=0.0, seed=0,
                              engine="vllm", max_new_tokens=64, max_total_tokens=4096, vllm_max_model_len=80)
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "transcripts.jsonl").write_text('{"scenario_id": "a"}\n')
    (folder / "protocol.json").write_text(json.dumps(protocol(args, {}, RuleBackend(), "tiny")))
    check_protocol(str(folder), protocol(args, {}, RuleBackend(), "tiny"))  # the same: reused
    args.vllm_max_model_len = 0
    with pytest.raises(InputError, match="vllm_max_model_len was 80, now 0"):
        check_protocol(str(folder), protocol(args, {}, RuleBackend(), "tiny"))
    args.vllm_max_model_len, args.max_new_tokens = 80, 32
    with pytest.raises(InputError, match="max_new_tokens was 64, now 32"):
        check_protocol(str(folder), protocol(args, {}, RuleBackend(), "tiny"))


def test_jsonl_is_split_at_newlines_only(tmp_path):
    """Item 5: SAGE's o4-mini transcript stopped with ':41: invalid JSON (Unterminated string)':
    str.splitlines() also splits at U+2028, U+2029 and U+0085, which JSON strings may hold raw."""
    rows = [{"id": f"d{i}", "emo_point": 10 * i, "history": [
        {"role": "user", "content": f"line one{sep}line two"}, {"role": "assistant", "content": "ok"}]}
        for i, sep in enumerate(["\u2028", "\u2029", "\u0085", "\u000b", "\u001c"])]
    p = tmp_path / "seps.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert "\u2028" in p.read_text(encoding="utf-8")  # written raw, as SAGE's file holds them
    got = load_transcripts(str(p))
    assert [r["id"] for r in got] == [f"d{i}" for i in range(5)]
    assert [r["history"][0]["content"] for r in got] == [r["history"][0]["content"] for r in rows]


def test_a_byte_order_mark_is_not_part_of_the_json(tmp_path):
    """Item 6: a UTF-8 BOM (Windows editors write one) made the first line invalid JSON."""
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "emo_point": 50}\n{"id": "b", "emo_point": 70}\n')
    assert summarize(load_transcripts(str(p)))["sentient_score"] == 60
    s = tmp_path / "scenarios.jsonl"
    s.write_bytes(b"\xef\xbb\xbf" + open(os.path.join(ROOT, "data", "scenarios_test.jsonl"), "rb").read())
    from plumbing.scenarios import load_scenarios
    assert len(load_scenarios(str(s))) == 20


@pytest.mark.parametrize("history,msg", [
    ([{"role": "user"}], "history[0] has no 'content' (a string is needed)"),
    (["hello"], "history[0] is a str, not a message object"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}],
     "history[1] has a int as its 'content' (a string is needed)"),
])
@pytest.mark.parametrize("stats", [[], ["--reply-stats"]])
def test_malformed_messages_are_one_line_naming_file_line_and_field(history, msg, stats, tmp_path, capsys):
    """Item 7: KeyError and AttributeError tracebacks (with --reply-stats) instead of one line."""
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"id": "a", "emo_point": 50}) + "\n" + json.dumps({"id": "b", "emo_point": 50,
                                                                               "history": history}) + "\n")
    assert main(["--score", str(p), *stats, "--output-dir", str(tmp_path / "o")]) == 2
    assert last_error(capsys) == f"evaluate.py: error: {p}:2: {msg}"


def test_a_protocol_key_this_version_does_not_write_is_one_line(tmp_path, capsys):
    """Item 9: a protocol.json holding a key this version does not write crashed the rerun
    (StopIteration in check_protocol)."""
    args = SMALL + ["--limit", "1", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    proto = tmp_path / "tiny" / "protocol.json"
    proto.write_text(json.dumps({**json.load(open(proto)), "future_setting": 1}))
    capsys.readouterr()
    assert main(args) == 2
    assert "protocol.json records 'future_setting', which this version does not" in last_error(capsys)


def test_success_under_rlver_rules_and_the_tables_definition(tmp_path, capsys):
    """Item 10: under --rules rlver the success rate was always 0%; the summary now says what
    success and failure mean under the rules it played."""
    assert main(SMALL + ["--limit", "2", "--rules", "rlver", "--judge", "none", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "success: the emotion reached 100 after a reply (the dialogue goes on); failure: it ended at or below 0" \
           in out
    summary = json.load(open(tmp_path / "summary.json", encoding="utf-8"))
    assert list(summary["protocol"]["outcomes"]) == ["rlver"] and \
        summary["results"]["tiny"]["outcome_rules"] == ["rlver"]


def test_the_plots_show_every_value_they_are_given(tmp_path):
    """Item 11: under --rules rlver final emotions below 0 vanished (bins 0-100, axis cut at 0)."""
    from evaluate import plot
    recs = [{"emotion": -35.0, "emotion_trace": [30, 5, -35], "valid": True},
            {"emotion": 60.0, "emotion_trace": [30, 45, 60], "valid": True}]
    (traj_lo, traj_hi), (hist_lo, hist_hi), counted = plot({"m": recs}, str(tmp_path / "p.png"), max_turns=2)
    assert traj_lo <= -35 and traj_hi >= 60 and hist_lo <= -35 and hist_hi >= 60 and counted == 2


def test_leaderboard_files_that_do_not_compare_are_refused_or_marked(tmp_path, capsys):
    """Item 12: gpt-4.1.jsonl beside gpt-4.1_result.jsonl -- one was dropped silently; a 10-profile
    file ranked above 100-profile ones; files of another turn limit ranked without a word."""
    board = tmp_path / "board"
    board.mkdir()
    ids = [f"p{i}" for i in range(4)]

    def write(name, ids, emo, turns=3):
        (board / name).write_text("".join(json.dumps({"id": i, "emo_point": emo, "history": [
            {"role": "assistant", "content": "x"}] * turns}) + "\n" for i in ids))
    write("a.jsonl", ids, 50)
    write("a_result.jsonl", ids, 60)
    assert main(["--leaderboard", str(board), "--output-dir", str(tmp_path / "o")]) == 2
    assert last_error(capsys).endswith("a.jsonl and a_result.jsonl are both 'a': keep one")
    os.remove(board / "a.jsonl")
    write("b_result.jsonl", ids[:2], 90)
    assert main(["--leaderboard", str(board), "--output-dir", str(tmp_path / "o")]) == 2
    assert "b_result.jsonl played 2 profiles and a_result.jsonl 4, not the same ids" in last_error(capsys)
    write("b_result.jsonl", ids, 90, turns=12)
    write("c_result.jsonl", ids, 20)
    assert main(["--leaderboard", str(board), "--output-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert " 1. b (+)" in out and "played to another turn limit than the others' 3 agent replies" in out
    assert " 2. a " in out and " 3. c " in out


# ---------------------------------------------------------------- issue 46: faults, round five
def float_flags():
    from evaluate import build_parser
    return sorted({a.dest for a in build_parser()._actions if a.type is float})


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "-1"])
def test_every_float_flag_of_evaluate_takes_absurd_values_as_one_line(value, tmp_path, capsys):
    """Item 4: every float flag of evaluate.py, given inf, 1e300, nan and -1: one line naming the
    flag, exit 2, before any model loads (--simulator-call-budget inf passed the check)."""
    names = float_flags()
    assert {"temperature", "judge_timeout", "simulator_call_budget", "vllm_kv_cache_gb"} <= set(names), names
    for name in names:
        flag = "--" + name.replace("_", "-")
        rc = main([*SMALL, "--limit", "1", flag, value, "--output-dir", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, (flag, value, err[-2000:])
        assert err.strip().splitlines()[-1].startswith(f"evaluate.py: error: {flag} "), (flag, value, err[-500:])


def test_a_model_with_no_scored_dialogue_exits_non_zero_and_the_rerun_continues(tmp_path, capsys):
    """Item 2: a simulated user whose every answer is unparseable scored 0 of 2 dialogues and
    evaluate.py exited 0. Now: one line naming the model and the simulator's last error, exit 1,
    the transcripts kept; the same command against a working server plays them again."""
    args = [*SMALL, "--limit", "2", *OPENAI, "--judge", "none", "--output-dir", str(tmp_path)]
    with FakeOpenAIServer(fault_rate=1.0, fault_kinds=("garbage",), max_faults_in_a_row=10 ** 9) as srv:
        assert main(args + ["--simulator-base-url", srv.base_url]) == 1
        line = last_error(capsys)
        assert line.startswith("evaluate.py: error: no dialogue of tiny was scored (2 simulator errors"), line
        assert "the simulator's last error: unparseable output: 'I feel... hmm" in line and "rerun the same" in line
        kept = load_transcripts(str(tmp_path / "tiny" / "transcripts.jsonl"))
        assert [r["outcome"] for r in kept] == ["simulator_error"] * 2 and all(r["error"] for r in kept)
        srv.fault_rate = 0.0  # the server is mended
        assert main(args + ["--simulator-base-url", srv.base_url]) == 0
    again = load_transcripts(str(tmp_path / "tiny" / "transcripts.jsonl"))
    assert [r["outcome"] for r in again] == ["max_turns"] * 2


def test_a_key_echoed_in_an_answer_reaches_no_log_transcript_or_error_line(tmp_path, capsys, caplog, monkeypatch):
    """Faults round six, item 4: a server that echoes the API key inside a 200 answer that does
    not parse put `Bearer sk-...` in the warning, in the dialogue's recorded error (written to
    transcripts.jsonl) and in evaluate.py's last line. Every text a server sent has the key cut
    out before it is logged or stored."""
    secret = "sk-test-DO-NOT-LEAK-0987654321"
    monkeypatch.setenv("RLVER_TEST_KEY", secret)
    caplog.set_level(logging.DEBUG)
    args = [*SMALL, "--limit", "1", *OPENAI, "--simulator-api-key-env", "RLVER_TEST_KEY", "--judge", "none",
            "--output-dir", str(tmp_path)]
    with FakeOpenAIServer(api_key=secret, faults=["echo_key_ok"] * 100) as srv:
        assert main(args + ["--simulator-base-url", srv.base_url]) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    transcripts = (tmp_path / "tiny" / "transcripts.jsonl").read_text()
    assert "cannot read a request from Bearer ***" in line, line
    assert "Bearer ***" in transcripts and "Bearer ***" in caplog.text
    assert secret not in err + transcripts + caplog.text
    assert not [f for f in tmp_path.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]


def fake_snapshot(hub, repo: str, revision: str, weights: bytes):
    """A Hugging Face cache entry as a download leaves it: snapshots/<rev>/ and refs/main."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "qwen2"}')
    (snap / "model.safetensors").write_bytes(weights)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)


def test_a_hub_model_downloaded_by_the_first_run_continues_on_rerun(tmp_path, capsys, monkeypatch):
    """Item 3: the protocol fingerprinted a hub id before loading it: 'hub:ID' on the run that
    downloaded it, the snapshot's hash on the rerun, so the interrupted evaluation was refused
    ('the weights changed'). Now the fingerprint is of the snapshot loaded; a newer revision in
    the cache is still refused."""
    import huggingface_hub

    import evaluate
    from plumbing import models
    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(evaluate, "check_model_arg", lambda flag, value, adapters=False: None)  # no network here
    loads = []

    def load_for_eval(model, seed):  # the first load downloads the snapshot
        if not hub.exists():
            fake_snapshot(hub, model, "a" * 40, b"weights v1")
        loads.append(model)
        return models.load_policy("tiny", seed)[0].eval(), models.load_policy("tiny", seed)[1]
    monkeypatch.setattr(evaluate, "load_for_eval", load_for_eval)
    args = ["--model", "org/chat-7b", "--max-new-tokens", "8", "--max-turns", "2", "--batch-size", "1", "--limit", "2",
            "--judge", "none", "--output-dir", str(tmp_path / "out")]
    assert models.weights_fingerprint("org/chat-7b") == "hub:org/chat-7b"  # nothing cached yet
    writes = {"n": 0}
    orig = evaluate.append_line

    def interrupted(path, line):
        writes["n"] += 1
        if writes["n"] == 2:
            raise KeyboardInterrupt
        orig(path, line)
    monkeypatch.setattr(evaluate, "append_line", interrupted)
    assert main(args) == 130
    monkeypatch.setattr(evaluate, "append_line", orig)
    transcripts = tmp_path / "out" / "chat-7b" / "transcripts.jsonl"
    assert len(load_transcripts(str(transcripts))) == 1
    recorded = json.load(open(tmp_path / "out" / "chat-7b" / "protocol.json", encoding="utf-8"))["weights"]
    assert recorded == models.weights_fingerprint("org/chat-7b") != "hub:org/chat-7b"
    capsys.readouterr()
    assert main(args) == 0, last_error(capsys)  # was refused: 'the weights at org/chat-7b changed'
    assert len(load_transcripts(str(transcripts))) == 2
    import shutil
    shutil.rmtree(hub)  # the cache cleared: the check before loading sees 'hub:ID', the one after the same weights
    assert main(args) == 0, last_error(capsys)
    fake_snapshot(hub, "org/chat-7b", "b" * 40, b"weights v2")  # a newer revision replaces the cached one
    assert main(args[:-1] + [str(tmp_path / "out")] + ["--limit", "2"]) == 2
    assert "the weights at org/chat-7b changed since they were played" in last_error(capsys)


def test_the_outcome_definitions_printed_are_those_applied(tmp_path, capsys):
    """Item 6: with --score alone the line under the table stated SAGE's thresholds for every
    row, while a file of ours is counted by its recorded outcome (an rlver file: failure 'ended
    <= 0'). Now each row says the definition it was counted by, and summary.json the same."""
    sage = tmp_path / "sage_run.jsonl"
    sage.write_text("".join(json.dumps({"id": f"p{i}", "emo_point": e}) + "\n" for i, e in enumerate([100, 5])))
    ours = tmp_path / "eval" / "mine"
    ours.mkdir(parents=True)
    (ours / "protocol.json").write_text(json.dumps({"rules": "rlver"}))
    (ours / "transcripts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"scenario_id": "p0", "emotion": 5, "outcome": "max_turns", "turns": 2, "emotion_trace": [30, 20, 5]},
        {"scenario_id": "p1", "emotion": -3, "outcome": "failure", "turns": 2, "emotion_trace": [30, 8, -3]}]))
    unknown = tmp_path / "copied.jsonl"  # ours, without its protocol.json
    unknown.write_text((ours / "transcripts.jsonl").read_text())
    assert main(["--score", str(sage), "--score", str(ours / "transcripts.jsonl"), "--score", str(unknown),
                 "--judge", "none", "--output-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "sage_run: success: final emotion >= 100; failure: final emotion < 10 (SAGE's thresholds" in out
    assert "transcripts: success: the emotion reached 100 after a reply (the dialogue goes on); failure: it ended at " \
           "or below 0 (--rules rlver)" in out
    assert "copied: success: the emotion reached 100 after a reply; failure: the outcome recorded in the file" in out
    summary = json.load(open(tmp_path / "o" / "summary.json", encoding="utf-8"))
    assert {k: v["outcome_rules"] for k, v in summary["results"].items()} == {
        "sage_run": [None], "transcripts": ["rlver"], "copied": ["recorded"]}
    assert summary["results"]["transcripts"]["failure_rate"] == 0.5  # the emotion 5 is no failure under rlver
    assert main(["--score", str(sage), "--output-dir", str(tmp_path / "p")]) == 0  # one rule set: one line
    before_the_summary = capsys.readouterr().out.split("\ndone:")[0]  # the run ends with where its files are
    assert before_the_summary.strip().splitlines()[-1].startswith("success: final emotion >= 100")


@pytest.mark.parametrize("record, msg", [
    ({"scenario_id": "a", "outcome": "failure", "emotion": -1e300, "turns": 1, "emotion_trace": [30, -1e300]},
     "final emotion -1e+300 is not in [-100, 100]"),
    ({"scenario_id": "a", "outcome": "max_turns", "emotion": 20, "turns": 2, "emotion_trace": [30, -1e8, 20]},
     "'emotion_trace' holds -100000000.0, not an emotion in [-100, 100]"),
])
def test_an_absurd_emotion_is_refused_in_one_line_before_any_plot(record, msg, tmp_path, capsys):
    """Item 5: --score of a record with emotion -1e300 built the histogram's bins with
    np.arange(5 * floor(lo / 5), 105, 5): an overflow traceback (at -1e8, 2e7 bins). No
    simulator writes below -100 (a dialogue ends at <= 0 and a change is at most 100)."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(record) + "\n")
    assert main(["--score", str(p), "--output-dir", str(tmp_path / "o")]) == 2
    assert last_error(capsys) == f"evaluate.py: error: {p}:1: {msg}"


def test_the_lowest_emotion_a_simulator_writes_is_plotted(tmp_path):
    """Item 5: -100 (the floor) still plots, with bounded bins."""
    from evaluate import plot
    recs = [{"emotion": -100.0, "emotion_trace": [0, -100], "valid": True}]
    (lo, _), (hist_lo, _), counted = plot({"m": recs}, str(tmp_path / "p.png"), max_turns=1)
    assert lo <= -100 and hist_lo <= -100 and counted == 1


def test_an_evaluation_writes_and_reads_its_files_under_an_ascii_locale(tmp_path):
    """Item 8: protocol.json and summary.json were opened with the locale's encoding and written
    with ensure_ascii=False: under a locale that is not UTF-8 (here C without Python's UTF-8
    coercion: ASCII; Latin-1 on older clusters) the first write of SAGE's Chinese prompt failed.
    Every text file now names its encoding: the evaluation writes its files, and its rerun reads
    them back and continues."""
    import subprocess
    import sys

    from conftest import ROOT
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    cmd = [sys.executable, "-X", "utf8=0", os.path.join(ROOT, "evaluate.py"), *SMALL, "--limit", "1",
           "--output-dir", str(tmp_path)]
    check = "import locale, sys; print(locale.getpreferredencoding(False), sys.flags.utf8_mode)"
    enc = subprocess.run([sys.executable, "-X", "utf8=0", "-c", check], env=env, capture_output=True, text=True)
    assert enc.stdout.split()[0].lower() in ("ansi_x3.4-1968", "ascii", "latin-1", "iso-8859-1"), enc.stdout
    for _ in range(2):  # the rerun reads protocol.json back (and finds the dialogue played)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300)
        assert p.returncode == 0, p.stderr.decode("utf-8", "replace")[-2000:]
    proto = json.load(open(tmp_path / "tiny" / "protocol.json", encoding="utf-8"))
    assert proto["eval_prompt"]["zh"].startswith("你是")
    assert json.load(open(tmp_path / "summary.json", encoding="utf-8"))["protocol"]["eval_prompt"]["zh"] == \
        proto["eval_prompt"]["zh"]


def test_text_files_are_opened_with_an_encoding():
    """Item 8: every open() of a text file in the project names its encoding (read by the AST:
    a mode without 'b' and no encoding= is a file read or written in the locale's encoding)."""
    import ast
    import glob

    from conftest import ROOT
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "plumbing", "*.py")) + \
        glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    missing = []
    for path in files:
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
                mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords
                                                                     if k.arg == "mode"), None)
                binary = isinstance(mode, ast.Constant) and "b" in mode.value
                if not binary and not any(k.arg == "encoding" for k in node.keywords):
                    missing.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not missing, missing


def test_a_dialogue_that_starts_at_100_has_not_succeeded_before_a_reply(tmp_path):
    """Item 10: with --initial-emotion 100 every dialogue counted as a success before any reply
    (the trace's start was counted). Success is reaching 100 after an appraised reply."""
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"scenario_id": "a", "emotion": 90, "outcome": "max_turns", "turns": 2, "emotion_trace": [100, 95, 90]},
        {"scenario_id": "b", "emotion": 95, "outcome": "max_turns", "turns": 2, "emotion_trace": [100, 100, 95]},
        {"scenario_id": "c", "emotion": 100, "outcome": "success", "turns": 1, "emotion_trace": [100, 100]}]))
    s = summarize(load_transcripts(str(p)))
    assert s["success_rate"] == 2 / 3  # b and c reached 100 after a reply; a only started there


def test_an_evaluation_that_starts_at_100_counts_success_after_a_reply(tmp_path, capsys):
    """Item 10, played: under --rules rlver from 100 the rule user's appraisal decides."""
    assert main([*SMALL, "--limit", "4", "--initial-emotion", "100", "--rules", "rlver", "--judge", "none",
                 "--output-dir", str(tmp_path)]) == 0
    recs = load_transcripts(str(tmp_path / "tiny" / "transcripts.jsonl"))
    reached = [max(r["emotion_trace"][1:]) >= 100 for r in recs]
    s = json.load(open(tmp_path / "summary.json", encoding="utf-8"))["results"]["tiny"]
    assert s["success_rate"] == sum(reached) / len(recs) and not all(reached), [r["emotion_trace"] for r in recs]


def test_a_score_file_with_no_scored_dialogue_is_one_line_and_non_zero(tmp_path, capsys):
    """Faults round six, item 5: a --score file whose dialogues all failed exited 0 with a row
    of no score (a --model row with none exits 1). It is refused before any work: one line
    naming the file and what its dialogues were, exit 2."""
    path = tmp_path / "failed.jsonl"
    path.write_text(json.dumps({"scenario_id": "p0", "emotion": 30, "outcome": "simulator_error", "turns": 0,
                                "emotion_trace": [30], "valid": False}) + "\n")
    assert main(["--score", str(path), "--judge", "none", "--output-dir", str(tmp_path / "o")]) == 2
    assert last_error(capsys) == (f"evaluate.py: error: --score {path}: no dialogue in it was scored "
                                  f"(1 dialogues: 1 simulator errors, 0 never appraised)")


BIG = 10 ** 400  # a number JSON and Python hold, and no float


@pytest.mark.parametrize("change, msg", [
    ({"turns": BIG}, f"'turns' must be an integer in [0, 1000000], got {str(BIG)[:40]}"),
    ({"emotion_trace": [30, BIG]}, f"'emotion_trace' holds {str(BIG)[:40]}, not an emotion in [-100, 100]"),
    ({"reply_lengths": [BIG]}, f"'reply_lengths' holds {str(BIG)[:40]}, not a reply length in [0, 1000000]"),
    ({"reply_lengths": [-254]}, "'reply_lengths' holds -254, not a reply length in [0, 1000000]"),
    ({"reply_lengths": [float("nan")]}, "'reply_lengths' holds nan, not a reply length in [0, 1000000]"),
    ({"judge": "rule", "capability": {"empathic_depth": BIG}}, "'capability' must map each of empathic_depth, "),
    ({"judge": "rule", "strategies": [["validation", "mind reading"]]}, "'strategies' must be a list (a turn each)"),
])
def test_a_score_file_with_numbers_out_of_range_is_one_line(change, msg, tmp_path, capsys):
    """Item 5: a 400-digit turn count, trace value or reply length ended in an OverflowError
    traceback; negative reply lengths were scored ("reply chars -254"); a judged file's capability
    score of 400 digits (OverflowError) or an unknown strategy label (KeyError) too."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"scenario_id": "a", "outcome": "max_turns", "emotion": 40, "turns": 1,
                             "emotion_trace": [30, 40], **change}) + "\n")
    assert main(["--score", str(p), "--reply-stats", "--output-dir", str(tmp_path / "o")]) == 2
    assert last_error(capsys).startswith(f"evaluate.py: error: {p}:1: {msg}")


def test_an_integer_id_twice_is_refused_as_a_string_id_is(tmp_path, capsys):
    """Item 5: ids were checked for repeats only when they were strings: id 1 twice counted twice
    (docs/RELIABILITY.md says a repeated id is refused). 1 and "1" are two ids."""
    p = tmp_path / "t.jsonl"
    rows = [{"id": 1, "emotion": 50}, {"id": "1", "emotion": 60}, {"id": 1, "emotion": 70}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--score", str(p), "--output-dir", str(tmp_path / "o")]) == 2
    assert last_error(capsys) == (f"evaluate.py: error: {p}: dialogue 1 appears twice (line 1 and line 3): "
                                  f"a score counts each dialogue once")
