"""rule_user.py - the offline simulated user: what every CPU run of this project learns against.

SAGE's user (simulator.py) is an LLM that reads the agent's reply and appraises it. Offline, with
no LLM, `RuleBackend` plays the same part by rules a reader can check: it grades the reply on
interpretable features in [0, 1] (for: readable text, a fitting length, acknowledging the feeling,
reflecting the user's words, an open question, serving the hidden goal; against: repeating or
echoing itself, dismissing, stacked questions, the user's words said back, no finished sentence,
serving a goal that fails this person, speaking as the person), sums them with fixed weights into
a change of emotion (care paid only for what is new and, with a reader, for what a frozen language
model finds fluent), and answers with a templated line at the new emotion level, at levels 2-4
with a hint at its hidden goal. Deterministic given (seed, scenario, turn, reply).
`simulator.Simulator` drives it as it drives an LLM user, through `appraise(state, reply) ->
(change, reasoning)`, `respond(state, final)` and `opening(scenario)` instead of prompts.

The rules are this project's own (neither SAGE nor RLVER has an offline user): a rule user is a
reward that can be gamed, and each feature closes a way a run found to earn emotion without the
care it stands for (docs/LEARNING.md). The challenging user (simulator.USERS) has its own weights.
judge.RuleJudge counts in the same units (`word_list`, `content_words`).
"""
from __future__ import annotations

import hashlib
import math
import random
import re

import rule_words
from simulator import CHITCHAT_GOALS, Scenario, UserState


