"""reward.py - RLVER's verifiable emotion reward and the think-then-say format check.

RLVER (arXiv 2507.03112, Sec. 2.3): the reward of a whole dialogue is the simulated user's
final emotion divided by 100, a number in [0, 1] that the environment (not a learned reward
model) produces, hence "verifiable". With the think-then-say scaffold the policy must write
`<think>...</think>` and then its reply in every turn; without it, every turn must be a
non-empty reply with no think tags. A turn that breaks its format makes the dialogue's
reward 0 (format rule "paper"). The official RLVER code has no such penalty (format rule
"none"): there the text after the last `</think>` reaches the user, all of it when the tag is
missing, and the reward is the emotion's whatever the format.

Optional shaping (off by default, not in the paper): add `shaping_coef` x the mean per-turn
emotion change / 100, a denser signal for very short runs.
"""
from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.S)


def split_think(text: str) -> tuple[str, str, bool]:
    """Split a think-then-say turn into (thought, spoken reply, format_ok).

    The format holds when the text is `<think>` + a non-empty thought + `</think>` + a non-empty
    reply (white space before `<think>` allowed), with each tag exactly once. When the tags are
    in place but the thought or the reply is empty, the reply is what follows `</think>` (maybe
    empty). Otherwise (a tag missing, repeated or out of place) the whole text, tags removed,
    is treated as the reply, so the user still sees something sensible."""
    m = _THINK.match(text)
    if m and text.count(THINK_OPEN) == 1 and text.count(THINK_CLOSE) == 1:
        thought, reply = m.group(1).strip(), m.group(2).strip()
        return thought, reply, bool(thought) and bool(reply)
    return "", text.replace(THINK_OPEN, "").replace(THINK_CLOSE, "").strip(), False


def format_ok(text: str, think: bool) -> bool:
    """think=True: the think-then-say format holds. think=False: a non-empty reply with no
    think tags (a policy told not to think must not emit them)."""
    if think:
        return split_think(text)[2]
    return bool(text.strip()) and THINK_OPEN not in text and THINK_CLOSE not in text


def spoken_reply(text: str, think: bool, format_rule: str = "paper") -> str:
    """What of an agent turn reaches the user: without think the whole text; with think the
    reply after </think> (split_think); under the official code's rule ("none"), the text after
    the last </think>, or all of it when there is none (its extract_content)."""
    if not think:
        return text.strip()
    if format_rule == "none":
        return text.rsplit(THINK_CLOSE, 1)[-1].strip()
    return split_think(text)[1]


def emotion_reward(state) -> float:
    """Final emotion / 100, in [0, 1] (an emotion below 0, possible under the official code's
    rules, gives 0, as its max(e, 0) / 100). `state` is a simulator.UserState (anything with .emotion)."""
    return max(0.0, min(1.0, state.emotion / 100.0))


def dialogue_reward(state, agent_texts: list[str], think: bool, shaping_coef: float = 0.0,
                    format_rule: str = "paper") -> float:
    """The reward of one dialogue: 0 if any agent turn broke the format (format rule "paper",
    paper Sec. 2.3; "none": never), else the emotion reward, plus optional per-turn shaping. A
    dialogue that ended in `simulator_error` has no meaningful reward: callers must leave it out
    of the loss (the rollout flags it); we raise rather than score it as 0."""
    if getattr(state, "outcome", None) == "simulator_error":
        raise ValueError("a simulator_error dialogue has no reward; exclude it from the loss")
    if format_rule == "paper" and not all(format_ok(t, think) for t in agent_texts):
        return 0.0
    r = emotion_reward(state)
    if shaping_coef:
        deltas = [t["change"] for t in getattr(state, "trace", []) if "change" in t]
        r += shaping_coef * (sum(deltas) / len(deltas) / 100.0 if deltas else 0.0)
    return r
