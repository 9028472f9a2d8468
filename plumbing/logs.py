"""plumbing/logs.py - metrics.jsonl, samples.jsonl, trackers and the reward curve (a reader may skip it).

metrics.jsonl holds one row per step (strict JSON: NaN and Infinity are written as null), the
numbers over all processes; samples.jsonl one readable dialogue per step; reward_curve.png the
mean reward per step and its moving average.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after matplotlib.use)

from plumbing.checkpoints import agree  # noqa: E402 (after matplotlib.use)
from plumbing.files import SaveError, append_line, written_atomically  # noqa: E402 (after matplotlib.use)
from rule_user import RuleBackend, content_words, ends_sentence, questions, word_list  # noqa: E402 (after matplotlib.use)

log = logging.getLogger("train")


def mean(xs):
    """The mean, or None for no values (JSON null: "no value", never NaN or a misleading 0)."""
    if not xs:
        return None
    return sum(xs) / len(xs)


def rollout_stats(batch) -> dict:
    """Scalar summaries of a rollout's dialogues (for logs). Means over the valid dialogues;
    with none, a mean is None (JSON null: "no value"), never 0 (that would read as a reward)."""
    ms = batch.metrics
    ok = [m for m in ms if m["valid"]]
    errors = sum(m["outcome"] == "simulator_error" for m in ms)
    agent_turns = sum(len(m["response_lengths"]) for m in ok)
    violation_rate = None
    if agent_turns:
        violation_rate = sum(m["format_violations"] for m in ok) / agent_turns
    # What the agent's replies look like, and the rule user's features of them, per step: the
    # means over the valid dialogues' replies (reply_measures), so gaming shows while it is learned.
    replies = [r for m in ok for r in (m["replies"] if "replies" in m else
                                       reply_measures(m.get("history", []), m.get("goal_type", "")))]
    return {
        "reward": mean([m["reward"] for m in ok]),
        "emotion": mean([m["emotion"] for m in ok]),
        "success_rate": mean([m["outcome"] == "success" for m in ok]),  # as --rules ended the dialogue
        "failure_rate": mean([m["outcome"] == "failure" for m in ok]),
        "turns": mean([m["turns"] for m in ok]),
        "response_length": mean([n for m in ok for n in m["response_lengths"]]),
        "format_violation_rate": violation_rate,  # per agent turn
        "simulator_errors": errors,
        "unappraised": len(ms) - len(ok) - errors,  # dialogues with no appraised turn: no score
        "dialogues": len(ms),
        **{k: v for k, v in reply_means(replies).items() if k != "replies"},
    }


def write_logs(accelerator, output_dir: str, row: dict, batch):
    """The step's row to metrics.jsonl and the trackers, and one readable sample dialogue of
    this step to samples.jsonl (files: main process only). A write the main process cannot make
    (a full disk) is a SaveError on every process (agree): the others would wait for it in the
    next collective, and their nodes would not say why."""
    outcome = None
    if accelerator.is_main_process:
        try:
            append_line(os.path.join(output_dir, "metrics.jsonl"), strict_json(row))
            if batch.metrics:
                m = batch.metrics[0]
                sample = {"step": row["step"], "scenario": m["scenario_id"], "reward": m["reward"],
                          "emotion_trace": m["emotion_trace"], "history": m["history"]}
                append_line(os.path.join(output_dir, "samples.jsonl"), strict_json(sample))
        except SaveError as e:
            outcome = e
    agree(accelerator, outcome, f"could not write the logs in {output_dir}: the main process could not write them")
    accelerator.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])


def fmt(value, spec: str) -> str:
    """A number for the progress bar; None (a step with no valid dialogue) shows as '-'."""
    if value is None:
        return "-"
    return format(value, spec)


def strict_json(obj) -> str:
    """One JSONL row that any JSON parser reads: NaN and +-Infinity become null."""
    return json.dumps(finite_or_none(obj), ensure_ascii=False, allow_nan=False)


def finite_or_none(value):
    """`value` with every NaN / +-Infinity float (in nested dicts and lists too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


AGENT_ROLES = ("assistant", "npc", "agent")  # the agent's turns: ours, and other systems' transcripts


def reply_measures(history: list[dict], goal_type: str = "") -> list[dict]:
    """What each agent reply of one dialogue looks like, to tell empathy from gaming the offline
    rule user (evaluate.py --reply-stats, and every training step's log): its words, whether it
    ends a sentence (a reply cut at the token cap does not), its questions, the share of its
    content words an earlier reply of the dialogue already used (repeat; all its words when it
    has no content word: a second "Go on. How so?" is a repeat), its tics (the times it says a
    word, not a function word, that most of the dialogue's replies say: a run learned to say
    "too" 1.05 times a reply), whether its goal words fit the user's goal (goal_fit: some of the
    user's own, in a finished sentence and not its own line's, and none of a goal type that
    clashes, rule_user.GOAL_CLASHES: the rule user's `goal` > 0 and `clash` 0; None without one),
    and each of the rule user's features (rule_user.RuleBackend.features, in [0, 1])."""
    rule, used, used_all, earlier, out = RuleBackend(), set(), set(), "", []
    replies = [(k, m["content"]) for k, m in enumerate(history) if m.get("role") in AGENT_ROLES]
    said_in = {}  # word -> in how many of the dialogue's replies
    for _, text in replies:
        for w in set(word_list(text)) - TIC_STOPWORDS:
            said_in[w] = said_in.get(w, 0) + 1
    tics = {w for w, n in said_in.items() if n >= 2 and n > len(replies) / 2}
    for k, text in replies:
        last_user = next((h["content"] for h in reversed(history[:k]) if h.get("role") == "user"), "")
        content, words = content_words(text), word_list(text)
        if content:
            repeat = len(content & used) / len(content)
        else:
            repeat = len(set(words) & used_all) / len(set(words)) if words else 0.0
        f = rule.features(text, last_user, goal_type, earlier)
        out.append({"words": len(words), "ends_sentence": float(ends_sentence(text)),
                    "questions": questions(text), "repeat": repeat, "tic": sum(w in tics for w in words),
                    "goal_fit": float(f["goal"] > 0 and f["clash"] == 0) if goal_type else None,
                    **{f"rule_{k}": v for k, v in f.items()}})
        used |= content
        used_all |= set(words)
        earlier += " " + text
    return out


# Words said in most replies of any dialogue, so no tic (plumbing.logs.reply_measures).
TIC_STOPWORDS = set("i you the a an to and it is that of in this me my your so be are was for with on at "
                    "what how not do can i'm it's that's you're we they he she but or if just".split()) | \
    set("我你的了是很吗这那就也都在有不会说")


def reply_means(measures: list[dict]) -> dict:
    """Per-reply measures (reply_measures) of many dialogues -> their means over the replies."""
    if not measures:
        return {}
    names = {"words": "words_per_reply", "ends_sentence": "sentence_share", "questions": "questions_per_reply",
             "repeat": "repeat_rate", "tic": "tics_per_reply"}
    return {"replies": len(measures),
            **{names.get(k, k): mean([m[k] for m in measures if m[k] is not None]) for k in measures[0]}}


def warn_empty_step(step: int, roll: dict):
    """A step with no row to train on (every dialogue failed or none was appraised) makes no
    update (log-probs of zero rows do not exist): a warning here, `update_skipped` = 1 in
    metrics.jsonl."""
    log.warning("step %d: no dialogue to learn from (%d simulator errors, %d never appraised); update skipped",
                step, roll["simulator_errors"], roll["unappraised"])


def setup_logging():
    """INFO lines with the time, for train.py and evaluate.py. Per-request and per-file lines
    drown the log (the openai client logs its requests through httpx, or httpx2 in openai 3);
    accelerate warns that tied embeddings (lm_head = embed_tokens) are saved once: expected."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "accelerate", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)


class UnscoredRun(RuntimeError):
    """train.py's --max-unscored-steps steps in a row had no dialogue to learn from: the run stops
    (one line, exit 1) rather than save an untrained model as final/."""


def unscored_problem(batch, step: int, steps: int) -> str:
    """The one line that stops such a run: how long, the simulator's last error (this process's),
    what to check, and that nothing was saved as trained."""
    errors = [m["error"] for m in batch.metrics if m.get("error")]
    last = f"the simulator's last error: {errors[-1][:200]}" if errors else "no simulator error (see the log)"
    return (f"no dialogue was scored in {steps} steps in a row (steps {step - steps + 1}-{step}); {last}; check the "
            f"simulated user's server (--simulator-base-url, --simulator-model, --simulator-call-budget): "
            f"it must answer the user's prompts in JSON; final/ was not written")


CURVES = [("reward", "mean reward (final emotion / 100)"), ("response_length", "tokens per agent turn"),
          ("format_violation_rate", "format violations per agent turn")]
# Curves with a panel of their own after CURVES, drawn only when the run logged them: the KL to
# the reference model (--kl-coef > 0; the k3 estimate the update logs), how far the policy moved
# from where it started (docs/LEARNING.md, "Earlier users and runs").
OPTIONAL_CURVES = [("kl", "KL to the reference (k3 per token)")]


# The last panel: what the replies look like (each a share or a feature in [0, 1], the mean per
# reply): what the rule user pays for, and the ways of gaming it that it docks.
FEATURE_CURVES = [("rule_acknowledge", "acknowledge"), ("rule_reflect", "reflect"),
                  ("rule_open_question", "open question"), ("rule_goal", "goal"), ("rule_echo", "echo"),
                  ("rule_stacked", "stacked questions"), ("rule_parrot", "parrot"), ("rule_clash", "goal clash"),
                  ("rule_self_talk", "as the person"), ("goal_fit", "fits the goal"),
                  ("sentence_share", "ends a sentence")]


def _moving_average(values, k):
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


_STARTED = time.time()  # about when the script started: this module is imported with train.py's first lines


def finish_run(cfg, out=None):
    """The end of a train.py run, on the main process: the reward curve, then a summary of what it
    learned and where it went (printed to `out`, default stdout): the step reward's first and last
    quarter, the time since the start, the final model, the curve and the logs, and the next
    command to try (evaluate the model against the one it started from)."""
    metrics, png = os.path.join(cfg.output_dir, "metrics.jsonl"), os.path.join(cfg.output_dir, "reward_curve.png")
    try:  # a by-product: a curve that cannot be drawn (its path a folder, a full disk) is a warning
        plot_curve(metrics, png, f"RLVER {cfg.algo.upper()} ({cfg.preset} preset)")
        drawn = "" if os.path.isfile(png) else " (not drawn: no scored step)"
    except Exception as e:  # the run's exit code stays what training earned
        drawn = f" (not drawn: {type(e).__name__}: {str(e)[:200]})"
        log.warning("%s: the reward curve was not drawn (%s: %s)", png, type(e).__name__, str(e)[:200])
    with open(metrics, encoding="utf-8") as f:
        rewards = [r["reward"] for r in map(json.loads, filter(str.strip, f)) if r.get("reward") is not None]
    q = max(1, len(rewards) // 4)
    spent = int(time.time() - _STARTED)
    final = os.path.join(cfg.output_dir, "final")
    lines = [f"done: {cfg.algo} on the {cfg.preset} preset, {len(rewards)} scored steps in "
             f"{spent // 3600}:{spent // 60 % 60:02d}:{spent % 60:02d}" + (
                 f"; mean step reward {mean(rewards[:q]):.3f} (first quarter) -> {mean(rewards[-q:]):.3f} (last)"
                 if rewards else ""),
             f"  final model: {final}",
             f"  curves:      {png}{drawn}",
             f"  logs:        {metrics}, {os.path.join(cfg.output_dir, 'samples.jsonl')}",
             f"  next:        python evaluate.py --model {cfg.model} --model {final} --eval-prompt train --judge none "
             f"--scenarios data/scenarios_test.jsonl --initial-emotion {cfg.initial_emotion} --max-turns "
             f"{cfg.max_turns} --max-new-tokens {cfg.max_new_tokens} --seed {cfg.seed}"
             + (f" --user-reader {cfg.user_reader}" if cfg.simulator == "rule" and cfg.user_reader != "none" else "")
             + f" --output-dir eval/{os.path.basename(os.path.normpath(cfg.output_dir))}"]
    print("\n".join(lines), file=out or sys.stdout, flush=True)


def plot_curve(metrics_path, png_path, title):
    """Per step, with a moving average: the mean reward, the agent's reply length, the share of
    its turns that broke the format, when logged the KL to the reference (OPTIONAL_CURVES) and
    what its replies look like to the rule user (FEATURE_CURVES, moving averages) -> one PNG of
    three to five panels."""
    # A value that is null (a step with no valid dialogue, or no agent turn) is not plotted in
    # its panel (not drawn as 0).
    with open(metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not any(r.get("reward") is not None for r in rows):
        return
    k = max(1, len(rows) // 10)  # the moving average: the last k steps up to each one

    def logged(curves):  # those some step has a value for
        return [(key, label) for key, label in curves if any(r.get(key) is not None for r in rows)]
    panels, features = CURVES + logged(OPTIONAL_CURVES), logged(FEATURE_CURVES)
    fig, axes = plt.subplots(1, len(panels) + bool(features),
                             figsize=(13 / 3 * len(panels) + 4.5 * bool(features), 3.5))  # 13/3 inches a panel
    for ax, (key, label) in zip(axes, panels):
        kept = [r for r in rows if r.get(key) is not None]
        steps, values = [r["step"] for r in kept], [r[key] for r in kept]
        ax.plot(steps, values, alpha=0.5, label="per step")
        ax.plot(steps, _moving_average(values, k), lw=2, label=f"moving average ({k} steps)")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if features:
        ax = axes[-1]
        for key, label in features:
            kept = [r for r in rows if r.get(key) is not None]
            ax.plot([r["step"] for r in kept], _moving_average([r[key] for r in kept], k), lw=1.5, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(f"share of replies / feature ({k}-step average)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    try:  # a full disk leaves the old curve or none, never half of one
        with written_atomically(png_path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:  # a figure left open when the file cannot be written holds its memory to the end
        plt.close(fig)


def trackers(cfg):
    if cfg.report_to == "none":
        return None
    if cfg.report_to == "auto":
        if importlib.util.find_spec("tensorboard") is None:
            return None
        return ["tensorboard"]
    return [t.strip() for t in cfg.report_to.split(",") if t.strip()]
