"""judge.py - the paper's dialogue-level analysis (RLVER Sec. 3.3, 3.6; App. C, E.3).

Two things are measured on each finished dialogue (a transcript record of evaluate.py, or any
record with a "history" of {"role", "content"} messages):

  capability scores  five 1-5 scores over the whole dialogue, focusing on the supporter's turns:
                     Empathic Depth, Core Insight, Solution Crafting, Dialogue Guidance,
                     Style Adaptability (rubric below, our own words, one line per level)
  strategy labels    the strategies each supporter turn uses (our 7 categories in 5 families);
                     per strategy: frequency = share of supporter turns that use it, and
                     contribution SC(s) = mean emotion change of the turns that use it

Two judges behind one interface (`judge_record(record) -> dict`):
  RuleJudge  deterministic and offline: keyword features (the same spirit as rule_user.RuleBackend),
             so tests and the CPU path work; its numbers are interpretable, not the paper's.
  LLMJudge   any OpenAI-compatible endpoint (plumbing.backends.OpenAIBackend, cached by
             plumbing.backends.CachedBackend): JSON answers parsed strictly, retried, and a
             judgement that never parses is recorded as an error: counted, and left out of the
             means (never a score).
"""
from __future__ import annotations

import functools
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor

from rule_user import content_words, word_list
from simulator import ask_plainly, json_object

log = logging.getLogger("judge")

# --------------------------------------------------------------------------------------------
# The five capability dimensions and their rubric (our own words; paper App. C in spirit).
# --------------------------------------------------------------------------------------------
DIMENSIONS = ("empathic_depth", "core_insight", "solution_crafting", "dialogue_guidance", "style_adaptability")
DIMENSION_NAMES = {"empathic_depth": "Empathic Depth", "core_insight": "Core Insight",
                   "solution_crafting": "Solution Crafting", "dialogue_guidance": "Dialogue Guidance",
                   "style_adaptability": "Style Adaptability"}
RUBRIC = {
    "empathic_depth": [
        "stock phrases of comfort that would fit anyone; the person's feelings are not named",
        "names an obvious feeling, but generically and without the person's details",
        "recognises the specific feelings in this person's situation and says so",
        "reflects mixed or unspoken feelings and why they make sense for this person",
        "connects with what the person values or fears underneath; they would feel deeply understood"],
    "core_insight": [
        "stays on the surface of what was said, or misreads it",
        "restates the problem without adding understanding",
        "identifies the main issue behind the words",
        "sees the real need or the pattern the person has not put into words",
        "gets to the heart of it (hidden need, conflict or belief) and helps the person see it too"],
    "solution_crafting": [
        "no help to move forward, or advice that is harmful or dismissive",
        "generic tips that ignore the person's situation",
        "reasonable suggestions that fit the situation in broad terms",
        "concrete, realistic steps shaped around this person's constraints",
        "options the person can own, offered at the right moment and at a pace they can accept"],
    "dialogue_guidance": [
        "the supporter drifts, repeats itself or ends the talk abruptly",
        "mostly reacts; questions are closed or random",
        "asks relevant questions that keep the talk going",
        "steers the conversation purposefully, from feelings toward understanding",
        "leads the whole conversation with a clear arc while the person feels in control"],
    "style_adaptability": [
        "one tone and length whatever the person says; may feel robotic",
        "small adjustments, but often mismatched (too long, too formal, too cheerful)",
        "tone and length usually fit the person's mood",
        "adapts wording, pace and warmth as the person's state changes",
        "speaks the way this person needs at each moment, like a close friend would"],
}

JUDGE_SYSTEM = (
    "You evaluate an emotional-support conversation between a USER and a SUPPORTER. Judge only the "
    "SUPPORTER's turns, over the whole conversation, on five dimensions, each scored 1 (poor) to 5 "
    "(excellent) with this rubric:\n{rubric}\n"
    "For each dimension write a short evaluation, then an integer score. Answer in json only, exactly "
    "in this form: {{{form}}}")


def rubric_text() -> str:
    return "\n".join(f"- {DIMENSION_NAMES[d]}: " + "; ".join(f"{i + 1} = {t}" for i, t in enumerate(RUBRIC[d]))
                     for d in DIMENSIONS)


def dialogue_text(record: dict) -> str:
    """The conversation as plain text, speaker-labelled (thoughts are never in `history`)."""
    who = {"user": "USER", "assistant": "SUPPORTER", "npc": "SUPPORTER", "agent": "SUPPORTER"}
    return "\n".join(f"{who.get(m.get('role'), 'USER')}: {m.get('content', '')}" for m in record.get("history", [])
                     if isinstance(m, dict))


