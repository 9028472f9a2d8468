"""Does it learn? One command re-measures everything the README says about learning.

    python benchmarks/learning.py --seed 0 --seed 1      # about 45 minutes a seed on 2 CPU cores

For each seed it trains with the smollm2-cpu preset (`python train.py --algo grpo --preset
smollm2-cpu --seed S`), plays the 20 held-out scenarios (data/scenarios_test.jsonl) with the base
model and the trained one under the training protocol and the same user, its reader included
(evaluate.py --reply-stats --fluency-model smollm2), and measures the bar of docs/LEARNING.md:

  a. rise       the last quarter's mean step reward >= the first quarter's + 3 sd of its step means
  b. held out   trained higher in >= 15 of 20 scenarios, and >= +5 Sentient points
  c. no gaming  <= 1.5 questions a reply; sentence share >= base; repeat rate <= base + 0.03;
                tics <= base + 0.3 a reply
  d. fluent     held-out fluency (nats a token under the base model) >= base - 0.3
  e. varied     the most common first three words open <= 30% of the held-out replies
  f. preferred  each of two blind readers prefers the trained dialogue in >= 13 of 20 pairs
                (their labels: data/learning_readers_s<seed>.jsonl, made from pairs this
                script writes; absent: not measured)

It writes every figure to one JSON file (docs/learning.json) with the commit, the commands and
the fingerprint of what the run depends on (`fingerprint`: the rule user's appraisals of fixed
replies, the reader's name, the preset's values, the scenario files), and copies each seed's
curves beside it (docs/learning_s<seed>.png). tests/test_learning_record.py fails, naming this
command, when the code no longer matches that fingerprint. A step whose output is already there
(a finished run's final/, an evaluation's transcripts) is kept, so a stopped run continues.
`--toy` runs the same path at toy size (the tiny preset, 2 steps, 2 scenarios) for the suite.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from plumbing.logs import AGENT_ROLES  # noqa: E402 (after sys.path)
from rule_user import RuleBackend, word_list  # noqa: E402 (after sys.path)
from simulator import Scenario, UserState  # noqa: E402 (after sys.path)

PRESET = "smollm2-cpu"
# The held-out protocol: the training one (start at 30, 3 turns, 40 tokens, temperature 1), seed 0 for every run.
EVAL_FLAGS = ["--eval-prompt", "train", "--judge", "none", "--scenarios", "data/scenarios_test.jsonl",
              "--temperature", "1.0", "--seed", "0", "--initial-emotion", "30", "--max-turns", "3",
              "--max-new-tokens", "40", "--reply-stats"]


def jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- what the documented run depends on ----------------------------------------------------
def preset_config(argv=("--algo", "grpo", "--preset", PRESET)) -> dict:
    """The configuration a train.py command resolves to (train.py --print-config, a process of
    its own: nothing imports the launcher), less what does not shape training: where it writes,
    its bookkeeping, the seed (each run's own) and the engine (vLLM where installed: the same
    sampling either way, docs/VLLM.md)."""
    out = subprocess.run([sys.executable, "train.py", *argv, "--print-config"], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"learning.py: error: train.py --print-config: {out.stderr.strip()[-300:]}")
    skip = {"output_dir", "resume", "save_every", "keep_last", "report_to", "simulator_api_key_env", "scenarios",
            "seed", "engine"}
    return {k: v["value"] for k, v in json.loads(out.stdout).items() if k not in skip}


def fingerprint(config: dict | None = None) -> dict:
    """What a documented learning run depends on, exact to the rules and independent of the
    machine's arithmetic: the rule user's expected change for each of a fixed set of replies
    (data/goal_reader_labels_run5.jsonl, 120 replies of two models) under each personality, read
    by a stub reader that spreads the replies across the FLUENT gate, rounded to 1e-3, and its
    answers at each emotion level; the reader's name and the preset's configuration (`config`,
    default preset_config()); the scenario files."""
    preset = preset_config() if config is None else config
    rows = jsonl(os.path.join(ROOT, "data", "goal_reader_labels_run5.jsonl"))

    def stub_reader(before, reply):  # -6 .. -4 nats, by the reply's hash: across the gate
        return -6.0 + 2.0 * int(hashlib.sha256(reply.encode()).hexdigest()[:4], 16) / 0xFFFF

    user, seen = RuleBackend(reader=stub_reader), []
    for k, r in enumerate(rows):
        for personality in ("", "negative", "passive", "avoidant"):
            sc = Scenario(id=f"fp-{k}", persona="", background="", hidden_goal="", goal_type=r["goal_type"],
                          personality_type=personality)
            first = [{"role": "user", "content": r["user_line"]}, {"role": "assistant", "content": r["reply"]}]
            earlier = rows[k - 1]  # a second turn after another reply: echo and words said before count
            second = [{"role": "user", "content": earlier["user_line"]},
                      {"role": "assistant", "content": earlier["reply"]}, *first]
            for history in (first, second):
                st = UserState(scenario=sc, emotion=50, history=history)
                seen.append(round(user.expected_change(st, r["reply"])[0], 3))
    for lang in ("en", "zh"):
        for emotion in (5, 25, 45, 65, 85):
            sc = Scenario(id="fp", persona="", background="x.", hidden_goal="", language=lang, goal_type="venting")
            seen.append(user.respond(UserState(scenario=sc, emotion=emotion, history=[]), final=False))
    files = {name: hashlib.sha256(open(os.path.join(ROOT, "data", name), "rb").read()).hexdigest()[:16]
             for name in ("scenarios_train.jsonl", "scenarios_test.jsonl")}
    appraisals = hashlib.sha256(json.dumps(seen, ensure_ascii=False).encode()).hexdigest()[:16]
    return {"rule_user": appraisals, "reader": preset["user_reader"], "preset": preset,
            "scenarios": files}


# ---- the bar ---------------------------------------------------------------------------------
def rise(metrics_path: str) -> dict:
    """Line a: the step rewards' first and last quarter."""
    rewards = [r["reward"] for r in jsonl(metrics_path) if r.get("reward") is not None]
    if len(rewards) < 2:
        return {"steps": len(rewards), "met": False, "why": "fewer than two scored steps"}
    q = max(1, len(rewards) // 4)
    first, last = rewards[:q], rewards[-q:]
    sd = statistics.stdev(first) if len(first) > 1 else 0.0
    gain = statistics.mean(last) - statistics.mean(first)
    return {"steps": len(rewards), "first_quarter": round(statistics.mean(first), 4), "first_quarter_sd": round(sd, 4),
            "last_quarter": round(statistics.mean(last), 4), "rise_sd": round(gain / sd, 2) if sd else None,
            "met": bool(sd) and gain >= 3 * sd}


def opening(text: str) -> str:
    return " ".join(word_list(text)[:3])


def held_out(eval_dir: str, base: str, trained: str) -> dict:
    """Lines b to e from evaluate.py's summary.json and transcripts."""
    summary = json.load(open(os.path.join(eval_dir, "summary.json"), encoding="utf-8"))
    recs = {m: {r["scenario_id"]: r for r in jsonl(os.path.join(eval_dir, m, "transcripts.jsonl"))}
            for m in (base, trained)}
    both = sorted(set(recs[base]) & set(recs[trained]))
    higher = sum(recs[trained][s]["emotion"] > recs[base][s]["emotion"] for s in both)
    equal = sum(recs[trained][s]["emotion"] == recs[base][s]["emotion"] for s in both)
    score = {m: summary["results"][m]["sentient_score"] for m in (base, trained)}
    stats = {m: summary["reply_stats"][m] for m in (base, trained)}
    b, t = stats[base], stats[trained]
    openings = {}
    for m in (base, trained):
        firsts = [opening(h["content"]) for r in recs[m].values() for h in r["history"] if h["role"] in AGENT_ROLES]
        top, n = collections.Counter(firsts).most_common(1)[0]
        openings[m] = {"top": top, "share": round(n / len(firsts), 3)}
    keys = ["questions_per_reply", "sentence_share", "repeat_rate", "tics_per_reply", "fluency", "goal_fit"]
    out = {"scenarios": len(both), "sentient": {m: round(v, 2) for m, v in score.items()},
           "replies": {m: {k: round(stats[m][k], 3) for k in keys if stats[m].get(k) is not None}
                       for m in (base, trained)},
           "openings": openings}
    out["lines"] = {
        "b": {"higher": higher, "equal": equal, "gain": round(score[trained] - score[base], 2),
              "met": higher >= 15 * len(both) / 20 and score[trained] - score[base] >= 5},
        "c": {"met": (t["questions_per_reply"] <= 1.5 and t["sentence_share"] >= b["sentence_share"]
                      and t["repeat_rate"] <= b["repeat_rate"] + 0.03
                      and t["tics_per_reply"] <= b["tics_per_reply"] + 0.3)},
        "d": {"met": t["fluency"] >= b["fluency"] - 0.3} if "fluency" in t else {"met": None},
        "e": {"met": openings[trained]["share"] <= 0.30},
    }
    return out


def write_pairs(eval_dir: str, base: str, trained: str, seed: int, out_dir: str) -> str:
    """The held-out pairs for blind readers: each scenario's two dialogues as A and B in a shuffled
    order (the key, which is which, in a file of its own the readers are not given)."""
    recs = {m: {r["scenario_id"]: r for r in jsonl(os.path.join(eval_dir, m, "transcripts.jsonl"))}
            for m in (base, trained)}
    rng, pairs, key = random.Random(1000 + seed), [], {}
    for k, sid in enumerate(sorted(set(recs[base]) & set(recs[trained])), 1):
        order = [base, trained]
        rng.shuffle(order)
        pairs.append(f"## Pair {k}\n" + "\n".join(
            f"\n### Dialogue {ab}\n" + "\n".join(f"{'User' if h['role'] == 'user' else 'Agent'}: {h['content']}"
                                                 for h in recs[m][sid]["history"]) for ab, m in zip("AB", order)))
        key[k] = {"scenario_id": sid, "trained": "AB"[order.index(trained)]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "pairs.md"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(pairs) + "\n")
    with open(os.path.join(out_dir, "key.json"), "w", encoding="utf-8") as f:
        json.dump(key, f, indent=1)
    return out_dir


def pairs_sha256(blind_dir: str) -> str:
    """What the readers read: the hash of the pairs file (its dialogues, not only their order)."""
    with open(os.path.join(blind_dir, "pairs.md"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def preferred(labels_path: str, key_path: str) -> dict:
    """Line f from the readers' labels: one JSON line per reader and pair, {"reader", "pair",
    "scenario_id", "choice": "A" | "B" | "tie", "trained": "A" | "B", "pairs_sha256"}, each
    checked against the pairs' key (write_pairs) and the pairs file beside it (pairs_sha256): the
    key is the same for every run of a seed, so labels of another run's dialogues say nothing of
    these."""
    if not os.path.isfile(labels_path):
        return {"met": None, "why": f"no labels in {os.path.relpath(labels_path, ROOT)}"}
    rows = jsonl(labels_path)
    with open(key_path, encoding="utf-8") as f:
        key = json.load(f)
    read = pairs_sha256(os.path.dirname(key_path))
    if any(key.get(str(r["pair"])) != {"scenario_id": r["scenario_id"], "trained": r["trained"]}
           or r.get("pairs_sha256") != read for r in rows):
        return {"met": None, "why": f"{os.path.relpath(labels_path, ROOT)} labels other pairs than these"}
    per = collections.defaultdict(collections.Counter)
    choice = collections.defaultdict(dict)
    for r in rows:
        won = "tie" if r["choice"] == "tie" else "trained" if r["choice"] == r["trained"] else "base"
        per[r["reader"]][won] += 1
        choice[r["pair"]][r["reader"]] = r["choice"]
    agree = sum(len(set(c.values())) == 1 for c in choice.values() if len(c) > 1)
    return {"readers": {k: dict(v) for k, v in sorted(per.items())}, "agreed": agree, "pairs": len(choice),
            "met": len(per) >= 2 and all(v["trained"] >= 13 * len(choice) / 20 for v in per.values())}


# ---- the runs ----------------------------------------------------------------------------------
def run(cmd: list[str], log_path: str):
    print("+ " + " ".join(cmd), flush=True)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        code = subprocess.call([sys.executable, *cmd[1:]], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"learning.py: error: `{' '.join(cmd)}` exited {code}; its log: {log_path}")


def made_under(folder: str) -> dict:
    """{"fingerprint", "commit"} a run or an evaluation was made under ({} when not recorded)."""
    path = os.path.join(folder, "made.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_fingerprint(folder: str, fp: dict, commit: str):
    if made_under(folder).get("fingerprint") == fp:
        return  # kept: it keeps the commit it was made at
    with open(os.path.join(folder, "made.json"), "w", encoding="utf-8") as f:
        json.dump({"fingerprint": fp, "commit": commit}, f, indent=1)


def measure(seed: int, args, fp: dict, commit: str) -> dict:
    run_dir, eval_dir = f"{args.runs}-s{seed}", f"{args.eval}-s{seed}"
    train_cmd = ["python", "train.py", "--algo", "grpo", "--preset", PRESET, "--seed", str(seed),
                 "--report-to", "none", "--output-dir", run_dir]
    base, reader = "smollm2", ["--fluency-model", "smollm2", "--user-reader", "smollm2"]
    if args.toy:
        train_cmd[5] = "tiny"
        train_cmd += ["--steps", "4", "--batch-size", "2", "--save-every", "4"]
        base, reader = "tiny", ["--limit", "2"]
    log_path = os.path.join(ROOT, f"{run_dir}.log")
    for folder in (run_dir, eval_dir):  # what is kept must have been made under these rules
        if os.path.isdir(os.path.join(ROOT, folder)) and os.listdir(os.path.join(ROOT, folder)) and \
                made_under(os.path.join(ROOT, folder)).get("fingerprint") != fp:
            raise SystemExit(f"learning.py: error: {folder} was made under other rules than the code's "
                             f"(its made.json): remove it to measure again")
    if os.path.isfile(os.path.join(ROOT, run_dir, "final", "config.json")) or \
            os.path.isfile(os.path.join(ROOT, run_dir, "final", "adapter", "adapter_config.json")):
        print(f"kept {run_dir}/final (remove it to train again)")
    else:
        run(train_cmd + (["--resume", "auto"] if os.path.isdir(os.path.join(ROOT, run_dir, "checkpoints")) else []),
            log_path)
    write_fingerprint(os.path.join(ROOT, run_dir), fp, commit)
    eval_cmd = ["python", "evaluate.py", "--model", base, "--model", f"{run_dir}/final", *EVAL_FLAGS, *reader,
                "--output-dir", eval_dir]
    run(eval_cmd, log_path)  # finished dialogues are reused (the same protocol): a rerun only re-reads
    write_fingerprint(os.path.join(ROOT, eval_dir), fp, commit)
    with open(os.path.join(ROOT, eval_dir, "summary.json"), encoding="utf-8") as f:
        trained = next(label for label in json.load(f)["results"] if label != base)
    steps = jsonl(os.path.join(ROOT, run_dir, "metrics.jsonl"))
    figures = {"train_command": " ".join(train_cmd), "eval_command": " ".join(eval_cmd),
               "minutes_of_steps": round(sum(r.get("step_time", 0) for r in steps) / 60, 1)}
    figures["lines"] = {"a": rise(os.path.join(ROOT, run_dir, "metrics.jsonl"))}
    held = held_out(os.path.join(ROOT, eval_dir), base, trained)
    figures["lines"].update(held.pop("lines"))
    blind = write_pairs(os.path.join(ROOT, eval_dir), base, trained, seed, os.path.join(ROOT, f"{eval_dir}-blind"))
    figures["lines"]["f"] = preferred(os.path.join(ROOT, "data", f"learning_readers_s{seed}.jsonl"),
                                      os.path.join(blind, "key.json"))
    figures.update(held)
    figures["pairs_for_readers"] = os.path.relpath(blind, ROOT)
    curve = os.path.join(ROOT, run_dir, "reward_curve.png")
    if args.pictures and os.path.isfile(curve):
        shutil.copyfile(curve, os.path.join(args.pictures, f"learning_s{seed}.png"))
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, action="append", help="training seed (repeat for several; default 0 and 1)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "learning.json"), help="the figures (JSON)")
    ap.add_argument("--pictures", default=os.path.join(ROOT, "docs"), help="where each seed's curves are copied")
    ap.add_argument("--runs", default="runs/learning", help="training output, <runs>-s<seed>")
    ap.add_argument("--eval", default="eval/learning", help="evaluation output, <eval>-s<seed>")
    ap.add_argument("--toy", action="store_true", help="the same path at toy size (tiny preset), for the suite")
    args = ap.parse_args(argv)
    seeds = args.seed or [0, 1]
    if any(s < 0 for s in seeds):
        ap.error("--seed: must be >= 0")
    record = {}
    if os.path.isfile(args.out):
        with open(args.out, encoding="utf-8") as f:
            record = json.load(f)
    fp = fingerprint()
    if record.get("fingerprint") != fp:  # measured on other rules: none of it is true of this code
        record = {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    record["fingerprint"] = fp
    record.setdefault("seeds", {})
    for seed in seeds:
        figures = measure(seed, args, fp, commit.strip() or None)
        figures["commit"] = made_under(os.path.join(ROOT, f"{args.runs}-s{seed}"))["commit"]  # trained at
        record["seeds"][str(seed)] = figures
        # the command that measures every seed on record (a seed measured alone joins the others)
        record["command"] = "python benchmarks/learning.py " + " ".join(f"--seed {s}" for s in sorted(
            record["seeds"], key=int)) + (" --toy" if args.toy else "")
        with open(args.out, "w", encoding="utf-8") as f:  # after each seed: a later failure keeps it
            json.dump(record, f, indent=1, ensure_ascii=False)
        lines = figures["lines"]
        print(f"seed {seed}: " + ", ".join(f"{k} {'met' if v['met'] else 'not met' if v['met'] is False else 'n/a'}"
                                           for k, v in lines.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