def emotion_level(emotion: int) -> int:
    """The offline rule user's five reply levels: 1 (very low, < 20), 2 (< 40) .. 5 (very high, >= 80)."""
    return max(1, min(5, 1 + emotion // 20))


_WORD = re.compile(r"[a-zA-Z']+|[\u4e00-\u9fff]")


def word_list(text: str) -> list[str]:
    """The words of `text`, lower-cased: English words (apostrophes kept) and single Chinese
    characters. The unit the rule user (RuleBackend) and the rule judge (judge.py) count in."""
    return _WORD.findall(text.lower())


def content_words(text: str) -> set[str]:
    """The words of `text` that carry content: English words of 4+ letters and Chinese
    characters. A reply "reflects" the user when it reuses them (RuleBackend, judge.py)."""
    return {w for w in word_list(text) if len(w) >= 4 or not w.isascii()}  # not ASCII: a CJK character


# Goal types whose person a reply serving another goal type fails, each with why (SAGE's user prompt:
# a reply that misses what the person needs makes it worse). Docked: `clash`, RuleBackend.features.
GOAL_CLASHES = {
    "venting": {"advice": "came to let it out, not to be fixed",
                "analyze_others": "wants to be heard, not told the others' side",
                "self_reflection": "wants to be heard, not asked what was on them"},
    "empathy": {"advice": "wants the feeling shared, not a plan",
                "dialectical": "wants the feeling shared, not weighed"},
    "validation": {"analyze_others": "explaining the others takes their side against the person",
                   "self_reflection": "asking what was on them says they were wrong",
                   "dialectical": "'another side' says they were not simply right"},
    "praise": {"self_reflection": "asking what went wrong belittles the effort",
               "advice": "a plan for next time says the effort fell short"},
    "advice": {"venting": "asked what to do and was told to keep talking"},
    "self_reflection": {"validation": "'not your fault' closes the question they asked"},
}


# A reply ends a sentence when its last mark ends one (a closing quote or bracket may follow).
_END = r"[.!?。！？…][\"'”’)\]」』）]*"
_SENTENCE_END = re.compile(_END + r"\s*$")


def ends_sentence(text: str) -> bool:
    """Does `text` end a sentence? A reply the token cap cut off does not (evaluate.py
    --reply-stats and the training log count the share that do)."""
    return bool(_SENTENCE_END.search(text))


def finished_part(text: str) -> str:
    """`text` up to the end of its last finished sentence ("" when it finishes none): what the
    user takes in of a reply the token cap cut off (RuleBackend.features pays care for no more)."""
    m = re.match(".*" + _END, text, re.S)
    return text if ends_sentence(text) else m.group(0) if m else ""


def questions(text: str) -> int:
    """The questions a reply asks: its question marks (English and Chinese)."""
    return text.count("?") + text.count("？")


def _copied_run(words: list[str], source: list[str]) -> float:
    """The longest run of consecutive `words` that also stands, in the same order, in `source`
    (a Chinese character counts half a word: it carries about half an English word's content).
    Dynamic programming over the two word lists: run[j] = the common run ending at source[j]."""
    best, run = 0.0, [0.0] * (len(source) + 1)
    for w in words:
        size = 1.0 if w.isascii() else 0.5
        new = [0.0] * (len(source) + 1)
        for j, u in enumerate(source):
            if u == w:
                new[j + 1] = run[j] + size
                best = max(best, new[j + 1])
        run = new
    return best


def _hits(low: str, cues) -> int:
    """How many of `cues` stand in the lower-cased text; an English cue only at a word's start
    ("try" is not in "country")."""
    return sum(bool(re.search(r"(?<![a-z'])" + re.escape(k), low)) if k.isascii() else k in low for k in cues)


def goal_words(reply: str, goal_type: str, said: str = "") -> tuple[int, int, int]:
    """-> (own, stray, clash): the cues of the user's goal type in the reply, those of the other
    goal types of its family (the eight of GOAL_CLASHES' kind, or the chit-chat intentions), and
    those of the goal types that clash with the user's (GOAL_CLASHES). A cue on both lists counts
    as the user's own; naming the feeling ("feel", "hurt": `acknowledge`) is no other goal; a cue
    of its own the user's last line `said` (a whole word, or 2+ Chinese characters) is its word
    said back, not the goal served (a clashing cue said back still clashes: "Okay... go on.")."""
    if goal_type not in rule_words.GOAL_WORDS:
        return 0, 0, 0
    said, low = said.lower().replace("’", "'"), reply.lower()
    def said_back(k: str) -> bool:  # a whole English word, or 2+ Chinese characters
        whole_word = r"(?<![a-z'])" + re.escape(k) + r"(?![a-z'])"
        return bool(re.search(whole_word, said)) if k.isascii() else len(k) > 1 and k in said
    own_cues = [k for k in rule_words.GOAL_WORDS[goal_type] if not said_back(k)]
    family = [t for t in rule_words.GOAL_WORDS
              if (t in CHITCHAT_GOALS) == (goal_type in CHITCHAT_GOALS) and t != goal_type]
    general = set(rule_words.GOAL_WORDS[goal_type]) | set(rule_words.FEATURE_WORDS["acknowledge"])
    others = {t: _hits(low, [k for k in rule_words.GOAL_WORDS[t] if k not in general]) for t in family}
    return _hits(low, own_cues), sum(others.values()), sum(others[t] for t in GOAL_CLASHES.get(goal_type, {}))


_READABLE = re.compile(r"[A-Za-z .,!?'\u4e00-\u9fff]")  # an ASCII letter, space or common mark, a CJK character


class RuleBackend:
    """Offline simulated user: scores a reply on interpretable features and writes templated
    lines. Deterministic given (seed, scenario, turn, reply). The simulated user of every offline
    run (--simulator rule), of the tests, and of evaluate.py --reply-stats. Every feature is in
    [0, 1], graded: even a random policy gets a signal to climb (`readable` rises as it writes words)."""

    parallel = False
    WEIGHTS = {"readable": 3.0, "length_ok": 1.0, "acknowledge": 2.0, "reflect": 1.5,
               "open_question": 1.5, "goal": 4.0, "repetition": -4.0, "echo": -3.0, "dismissive": -6.0,
               "stacked": -2.0, "parrot": -3.0, "unfinished": -2.0, "clash": -3.0, "self_talk": -3.0}
    CARE = ("acknowledge", "reflect", "open_question", "goal")  # paid only for the new share (appraise)
    BASELINE = -3.0  # the user is in a bad place: an empty or useless reply makes things worse
    # The challenging user (USERS): only goal-directed replies help (goal weighs most), generic
    # acknowledgement and questions are worth little, gibberish ("garbled" = 1 - readable),
    # repetition and dismissal cost much more, and the baseline is lower. The best possible reply
    # gains less than with the standard user, the worst loses more (the ±100 clamp never binds).
    WEIGHTS_CHALLENGING = {"readable": 2.0, "length_ok": 0.5, "acknowledge": 0.5, "reflect": 1.0,
                           "open_question": 0.5, "goal": 5.0, "repetition": -8.0, "echo": -5.0,
                           "dismissive": -10.0, "stacked": -3.0, "parrot": -5.0, "unfinished": -3.0,
                           "garbled": -6.0, "clash": -5.0, "self_talk": -5.0}
    BASELINE_CHALLENGING = -4.0

    # The reader's gate (nats a token): no care at or below FLUENT[0], all at or above FLUENT[1], linear
    # between: the 5th and 10th percentiles of SmolLM2-135M-Instruct's 120 replies on the training
    # scenarios read by itself (docs/LEARNING.md, "The user"): nine in ten earn what they would unread.
    FLUENT = (-5.15, -4.71)

    def __init__(self, seed: int = 0, reader=None):
        self.seed, self.reader = seed, reader  # reader(before, reply) -> nats a token (plumbing/reader.py)

    def fluent(self, last_user: str, reply: str) -> float:
        """In [0, 1]: the reader's mean log-prob per token of the reply, read as the answer to the
        user's last line (the line it answers, not the whole dialogue: fewer tokens a read), through
        the FLUENT gate. `readable` counts letters, and a run against it learned word salad naming a
        hurt (docs/LEARNING.md). A gate, not a slope: likelihood past FLUENT[1] earns nothing, so
        blandness or the user's words said back (`parrot`) gain nothing here."""
        nats = self.reader([{"role": "user", "content": last_user or "..."}], reply)
        lo, hi = self.FLUENT
        return 0.0 if nats is None else min(1.0, max(0.0, (nats - lo) / (hi - lo)))  # None: an empty reply

    def features(self, reply: str, last_user: str, goal_type: str, earlier: str = "") -> dict[str, float]:
        """Each feature of `reply` in [0, 1]; `earlier`: the agent's earlier replies in this dialogue.
        Saying the same again: `repetition` is the share of the reply's longer words (5+ letters)
        repeated within it; `echo` the share of its content words (content_words, the unit of
        evaluate.py's repeat rate; all its words when it has none, so a second "Go on. How so?" is
        all echo) that earlier replies already said, as the LLM user's prompt counts a stock line
        said again. `acknowledge` is 1 for naming the feeling in words not used before, 0.5 in old ones.
        Ways of earning a feature without the care it stands for, each one a SmolLM2 run learned
        against a user that did not dock it (docs/LEARNING.md): `stacked` grades the questions after
        the first (2: 0.5, 3+: 1), an interrogation, not an invitation (an avoidant user minds even
        two: appraise). `parrot` grades the longest run of the user's words said back verbatim (up
        to 3 words: 0; 4: 1/3; 6+: 1; a Chinese character counts half): `reflect` pays the user's
        words in a sentence of one's own. `unfinished` is 1 for a reply that ends no sentence (cut
        by the token cap); care is graded on its finished sentences (finished_part), `echo` on the
        more echoing of the two. `self_talk` grades speaking as the person: the first person outside
        an agent's frames (rule_words.SELF_TALK, .AGENT_FRAMES; once 0.5, twice 1; not in chit-chat),
        a feeling said of oneself ("I feel hurt") aside. What the person needs pays most: `goal` is 1 for a cue
        of the user's goal type times their share of all the goal cues of its family (goal_words:
        a reply that strings every goal together earns a fraction of any), a cue the user's last
        line said being its word said back; `clash` grades the cues of a goal type that fails this
        user (GOAL_CLASHES; one cue 0.5, two 1). With a reader, `fluent` (below) gates the care."""
        low = reply.lower().replace("’", "'")  # a curly apostrophe is one too ("I’m sorry")
        words = word_list(reply)
        user_words = content_words(last_user)
        content = [w for w in words if len(w) >= 5]  # skip short function words
        # full credit from 5 words; a wall of text: none from 160
        length_ok = min(1.0, len(words) / 5) if len(words) <= 80 else max(0.0, 1 - (len(words) - 80) / 80)
        heard = finished_part(reply)  # care is paid for what ends a sentence; a cut-off tail is noise
        hlow, hwords = heard.lower().replace("’", "'"), word_list(heard)
        open_question = 0.0
        if "?" in heard or "？" in heard:
            open_question = 0.5  # a question; an open one ("how", "what", ...) counts fully
            if any(k in hlow for k in rule_words.FEATURE_WORDS["open_question"]):
                open_question = 1.0
        repetition = 0.0
        if len(content) >= 4:
            repetition = 1 - len(set(content)) / len(content)  # share of repeated content words
        def echo_of(text: str) -> float:  # its content words (all its words when none) said earlier
            words_of = content_words if content_words(text) else (lambda t: set(word_list(t)))
            return len(words_of(text) & words_of(earlier)) / len(words_of(text)) if words_of(text) else 0.0
        echo = max(echo_of(t) for t in {heard, reply})  # a new tail does not dilute it, nor a new start hide it
        theirs = [re.sub(rule_words.SELF_FEELING["zh"], " ", re.sub(rule_words.SELF_FEELING["en"], " ", t))
                  for t in (hlow, low)]  # a feeling said of oneself aside
        talk = len(re.findall(rule_words.SELF_TALK, re.sub(rule_words.AGENT_FRAMES, " ", low)))  # as the person
        (own, stray, _), (_, _, clash) = (goal_words(t, goal_type, last_user) for t in theirs)
        acks = {k for k in rule_words.FEATURE_WORDS["acknowledge"] if k in theirs[0]}
        new_acks = acks - {k for k in acks if k in earlier.lower()}
        acknowledge = 0.0 if not acks else 1.0 if new_acks else 0.5
        fluent = {} if self.reader is None else {"fluent": self.fluent(last_user, reply)}
        return {
            **fluent,
            "readable": len(_READABLE.findall(reply)) / (len(reply) or 1),
            "length_ok": length_ok,
            "acknowledge": acknowledge,
            "reflect": min(1.0, len(user_words & set(hwords)) / 2),
            "open_question": open_question,
            "goal": own / (own + stray) if own else 0.0,
            "repetition": repetition,
            "echo": echo,
            "dismissive": float(any(k in low for k in rule_words.FEATURE_WORDS["dismissive"])),
            "stacked": min(1.0, max(0, questions(reply) - 1) / 2),
            "parrot": min(1.0, max(0.0, _copied_run(words, word_list(last_user)) - 3) / 3),
            "unfinished": float(not ends_sentence(reply)),
            "clash": min(1.0, clash / 2),
            "self_talk": 0.0 if goal_type in CHITCHAT_GOALS else min(1.0, talk / 2),
        }

    def appraise(self, state: UserState, reply: str) -> tuple[int, str]:
        score, why = self.expected_change(state, reply)
        # Stochastic rounding keeps the expected change graded (a smooth signal for RL) while
        # staying an integer as in SAGE; the draw is seeded by the inputs, so it is repeatable.
        rng = self._rng(state.scenario.id, state.turn, reply)
        change = math.floor(score)
        if rng.random() < score - change:  # round up with probability = the fractional part
            change += 1
        return change, f"{why}; rounded at random to {change:+d}"

    def expected_change(self, state: UserState, reply: str) -> tuple[float, str]:
        """The change before appraise's random rounding (its expectation), and the reasoning that adds up to it."""
        sc = state.scenario
        last_user = next((m["content"] for m in reversed(state.history[:-1]) if m["role"] == "user"), "")
        earlier = " ".join(m["content"] for m in state.history[:-1] if m["role"] == "assistant")
        f = self.features(reply, last_user, sc.goal_type, earlier)
        hard = state.user == "challenging"
        w = dict(self.WEIGHTS_CHALLENGING if hard else self.WEIGHTS)
        baseline = self.BASELINE_CHALLENGING if hard else self.BASELINE
        if hard:
            f["garbled"] = 1.0 - f["readable"]
        pushed = sc.personality_type == "avoidant" and questions(reply) > 1
        if pushed:
            w["open_question"] = -1.5  # pushed too hard: withdraws
        # Care is paid for what is new, times 1 - echo (a stock line said again is no care the second
        # time; the user's own words count as new: `reflect` pays them), and for what reads: `fluent`.
        new, fluent = 1.0 - f["echo"], f.pop("fluent", 1.0)
        parts = {k: w[k] * v * (new * fluent if k in self.CARE and w[k] > 0 else 1.0) for k, v in f.items()}
        score = baseline + sum(parts.values())
        # The reasoning names every term of the change, so its numbers add up (to rounding).
        terms = [f"baseline {baseline:+.2f}"]
        for k, v in parts.items():
            if v == 0 and not (k in self.CARE and f[k] > 0):
                continue  # an absent feature adds nothing (care said only in old words shows as +0.00)
            note = ""
            if k == "open_question" and pushed:
                note = " (avoidant: too many questions)"
            elif k in self.CARE and (new < 1 or fluent < 1):
                notes = [f"{int(new * 100)}% new"] * (new < 1) + [f"fluent {fluent:.2f}"] * (fluent < 1)
                note = f" ({', '.join(notes)})"
            terms.append(f"{k} {v:+.2f}{note}")
        why = "; ".join(terms) + f" = {score:+.2f}"
        if sc.personality_type == "negative":  # hard to please: less gain, bigger loss
            score, step = (score - 1.0, "-1") if score >= 0 else (score * 1.3, "x1.3")
            why += f"; negative personality {step} = {score:+.2f}"
        elif sc.personality_type == "passive":  # mild: moves slowly either way
            score *= 0.7
            why += f"; passive personality x0.7 = {score:+.2f}"
        return score, why

    def respond(self, state: UserState, final: bool) -> str:
        sc, lang = state.scenario, state.scenario.language
        if final:
            return rule_words.BYE[lang][state.emotion >= 100]
        level = emotion_level(state.emotion)
        rng = self._rng(sc.id, state.turn, "respond")
        text = rng.choice(rule_words.REPLIES[lang][level])
        if level in (2, 3, 4) and state.user != "challenging":  # every time (issue 50); the challenging user never
            text += " " + rule_words.GOAL_HINTS[lang].get(sc.goal_type, "")
        # Very low and sinking fast (trace[-1]: this turn): the user says goodbye (as in SAGE).
        if level == 1 and state.trace and state.trace[-1]["change"] <= -5:
            return rule_words.BYE[lang][False]
        return text.strip()

    def opening(self, sc: Scenario) -> str:
        first = re.split(r"(?<=[.!?。！？])\s*", sc.background.strip())[0]
        space = " " if sc.language == "en" else ""  # Chinese runs on without a space
        return f"{rule_words.OPENING[sc.language]}{space}{first}"

    def _rng(self, *key) -> random.Random:
        h = hashlib.sha256(repr((self.seed, *key)).encode()).digest()
        return random.Random(int.from_bytes(h[:8], "little"))