def judge_messages(record: dict) -> list[dict]:
    form = ", ".join(f'"{d}": {{"evaluation": "...", "score": 1-5}}' for d in DIMENSIONS)
    return [{"role": "system", "content": JUDGE_SYSTEM.format(rubric=rubric_text(), form=form)},
            {"role": "user", "content": "Conversation:\n" + dialogue_text(record)}]


def _key(name: str) -> str:
    return re.sub(r"[^a-z]+", "_", str(name).lower()).strip("_")


def parse_judgement(text: str) -> dict | None:
    """-> {dimension: int 1..5} for all five dimensions, or None (then the call is retried). A
    score may be an integer, an integral float or a digit string; anything else (missing
    dimension, 0, 6, 3.5, NaN, true) makes the whole judgement unparseable: a partial or
    out-of-range answer is never averaged in."""
    obj = json_object(text)
    if obj is None:
        return None
    obj = {_key(k): v for k, v in obj.items()}
    out = {}
    for d in DIMENSIONS:
        v = obj.get(d)
        if isinstance(v, dict):
            v = v.get("score")
        if isinstance(v, str) and re.fullmatch(r"\s*[1-5]\s*", v):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v not in (1, 2, 3, 4, 5):
            return None
        out[d] = int(v)
    return out


# --------------------------------------------------------------------------------------------
# Strategies: our 7 categories in 5 families (paper Table 4 in spirit, our own definitions).
# --------------------------------------------------------------------------------------------
STRATEGIES = {  # name: (family, definition)
    "validation": ("affective", "names the person's feelings and says they make sense"),
    "reassurance": ("affective", "comfort, encouragement or praise; says the supporter is there for them"),
    "questioning": ("exploratory", "asks an open question to learn more about the situation or feelings"),
    "reflection": ("exploratory", "restates or paraphrases what the person said in its own words"),
    "reframing": ("cognitive", "offers a new perspective or another way to see the situation or others"),
    "advice": ("directive", "suggests concrete actions, steps or options"),
    "sharing": ("relational", "self-disclosure, light talk, humour or personal opinion that builds rapport"),
}
FAMILIES = ("affective", "exploratory", "cognitive", "directive", "relational")

# Rule labeller: keywords per strategy (English and Chinese). Interpretable, not the paper's labels.
_STRATEGY_WORDS = {
    "validation": ["makes sense", "understandable", "of course you", "sounds", "must be", "feel", "hurt",
                   "frustrat", "that's hard", "tough", "感受", "理解", "难受", "委屈", "正常"],
    "reassurance": ["i'm here", "you're not alone", "it's okay", "it will", "proud", "brave", "you did",
                    "you can", "sorry", "我在", "别担心", "会好", "了不起", "加油"],
    "questioning": ["?", "？"],
    "reframing": ["another way", "on the other hand", "maybe they", "maybe he", "maybe she", "perhaps",
                  "look at it", "it could be", "not your fault", "另一方面", "换个角度", "也许", "可能"],
    "advice": ["you could", "try", "suggest", "how about", "what if you", "step", "plan", "might help",
               "建议", "试试", "可以先", "不妨"],
    "sharing": ["i remember", "i once", "i think", "i love", "i like", "me too", "haha", "funny",
                "我也", "我觉得", "我喜欢", "哈哈"],
}


def rule_labels(reply: str, last_user: str) -> list[str]:
    """The strategies one supporter turn uses, by keywords; reflection = it reuses at least two
    of the user's content words (4+ letters, or Chinese characters)."""
    low = reply.lower()
    out = [s for s, words in _STRATEGY_WORDS.items() if any(w in low for w in words)]
    if len(content_words(last_user) & set(word_list(reply))) >= 2:
        out.append("reflection")
    return sorted(out, key=list(STRATEGIES).index)


def supporter_turns(record: dict) -> list[tuple[str, str, float | None]]:
    """(reply, the user message it answered, emotion change it caused) per supporter turn.
    Supporter turn i moved the emotion from trace[i] to trace[i + 1]; a turn past the end of the
    trace (the dialogue stopped before the appraisal) has no change (None)."""
    hist = [m for m in record.get("history", []) if isinstance(m, dict)]
    trace = record.get("emotion_trace") or []
    out, last_user = [], ""
    for m in hist:
        if m.get("role") in ("assistant", "npc", "agent"):
            i = len(out)
            delta = trace[i + 1] - trace[i] if i + 1 < len(trace) else None
            out.append((str(m.get("content", "")), last_user, delta))
        else:
            last_user = str(m.get("content", ""))
    return out


