"""The front page's proof that it learns is of the code as it is: docs/learning.json, written by
benchmarks/learning.py, records what its runs depended on (benchmarks/learning.fingerprint), and
the README's learning section quotes only its figures."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from learning import fingerprint  # noqa: E402 (after sys.path)
from plumbing.models import smollm2_missing  # noqa: E402 (after sys.path)

RECORD = os.path.join(ROOT, "docs", "learning.json")
needs_wheel = pytest.mark.skipif(smollm2_missing() is not None, reason=str(smollm2_missing()))  # the preset's model


@needs_wheel
def test_the_documented_learning_runs_were_measured_on_this_code():
    """Fails, naming the command that re-measures them, when the rule user's appraisals of a fixed
    set of replies, its reader, the smollm2-cpu preset or the scenario files have changed since."""
    with open(RECORD, encoding="utf-8") as f:
        record = json.load(f)
    now, then = fingerprint(), record["fingerprint"]
    changed = [k for k in now if then.get(k) != now[k]]
    assert not changed, (f"docs/learning.json was measured with another {', '.join(changed)} than the code's: "
                         f"re-measure with `{record['command']}` and update README.md and docs/LEARNING.md")
    assert record["seeds"], "docs/learning.json holds no run"


@needs_wheel
def test_the_fingerprint_follows_the_rules_not_the_machine():
    """A change of one weight, of the reader's gate, of the reader or of a preset value moves the
    fingerprint; computing it again does not. The preset's configuration is train.py's own
    (--print-config)."""
    from learning import preset_config
    from rule_user import RuleBackend
    config = preset_config()
    assert config["user_reader"] == "smollm2" and config["steps"] == 80 and config["group_size"] == 4
    assert "engine" not in config and "output_dir" not in config
    first = fingerprint(config)
    assert fingerprint(config) == first
    old = dict(RuleBackend.WEIGHTS)
    try:
        RuleBackend.WEIGHTS["reflect"] += 0.5
        assert fingerprint(config)["rule_user"] != first["rule_user"]
    finally:
        RuleBackend.WEIGHTS.clear()
        RuleBackend.WEIGHTS.update(old)
    gate = RuleBackend.FLUENT
    try:
        RuleBackend.FLUENT = (gate[0] - 0.2, gate[1])
        assert fingerprint(config)["rule_user"] != first["rule_user"]
    finally:
        RuleBackend.FLUENT = gate
    assert fingerprint({**config, "steps": 81})["preset"] != first["preset"]
    assert fingerprint({**config, "user_reader": "none"})["reader"] == "none"
    assert fingerprint(config) == first


def test_the_readme_quotes_only_the_records_figures():
    """Every number in the README's learning section is one of docs/learning.json's figures (the
    seeds' measured values, not its hashes, commits or commands), the section's own labels and
    the bar's thresholds aside."""
    with open(RECORD, encoding="utf-8") as f:
        record = json.load(f)

    def values(x):  # every number among the seeds' figures
        if isinstance(x, dict):
            return [v for k, y in x.items() if k not in ("commit", "train_command", "eval_command",
                                                          "pairs_for_readers") for v in values(y)]
        if isinstance(x, list):
            return [v for y in x for v in values(y)]
        return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []
    figures = {str(v) for v in values(record["seeds"])}
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("<!-- learning: figures from docs/learning.json -->")[1].split("<!-- /learning -->")[0]
    allowed = {"0", "1", "2", "3", "5", "13", "15", "20", "30", "45", "0.3", "0.03", "1.5", "135"}  # 45: minutes a seed
    quoted = set(re.findall(r"(?<![\w.])[-−+]?\d+(?:\.\d+)?", section))
    stray = [q for q in quoted if q.lstrip("+").replace("−", "-") not in figures | allowed]
    assert not stray, f"README's learning section quotes figures not in docs/learning.json: {stray}"


@needs_wheel
def test_learning_toy(tmp_path):
    """benchmarks/learning.py at toy size: the tiny preset trains 4 steps, base and trained play 2
    held-out scenarios, and the record holds every line of the bar, the commands, the pairs for the
    blind readers (A/B in a shuffled order, the key apart) and the fingerprint; a second call keeps
    the trained model (no training again)."""
    out = tmp_path / "learning.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "--toy", "--seed", "3", "--out", str(out),
           "--pictures", str(tmp_path), "--runs", str(tmp_path / "runs" / "toy"),
           "--eval", str(tmp_path / "eval" / "toy")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    record = json.loads(out.read_text())
    seed = record["seeds"]["3"]
    assert record["fingerprint"] == fingerprint() and "--preset tiny" in seed["train_command"]
    assert sorted(seed["lines"]) == ["a", "b", "c", "d", "e", "f"]
    assert seed["lines"]["a"]["steps"] == 4 and seed["lines"]["b"]["higher"] + seed["lines"]["b"]["equal"] <= 2
    assert seed["lines"]["f"]["met"] is None  # no readers' labels for a toy
    assert seed["scenarios"] == 2 and (tmp_path / "learning_s3.png").is_file()
    blind = os.path.join(ROOT, seed["pairs_for_readers"])
    pairs, key = open(os.path.join(blind, "pairs.md")).read(), json.load(open(os.path.join(blind, "key.json")))
    assert pairs.count("## Pair ") == 2 and "tiny" not in pairs and "final" not in pairs
    assert sorted(key) == ["1", "2"] and {v["trained"] for v in key.values()} <= {"A", "B"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "kept " in p.stdout, (p.stdout + p.stderr)[-3000:]


def test_line_f_takes_only_labels_of_the_dialogues_read(tmp_path):
    """Line f's key (which dialogue is the trained one) is the same for every run of a seed: the
    labels of an earlier run's pairs matched it and were counted for a new run. Each label now
    carries the hash of the pairs file read; labels of other dialogues are 'labels other pairs'."""
    import hashlib

    from learning import preferred
    blind = tmp_path / "blind"
    blind.mkdir()
    (blind / "pairs.md").write_text("## Pair 1\n...\n")
    (blind / "key.json").write_text(json.dumps({"1": {"scenario_id": "en-041", "trained": "B"}}))
    sha = hashlib.sha256(b"## Pair 1\n...\n").hexdigest()[:16]
    rows = [{"reader": r, "pair": 1, "scenario_id": "en-041", "choice": "B", "trained": "B"} for r in ("r1", "r2")]
    labels = tmp_path / "labels.jsonl"
    for extra, met in (({"pairs_sha256": sha}, True), ({"pairs_sha256": "another run's"}, None), ({}, None)):
        labels.write_text("".join(json.dumps({**r, **extra}) + "\n" for r in rows))
        got = preferred(str(labels), str(blind / "key.json"))
        assert got["met"] is met, got  # (13 of 20 as a share: 1 of 1 pair)
        if met is None:
            assert "labels other pairs than these" in got["why"]
        else:
            assert got["readers"] == {"r1": {"trained": 1}, "r2": {"trained": 1}}