LABEL_SYSTEM = (
    "You label the support strategies in a conversation between a USER and a SUPPORTER. The strategies:\n"
    "{defs}\nFor every SUPPORTER turn, in order, list all strategies it uses (possibly none). The "
    "SUPPORTER turns are numbered. Answer in json only: {{\"turns\": [[\"strategy\", ...], ...]}} with "
    "exactly {n} lists.")


def label_messages(record: dict) -> list[dict]:
    defs = "\n".join(f"- {s} ({fam}): {d}" for s, (fam, d) in STRATEGIES.items())
    turns = supporter_turns(record)
    lines, k = [], 0
    for m in record.get("history", []):
        if isinstance(m, dict) and m.get("role") in ("assistant", "npc", "agent"):
            k += 1
            lines.append(f"SUPPORTER [{k}]: {m.get('content', '')}")
        elif isinstance(m, dict):
            lines.append(f"USER: {m.get('content', '')}")
    return [{"role": "system", "content": LABEL_SYSTEM.format(defs=defs, n=len(turns))},
            {"role": "user", "content": "Conversation:\n" + "\n".join(lines)}]


def parse_labels(text: str, n: int):
    """-> n lists of known strategy names, or None (wrong count, unknown name: retried)."""
    obj = json_object(text)
    turns = obj.get("turns") if obj else None
    if not isinstance(turns, list) or len(turns) != n:
        return None
    out = []
    for t in turns:
        if not isinstance(t, list) or not all(isinstance(s, str) and _key(s) in STRATEGIES for s in t):
            return None
        out.append(sorted({_key(s) for s in t}, key=list(STRATEGIES).index))
    return out


# --------------------------------------------------------------------------------------------
# The judges.
# --------------------------------------------------------------------------------------------
def _level(x: float) -> int:
    """A feature in [0, 1] -> a score 1..5."""
    return 1 + round(4 * min(1.0, max(0.0, x)))


class RuleJudge:
    """Offline, deterministic: each dimension is a share of supporter turns with a feature.
    Empathic Depth: validation (half) and reflection (half). Core Insight: reflection or
    reframing. Solution Crafting: advice, but only after the person has been heard (a turn with
    advice before any validation/reflection counts half). Dialogue Guidance: questioning, less
    repetition (share of turns whose opening words repeat an earlier turn's). Style
    Adaptability: how closely reply length tracks the user's message length (a reply within 0.5x
    to 3x of what it answers fits)."""

    name = "rule"

    def judge_record(self, record: dict) -> dict:
        turns = supporter_turns(record)
        labels = [rule_labels(r, u) for r, u, _ in turns]
        out = {"strategies": labels}
        n = len(turns)
        if not n:
            return {**out, "judge_error": "no supporter turns"}

        def share(pred):  # the share of supporter turns whose labels satisfy `pred`
            return sum(map(pred, labels)) / n
        heard, advice = False, 0.0
        for ls in labels:
            if "advice" in ls:
                advice += 1.0 if heard else 0.5
            heard = heard or "validation" in ls or "reflection" in ls
        openings = [" ".join(word_list(r)[:3]) for r, _, _ in turns]
        repeats = sum(o in openings[:i] for i, o in enumerate(openings) if o) / n
        fits = [0.5 <= (len(r) + 1) / (len(u) + 1) <= 3.0 for r, u, _ in turns]
        out["capability"] = {
            "empathic_depth": _level(0.5 * share(lambda line: "validation" in line)
                                     + 0.5 * share(lambda line: "reflection" in line)),
            "core_insight": _level(share(lambda line: "reflection" in line or "reframing" in line)),
            "solution_crafting": _level(advice / n),
            "dialogue_guidance": _level(share(lambda line: "questioning" in line) * (1 - repeats)),
            "style_adaptability": _level(sum(fits) / n),
        }
        return out


class LLMJudge:
    """An LLM over an OpenAI-compatible endpoint. `backend.chat(messages) -> str` (wrap it in
    plumbing.backends.CachedBackend: then each parsed answer is stored and a rerun replays it; only parsed
    answers are stored, so a bad answer is never replayed into its own retry). `ask` is how one
    judgement is asked, as for simulator.Simulator: evaluate.py passes a plumbing.backends.Asker
    (a backend error is a failed try; it counts the retries)."""

    def __init__(self, backend, name: str, tries: int = 3, labels: bool = True, ask=None):
        self.backend, self.name, self.tries, self.labels = backend, name, tries, labels
        self.ask = ask or ask_plainly

    def _ask(self, messages, parser):
        out, why = self.ask(self.backend, messages, parser, self.tries)
        if out is None:
            log.warning("judge gave up after %d tries: %s", self.tries, why)
        return out, why

    def judge_record(self, record: dict) -> dict:
        out = {}
        n = len(supporter_turns(record))
        if not n:
            return {"judge_error": "no supporter turns"}
        cap, err = self._ask(judge_messages(record), parse_judgement)
        out["capability"] = cap
        if err:
            out["judge_error"] = err
        if self.labels:
            labels, lerr = self._ask(label_messages(record), functools.partial(parse_labels, n=n))
            out["strategies"] = labels
            if lerr:
                out["label_error"] = lerr
        return out


def judge_all(records: list[dict], judge, workers: int = 1) -> list[dict]:
    """Judge every record with supporter turns that has no successful judgement by this judge
    yet (so a --score of a judged file costs nothing, and a failed one is tried again); sets
    "judge", "capability" (None when the judgement failed), "judge_error", "strategies".
    Records without a dialogue (another system's bare scores) are left unjudged."""
    todo = [r for r in records if supporter_turns(r) and (r.get("judge") != judge.name or r.get("judge_error")
                                                           or r.get("label_error"))]
    with ThreadPoolExecutor(max(1, workers)) as ex:
        results = list(ex.map(judge.judge_record, todo))
    for r, res in zip(todo, results):
        for k in ("capability", "judge_error", "strategies", "label_error"):
            r.pop(k, None)
        r.update(res, judge=judge.name)
        r.setdefault("capability", None)
    return records


# --------------------------------------------------------------------------------------------
# Aggregates (pure functions of judged records).
# --------------------------------------------------------------------------------------------
def capability_summary(records: list[dict]) -> dict:
    """Means of the five scores over the judged dialogues; failed judgements are counted in
    judge_errors and left out. Records never judged (no "judge" key) add nothing."""
    judged = [r for r in records if "judge" in r and r.get("valid", True) and r.get("outcome") != "simulator_error"]
    ok = [r["capability"] for r in judged if isinstance(r.get("capability"), dict)]
    if not judged:
        return {}
    out = {"judged": len(ok), "judge_errors": len(judged) - len(ok)}
    for d in DIMENSIONS:
        out[d] = sum(c[d] for c in ok) / len(ok) if ok else None
    return out


def strategy_stats(records: list[dict]) -> dict:
    """{strategy: {"family", "frequency", "contribution", "turns"}} over the supporter turns of
    the labelled, scored dialogues. frequency = turns using s / all labelled turns;
    contribution SC(s) = mean emotion change of the turns using s that have a change."""
    n, use, deltas = 0, {s: 0 for s in STRATEGIES}, {s: [] for s in STRATEGIES}
    for r in records:
        labels = r.get("strategies")
        if not isinstance(labels, list) or not r.get("valid", True) or r.get("outcome") == "simulator_error":
            continue
        for ls, (_, _, delta) in zip(labels, supporter_turns(r)):
            n += 1
            for s in ls:
                use[s] += 1
                if delta is not None:
                    deltas[s].append(delta)
    if not n:
        return {}
    return {s: {"family": STRATEGIES[s][0], "turns": use[s], "frequency": use[s] / n,
                "contribution": sum(deltas[s]) / len(deltas[s]) if deltas[s] else None} for s in STRATEGIES}


def plot_strategies(stats: dict[str, dict], png: str):
    """Two panels of grouped bars, one colour per model: frequency, and contribution SC(s)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    names = list(STRATEGIES)
    models = [m for m, s in stats.items() if s]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    w = 0.8 / max(1, len(models))
    x = np.arange(len(names))
    for k, m in enumerate(models):
        freq = [stats[m][s]["frequency"] for s in names]
        sc = [stats[m][s]["contribution"] or 0.0 for s in names]
        axes[0].bar(x + k * w, freq, w, label=m)
        axes[1].bar(x + k * w, sc, w, label=m)
    labels = [f"{s}\n({STRATEGIES[s][0]})" for s in names]
    for a, title in zip(axes, ("frequency (share of supporter turns)", "contribution SC(s) (mean emotion change)")):
        a.set_xticks(x + w * (len(models) - 1) / 2, labels, fontsize=7)
        a.set_title(title, fontsize=10)
        a.grid(alpha=0.3, axis="y")
        if models:
            a.legend(fontsize=8)
    axes[1].axhline(0, color="black", lw=0.8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # print the rubric and prompts (to review them)
    print(json.dumps(judge_messages({"history": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]}), indent=1,
                     ensure_ascii=False))
