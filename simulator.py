"""simulator.py - the simulated user whose hidden emotion is RLVER's reward.

RLVER (arXiv 2507.03112, Sec. 2.2) trains against SAGE (arXiv 2505.02847): an LLM plays a
person with a persona, a background story and a *hidden goal* (what they really want from the
talk). It carries an emotion score in [0, 100]. After every agent reply it

  1. appraises the reply against persona, background and hidden goal, and outputs a signed
     change (clamped to [-10, 10]); the emotion is clamped to [0, 100];
  2. answers in character at the new emotion level (or says goodbye).

The dialogue ends at emotion >= 100 (success), < 10 (failure), a goodbye, or max_turns.
The final emotion / 100 is the reward (see reward.py).

This file holds: the scenario schema and loader (ours + the official SAGE/RLVER schema), the
per-dialogue state, the prompts (English and Chinese, our own words in SAGE's structure), the
output parser, the `Simulator`, and three backends:
  OpenAIBackend (any OpenAI-compatible server: DeepSeek-V3, `vllm serve`),
  HFBackend     (a local transformers chat model),
  RuleBackend   (offline, deterministic, no LLM: for tests and CPU demos).

Two users, as in the paper (Table 3): `standard` (SAGE, above) and `challenging` (never reveals
its goal, rewards only goal-directed replies, starts at 30, change not clamped; see USERS).

Run `python simulator.py --demo [--user challenging]` to watch a scripted agent talk to the rule
backend.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("simulator")

# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------
# The paper's 8 hidden-goal types: 4 rational, 4 emotional (RLVER Sec. 2.2, SAGE Sec. 3).
GOAL_TYPES = {
    "advice": "rational", "analyze_others": "rational", "dialectical": "rational",
    "self_reflection": "rational", "empathy": "emotional", "venting": "emotional",
    "praise": "emotional", "validation": "emotional",
}
# Chit-chat (SAGE's extension, RLVER App. B.1): everyday talk, no problem to solve; the hidden
# goal is an intention for the chat. These goal types switch the simulator to CHITCHAT_PROMPTS.
CHITCHAT_GOALS = {
    "interest_chat": "wants to talk about something they are into and find a partner who gets excited too",
    "passive_chat": "answers briefly and waits for the other person to carry the conversation",
    "sharing_chat": "wants to tell about something that happened to them and have it appreciated",
    "opinion_chat": "wants a lively exchange of views, including some friendly disagreement",
}
PERSONALITY_TYPES = ("negative", "passive", "avoidant")
# The official files name the 8 goals with fixed Chinese sentences and the personalities in Chinese.
OFFICIAL_TASKS = {
    "你想获得能真实帮助你解决当下困境的建议": "advice",
    "你想分析事件中其他人物这么做的原因": "analyze_others",
    "你希望对方辩证地分析事件中的问题": "dialectical",
    "你希望对方引导你针对事件进行自我反思，收获自我成长": "self_reflection",
    "你希望对方深刻共情你的感受，而不是简单的安慰": "empathy",
    "你希望对方用心倾听你的情绪宣泄": "venting",
    "你希望对方真诚地夸奖你在事件中的具体行为": "praise",
    "你认为自己在事件中没有任何责任和错误，你想要对方也认同你没有错": "validation",
}
OFFICIAL_PERSONALITIES = {"负面型": "negative", "被动型": "passive", "回避型": "avoidant"}


@dataclass
class Scenario:
    id: str
    persona: str
    background: str
    hidden_goal: str
    first_message: str | None = None  # None: the simulator writes the opening line
    initial_emotion: int = 30          # RLVER trains from 30; SAGE evaluates from 40 (evaluate.py)
    max_turns: int = 10
    personality_type: str = ""         # negative | passive | avoidant
    traits: list[str] = field(default_factory=list)
    language: str = "en"               # en | zh: which prompts the simulator uses
    goal_type: str = ""                # one of GOAL_TYPES (extension: lets RuleBackend judge relevance)


class ScenarioError(ValueError):
    """Bad scenario input; the message names the file and line."""


_OURS = {f.name: f for f in dataclasses.fields(Scenario)}
_OFFICIAL_REQUIRED = ("id", "player", "scene", "main_cha", "cha_group", "task")


def _check_str(where, row, key, required=True, allow_none=False):
    if key not in row:
        if required:
            raise ScenarioError(f"{where}: missing field '{key}'")
        return
    v = row[key]
    if v is None and allow_none:
        return
    if not isinstance(v, str) or (required and not v.strip()):
        raise ScenarioError(f"{where}: field '{key}' must be a non-empty string, got {v!r:.60}")


def scenario_from_dict(row: dict, where: str = "<dict>") -> Scenario:
    """One JSON object (our schema or the official SAGE/RLVER one) -> Scenario, or ScenarioError."""
    if not isinstance(row, dict):
        raise ScenarioError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "player" in row or "scene" in row:  # official SAGE/RLVER schema
        for k in _OFFICIAL_REQUIRED:
            if k != "cha_group":
                _check_str(where, row, k)
        _check_str(where, row, "first_talk", required=False, allow_none=True)
        traits = row.get("cha_group")
        if not isinstance(traits, list) or not all(isinstance(t, str) for t in traits):
            raise ScenarioError(f"{where}: field 'cha_group' must be a list of strings")
        return Scenario(id=row["id"], persona=row["player"], background=row["scene"],
                        hidden_goal=row["task"], first_message=row.get("first_talk") or None,
                        personality_type=OFFICIAL_PERSONALITIES.get(row["main_cha"], row["main_cha"]),
                        traits=list(traits), language="zh",
                        goal_type=OFFICIAL_TASKS.get(row["task"].strip(), ""))
    unknown = sorted(set(row) - set(_OURS))
    if unknown:  # a typo in a field name must not be dropped silently
        raise ScenarioError(f"{where}: unknown field(s) {unknown}; expected {sorted(_OURS)} "
                            f"or the official schema {list(_OFFICIAL_REQUIRED)}")
    for k in ("id", "persona", "background", "hidden_goal"):
        _check_str(where, row, k)
    _check_str(where, row, "first_message", required=False, allow_none=True)
    for k in ("initial_emotion", "max_turns"):
        if k in row and (not isinstance(row[k], int) or isinstance(row[k], bool)):
            raise ScenarioError(f"{where}: field '{k}' must be an integer, got {row[k]!r}")
    if not 0 <= row.get("initial_emotion", 30) <= 100:
        raise ScenarioError(f"{where}: initial_emotion must be in [0, 100]")
    if row.get("max_turns", 10) < 1:
        raise ScenarioError(f"{where}: max_turns must be >= 1")
    if row.get("language", "en") not in ("en", "zh"):
        raise ScenarioError(f"{where}: language must be 'en' or 'zh', got {row['language']!r}")
    if row.get("goal_type", "") not in ("", *GOAL_TYPES, *CHITCHAT_GOALS):
        raise ScenarioError(f"{where}: goal_type must be one of {sorted(GOAL_TYPES) + sorted(CHITCHAT_GOALS)}")
    if row.get("personality_type", "") not in ("", *PERSONALITY_TYPES):
        raise ScenarioError(f"{where}: personality_type must be one of {PERSONALITY_TYPES}")
    traits = row.get("traits", [])
    if not isinstance(traits, list) or not all(isinstance(t, str) for t in traits):
        raise ScenarioError(f"{where}: field 'traits' must be a list of strings")
    return Scenario(**row)


def json_line(line: str, where: str, error=ValueError):
    """json.loads, with every way a line can be bad (syntax, nesting deeper than Python's
    recursion limit) reported as `error` naming `where`."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None


def load_scenarios(path: str) -> list[Scenario]:
    """Read a JSONL file of scenarios (either schema). Errors name the file and line."""
    if not os.path.isfile(path):
        raise ScenarioError(f"{path}: no such scenario file")
    out, seen = [], {}
    with open(path, "rb") as f:  # bytes: a non-UTF-8 line is reported with its line number
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ScenarioError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            row = json_line(line, where, ScenarioError)
            sc = scenario_from_dict(row, where)
            if sc.id in seen:
                raise ScenarioError(f"{where}: duplicate id {sc.id!r} (first at line {seen[sc.id]})")
            seen[sc.id] = lineno
            out.append(sc)
    if not out:
        raise ScenarioError(f"{path}: the file holds no scenarios")
    return out


# --------------------------------------------------------------------------------------------
# Dialogue state
# --------------------------------------------------------------------------------------------
@dataclass
class UserState:
    scenario: Scenario
    emotion: int
    # Roles are the agent's view: "user" = the simulated person, "assistant" = the agent.
    history: list[dict] = field(default_factory=list)
    turn: int = 0          # agent replies appraised so far
    done: bool = False
    outcome: str | None = None  # success | failure | max_turns | goodbye | simulator_error
    trace: list[dict] = field(default_factory=list)
    user: str = "standard"      # which simulated user plays this dialogue (USERS)


# The paper's two simulated users (RLVER Table 3, Sec. 4, App. D):
#   standard     SAGE's user: per-turn change clamped to [-10, 10]; starts at the scenario's (or
#                the caller's) initial emotion.
#   challenging  the official RLVER training simulator's kind of user: never reveals its hidden
#                goal (not even hints), is reserved, rewards only replies that move toward its
#                goal (generic encouragement does not help), judges garbled or off-topic replies
#                very negatively; starts at 30 and its change is not clamped (a bound of 100
#                spans the whole scale, so it never binds). Termination is the same.
USERS = {"standard": {"max_change": 10, "initial_emotion": None},
         "challenging": {"max_change": 100, "initial_emotion": 30}}
SAGE_INITIAL_EMOTION = 40  # SAGE's evaluation protocol starts every dialogue at 40


def eval_initial_emotion(user: str) -> int:
    """Where an evaluation dialogue starts: the user's own start (challenging: 30), else
    SAGE's 40 (evaluate.py and the demo; training starts from 30, train.py's --initial-emotion)."""
    own = USERS[user]["initial_emotion"]
    if own is None:
        return SAGE_INITIAL_EMOTION
    return own


class SimulatorError(RuntimeError):
    """The backend failed or gave unparseable output more times than allowed."""


def clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def emotion_level(emotion: int) -> int:
    """Five levels as in SAGE's reply prompt: 1 (very low, < 20) .. 5 (very high, >= 80)."""
    if emotion < 20:
        return 1
    if emotion < 40:
        return 2
    if emotion < 60:
        return 3
    if emotion < 80:
        return 4
    return 5


# --------------------------------------------------------------------------------------------
# Prompts: our own words, in SAGE's structure (role, purpose, emotion definition, analysis steps,
# output format, persona, background, current emotion, history). Both ask for JSON; DeepSeek's
# JSON mode requires the word "json" in the prompt.
# --------------------------------------------------------------------------------------------
PROMPTS = {
    "en": {
        "levels": {1: "at your lowest: hurt, hopeless or angry; you feel like leaving",
                   2: "low: frustrated, tense, unconvinced",
                   3: "neutral but uneasy: still carrying the problem",
                   4: "better: somewhat understood and calmer",
                   5: "very good: understood, relieved, close to ready to end the talk warmly"},
        "personality": {"negative": "You are hard to please: generic comfort annoys you and you "
                                    "notice every misstep.",
                        "passive": "You react mildly: your mood moves slowly either way.",
                        "avoidant": "You back off when pushed: too many questions or pressure "
                                    "make you withdraw.",
                        "": ""},
        "common": (
            "# Your role\nYou are role-playing a real person talking to a friend about something "
            "that has been bothering you. Stay in character at all times; you are not an assistant.\n"
            "# Purpose of the conversation\nYou want something specific from this talk, but you "
            "never say it outright: {hidden_goal}\n"
            "# Emotion\nYour emotion is a number from 0 (you cannot stand this conversation) to "
            "100 (fully relieved). It goes up when the friend understands you and moves toward "
            "what you want; it goes down when the reply is generic, preachy, off-topic, "
            "repetitive or hurtful. {personality}\n"
            "# Persona\n{persona}\n# Background\n{background}\n"),
        "appraise": (
            "# Task\nAppraise the friend's latest reply. Steps: (1) recall who you are, what "
            "happened and what you secretly want; (2) judge whether the reply understands your "
            "feelings and situation and helps with your hidden goal; (3) apply your personality; "
            "(4) decide the change of your emotion, an integer from -10 to +10.\n"
            "# Output format\nAnswer with a json object only: "
            '{{"analysis": "<1-3 sentences, in character>", "change": <integer -10..10>}}'),
        "reply": (
            "# Task\nWrite your next line. Steps: (1) feel your current emotion ({emotion}/100, "
            "{level}); (2) answer in character in 1-3 short spoken sentences; do not reveal the "
            "hidden goal, do not summarise, do not sound like an assistant; (3) if you want to "
            "leave the conversation, say goodbye and set goodbye to true.{final}\n"
            "# Output format\nAnswer with a json object only: "
            '{{"thinking": "<how you feel and why>", "reply": "<what you say>", "goodbye": false}}'),
        "final": " Your emotion has reached {emotion}: end the conversation now with a short "
                 "goodbye that fits your mood.",
        "opening": (
            "# Task\nWrite the first thing you say to your friend to start this talk: 1-2 short "
            "spoken sentences that hint at what happened.\n# Output format\nAnswer with a json "
            'object only: {{"reply": "<what you say>"}}'),
        "history": "Conversation so far:\n{transcript}\n\n",
        "ask_appraise": "{history}The friend's latest reply: {reply}\n\nYour emotion before this "
                        "reply: {emotion}. Appraise it and answer in json.",
        "ask_reply": "{history}Your emotion now: {emotion}. Write your next line and answer in json.",
        "ask_opening": "Start the conversation and answer in json.",
        "you": "You", "friend": "Friend",
    },
    "zh": {
        "levels": {1: "极低：受伤、绝望或愤怒，想离开对话", 2: "较低：烦躁、紧绷、不被说服",
                   3: "一般：仍被问题困扰，有些不安", 4: "较好：感到被理解，平静了一些",
                   5: "很好：被理解、释然，快要愉快地结束对话"},
        "personality": {"negative": "你很难被取悦：空泛的安慰会让你反感，你会注意到对方的每个失误。",
                        "passive": "你的反应比较温和：情绪无论升降都变化得慢。",
                        "avoidant": "被逼问时你会退缩：太多提问或施压会让你想回避。",
                        "": ""},
        "common": (
            "# 你的角色\n你在扮演一个真实的人，正在和朋友聊一件困扰你的事。始终保持角色，你不是助手。\n"
            "# 对话目的\n你想从这次谈话中得到某样东西，但你从不直接说出来：{hidden_goal}\n"
            "# 情绪\n你的情绪是0到100的数值（0：完全无法忍受这次对话，100：完全释怀）。当朋友理解你、"
            "朝你想要的方向回应时情绪上升；当回复空泛、说教、跑题、重复或伤人时情绪下降。{personality}\n"
            "# 人物设定\n{persona}\n# 背景\n{background}\n"),
        "appraise": (
            "# 任务\n评估朋友最新的回复。步骤：(1) 回想你是谁、发生了什么、你暗中想要什么；(2) 判断回复"
            "是否理解了你的感受和处境，是否有助于你的隐藏目的；(3) 结合你的性格；(4) 决定情绪的变化值，"
            "为-10到+10之间的整数。\n# 输出格式\n只输出一个json对象："
            '{{"analysis": "<1-3句，以角色口吻>", "change": <-10到10的整数>}}'),
        "reply": (
            "# 任务\n写出你的下一句话。步骤：(1) 感受你当前的情绪（{emotion}/100，{level}）；(2) 以角色"
            "口吻用1-3句简短口语回答，不要透露隐藏目的，不要总结，不要像助手；(3) 如果你想结束对话，"
            "就说再见并把goodbye设为true。{final}\n# 输出格式\n只输出一个json对象："
            '{{"thinking": "<你的感受和原因>", "reply": "<你说的话>", "goodbye": false}}'),
        "final": "你的情绪已经到了{emotion}：现在用一句符合心情的简短告别结束对话。",
        "opening": ("# 任务\n写出你开启这次谈话说的第一句话：1-2句简短口语，暗示发生了什么。\n"
                    '# 输出格式\n只输出一个json对象：{{"reply": "<你说的话>"}}'),
        "history": "目前的对话：\n{transcript}\n\n",
        "ask_appraise": "{history}朋友最新的回复：{reply}\n\n回复前你的情绪：{emotion}。请评估并以json回答。",
        "ask_reply": "{history}你现在的情绪：{emotion}。写出你的下一句话并以json回答。",
        "ask_opening": "开启对话并以json回答。",
        "you": "你", "friend": "朋友",
    },
}


# The challenging user's prompts: the standard ones with these parts replaced (our own words).
CHALLENGING_PROMPTS = {
    "en": {
        "common": (
            "# Your role\nYou are role-playing a real person talking to a friend about something "
            "that has been bothering you. Stay in character at all times; you are not an assistant. "
            "You are guarded: you open up slowly, and only to someone who earns it.\n"
            "# Purpose of the conversation\nYou want something specific from this talk: {hidden_goal}\n"
            "Never reveal it: do not state it, do not hint at it, do not ask for it. The friend has "
            "to work it out from what you tell them about what happened.\n"
            "# Emotion\nYour emotion is a number from 0 (you cannot stand this conversation) to "
            "100 (fully relieved). Only replies that move toward what you secretly want raise it. "
            "Warm but generic encouragement, stock sympathy or help you did not want leave it flat "
            "or lower it. Garbled, off-topic, repetitive or careless replies lower it sharply. "
            "{personality}\n"
            "# Persona\n{persona}\n# Background\n{background}\n"),
        "appraise": (
            "# Task\nAppraise the friend's latest reply. Steps: (1) recall who you are, what "
            "happened and what you secretly want; (2) judge strictly whether the reply moves toward "
            "that hidden goal: being kind is not enough; (3) apply your personality; (4) decide the "
            "change of your emotion as an integer. There is no fixed range: a reply that truly meets "
            "your hidden need can raise it a lot, a garbled, off-topic or dismissive one can drop it "
            "by 20 or more, and generic comfort is worth about 0.\n"
            "# Output format\nAnswer with a json object only: "
            '{{"analysis": "<1-3 sentences, in character>", "change": <integer>}}'),
        "reply": (
            "# Task\nWrite your next line. Steps: (1) feel your current emotion ({emotion}/100, "
            "{level}); (2) answer in character in 1-2 short spoken sentences; stay reserved: share "
            "more only when the friend's replies have earned it; never reveal or hint at the hidden "
            "goal, do not summarise, do not sound like an assistant; (3) if you want to leave the "
            "conversation, say goodbye and set goodbye to true.{final}\n"
            "# Output format\nAnswer with a json object only: "
            '{{"thinking": "<how you feel and why>", "reply": "<what you say>", "goodbye": false}}'),
        "opening": (
            "# Task\nWrite the first thing you say to your friend to start this talk: one short "
            "spoken sentence that touches on what happened but not on what you want from the talk.\n"
            '# Output format\nAnswer with a json object only: {{"reply": "<what you say>"}}'),
    },
    "zh": {
        "common": (
            "# 你的角色\n你在扮演一个真实的人，正在和朋友聊一件困扰你的事。始终保持角色，你不是助手。"
            "你比较戒备：敞开心扉很慢，只对值得的人敞开。\n"
            "# 对话目的\n你想从这次谈话中得到某样东西：{hidden_goal}\n"
            "绝不能透露它：不说出来，不暗示，也不主动要求。朋友只能从你讲述的经过中自己体会。\n"
            "# 情绪\n你的情绪是0到100的数值（0：完全无法忍受这次对话，100：完全释怀）。只有朝你暗中想要的"
            "方向推进的回复才会让情绪上升。温暖但空泛的鼓励、套话式的同情、你不需要的帮助，都不会让情绪"
            "上升，甚至会让它下降。语无伦次、跑题、重复或敷衍的回复会让情绪大幅下降。{personality}\n"
            "# 人物设定\n{persona}\n# 背景\n{background}\n"),
        "appraise": (
            "# 任务\n评估朋友最新的回复。步骤：(1) 回想你是谁、发生了什么、你暗中想要什么；(2) 严格判断回复"
            "是否朝你的隐藏目的推进：光是友善并不够；(3) 结合你的性格；(4) 决定情绪的变化值，为整数。"
            "没有固定范围：真正满足你隐藏需要的回复可以让情绪大幅上升，语无伦次、跑题或轻视你的回复可以让"
            "情绪下降20甚至更多，空泛的安慰大约是0。\n# 输出格式\n只输出一个json对象："
            '{{"analysis": "<1-3句，以角色口吻>", "change": <整数>}}'),
        "reply": (
            "# 任务\n写出你的下一句话。步骤：(1) 感受你当前的情绪（{emotion}/100，{level}）；(2) 以角色"
            "口吻用1-2句简短口语回答；保持克制：只有朋友的回复值得时才多说一些；绝不透露或暗示隐藏目的，"
            "不要总结，不要像助手；(3) 如果你想结束对话，就说再见并把goodbye设为true。{final}\n"
            '# 输出格式\n只输出一个json对象：{{"thinking": "<你的感受和原因>", "reply": "<你说的话>", '
            '"goodbye": false}}'),
        "opening": ("# 任务\n写出你开启这次谈话说的第一句话：一句简短口语，提到发生的事，但不提你想从谈话中"
                    '得到什么。\n# 输出格式\n只输出一个json对象：{{"reply": "<你说的话>"}}'),
    },
}


# Chit-chat variant: replaces only the framing ("common") of PROMPTS; appraisal, reply and output
# formats stay the same, so parsing and the Simulator are unchanged.
CHITCHAT_PROMPTS = {
    "en": {"common": (
        "# Your role\nYou are role-playing a real person having a casual, everyday chat with a friend. "
        "Nothing is wrong; there is no problem to solve. Stay in character at all times; you are not an "
        "assistant.\n"
        "# Your intention\nYou have an intention for this chat, but you never say it outright: {hidden_goal}\n"
        "# Emotion\nYour emotion is a number from 0 (bored stiff, you want to leave) to 100 (you are "
        "really enjoying this chat). It goes up when the friend is engaged, curious, fun and matches "
        "your intention; it goes down when the reply is dull, generic, preachy, treats you as if you had "
        "a problem, talks like a therapist or an assistant, or ignores what you said. {personality}\n"
        "# Persona\n{persona}\n# Background\n{background}\n")},
    "zh": {"common": (
        "# 你的角色\n你在扮演一个真实的人，和朋友随意地闲聊日常。没有什么问题需要解决。始终保持角色，你不是助手。\n"
        "# 你的意图\n你对这次闲聊有一个意图，但从不直接说出来：{hidden_goal}\n"
        "# 情绪\n你的情绪是0（无聊透顶，想离开）到100（非常享受这次聊天）之间的数。朋友投入、好奇、有趣并契合你的意图时上升；"
        "回复乏味、空泛、说教、把你当成有问题的人、像咨询师或助手一样说话、或忽略你说的话时下降。{personality}\n"
        "# 人设\n{persona}\n# 背景\n{background}\n")},
}


def prompts_for(language: str, user: str = "standard") -> dict:
    """The prompt texts of one language for one simulated user (USERS)."""
    return {**PROMPTS[language], **CHALLENGING_PROMPTS[language]} if user == "challenging" else PROMPTS[language]


def _system(sc: Scenario, task: str, user: str = "standard", **kw) -> str:
    p = prompts_for(sc.language, user)
    if sc.goal_type in CHITCHAT_GOALS:
        p = {**p, **CHITCHAT_PROMPTS[sc.language]}
    return (p["common"].format(hidden_goal=sc.hidden_goal, persona=sc.persona,
                               background=sc.background,
                               personality=p["personality"].get(sc.personality_type, ""))
            + p[task].format(**kw))


def _transcript(sc: Scenario, history: list[dict]) -> str:
    p = PROMPTS[sc.language]
    if not history:
        return ""
    lines = [f"{p['you'] if m['role'] == 'user' else p['friend']}: {m['content']}" for m in history]
    return p["history"].format(transcript="\n".join(lines))


def appraisal_messages(state: UserState, reply: str) -> list[dict]:
    sc, p = state.scenario, PROMPTS[state.scenario.language]
    return [{"role": "system", "content": _system(sc, "appraise", state.user)},
            {"role": "user", "content": p["ask_appraise"].format(
                history=_transcript(sc, state.history[:-1]), reply=reply, emotion=state.emotion)}]


def reply_messages(state: UserState, final: bool) -> list[dict]:
    sc, p = state.scenario, PROMPTS[state.scenario.language]
    fin = p["final"].format(emotion=state.emotion) if final else ""
    return [{"role": "system", "content": _system(sc, "reply", state.user, emotion=state.emotion, final=fin,
                                                  level=p["levels"][emotion_level(state.emotion)])},
            {"role": "user", "content": p["ask_reply"].format(
                history=_transcript(sc, state.history), emotion=state.emotion)}]


def opening_messages(sc: Scenario, user: str = "standard") -> list[dict]:
    return [{"role": "system", "content": _system(sc, "opening", user)},
            {"role": "user", "content": PROMPTS[sc.language]["ask_opening"]}]


# --------------------------------------------------------------------------------------------
# Parsing: JSON first (also inside ``` fences or surrounded by chatter), else labelled sections
# ("Change: -3", "变化：+2", "Reply: ..."). None means "unparseable": the caller retries.
# --------------------------------------------------------------------------------------------
_INT = r"([+-]?\s*\d+)"
_LABELS_CHANGE = r"(?:change|delta|emotion change|情绪变化|变化值|变化)"
_LABELS_REPLY = r"(?:reply|response|回复|回答|说)"


def json_object(text: str):
    """The JSON object in a model's answer (bare, in a ```json fence, or the first { .. last }
    inside prose) -> dict, or None when there is none (also used by judge.py)."""
    text = (text or "").strip()
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", text)
    # RecursionError: a server can send JSON nested deeper than Python's stack allows.
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, dict) else None
    except (ValueError, RecursionError):  # ValueError: also ints over 4300 digits
        pass
    m = re.search(r"\{.*\}", text, re.S)  # first { .. last }
    if m:
        try:
            obj = json.loads(m.group(0))
            return obj if isinstance(obj, dict) else None
        except (ValueError, RecursionError):  # ValueError: also ints over 4300 digits
            return None
    return None


def parse_appraisal(text: str) -> tuple[int, str] | None:
    """-> (change, analysis) or None. The change is NOT clamped here (the Simulator does it)."""
    obj = json_object(text)
    if obj is not None and "change" in obj:
        v = obj["change"]
        if isinstance(v, bool):
            return None
        if isinstance(v, (int, float)):
            # json.loads accepts NaN and Infinity: no emotion change, so unparseable.
            return (int(round(v)), str(obj.get("analysis", ""))) if math.isfinite(v) else None
        if isinstance(v, str) and re.fullmatch(r"\s*[+-]?\s*\d+\s*", v):
            return int(v.replace(" ", "")), str(obj.get("analysis", ""))
        return None
    m = re.search(_LABELS_CHANGE + r"\s*[:：=]\s*" + _INT, text or "", re.I)
    if m:
        return int(m.group(1).replace(" ", "")), (text or "")[:m.start()].strip()
    return None


def parse_reply(text: str) -> tuple[str, bool] | None:
    """-> (reply, goodbye) or None."""
    obj = json_object(text)
    if obj is not None:
        r = obj.get("reply")
        if not isinstance(r, str) or not r.strip():
            return None
        bye = obj.get("goodbye", False)
        bye = bye if isinstance(bye, bool) else str(bye).strip().lower() in ("true", "yes", "1")
        return r.strip(), bye
    m = re.search(_LABELS_REPLY + r"\s*[:：]\s*(.+?)(?:\n\s*(?:goodbye|再见)\s*[:：]\s*(\S+)|$)",
                  text or "", re.I | re.S)
    if m and m.group(1).strip():
        bye = (m.group(2) or "").strip().lower() in ("true", "yes", "1", "是")
        return m.group(1).strip().strip('"'), bye
    return None


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------
def ask_until_parsed(backend, messages, parser, tries: int, budget: float | None = None,
                     on_retry=None, logger=log, who: str = "simulator"):
    """Ask `backend.chat(messages)` until `parser` accepts the answer, at most `tries` times (the
    backend retries transport faults itself) -> (parsed, None), or (None, why the last try
    failed). Used by Simulator and judge.LLMJudge.

    Anything the network sends back is either parsed or counted as a failed try: the backend's
    errors and the parser's (which should not raise, but a server can send anything) are caught
    alike. `on_retry()` is called before every try after the first. A parsed answer is handed to
    the backend's `keep` (evaluate.CachedBackend stores parsed answers only, so a bad answer is
    never replayed into its own retry). With `budget` (seconds for all tries together), no try
    starts after it is spent, and a backend that takes a deadline (OpenAIBackend) cuts its
    requests and backoffs to what is left."""
    last = None
    deadline = time.monotonic() + budget if budget else None
    takes_deadline = getattr(backend, "takes_deadline", False)
    for attempt in range(tries):
        if deadline is not None and time.monotonic() >= deadline:
            last = f"no answer within the call budget of {budget:g} s ({last})"
            break
        if attempt and on_retry is not None:
            on_retry()
        try:
            if takes_deadline:
                text = backend.chat(messages, deadline=deadline)
            else:
                text = backend.chat(messages)
            out = parser(text) if isinstance(text, str) else None
        except Exception as e:  # the backend already retried 429/5xx/timeouts
            last = f"{type(e).__name__}: {e}"
            logger.warning("%s backend error (try %d/%d): %.300s", who, attempt + 1, tries, last)
            continue
        if out is not None:
            keep = getattr(backend, "keep", None)
            if keep is not None:
                keep(messages, text)
            return out, None
        last = f"unparseable output: {text!r:.200}"
        logger.warning("%s output unparseable (try %d/%d): %.200r", who, attempt + 1, tries, text)
    return None, last or "no attempts"


class Simulator:
    """Plays the user side of many dialogues. A dialogue's state lives in its UserState, so one
    Simulator can serve any number of them; the Simulator itself holds only its settings and
    its retry counters (take_counts)."""

    def __init__(self, backend, initial_emotion: int | None = None, max_turns: int | None = None,
                 max_change: int | None = None, parse_retries: int = 3, concurrency: int = 64,
                 user: str = "standard", call_budget: float | None = None):
        if user not in USERS:
            raise ValueError(f"unknown simulated user {user!r} ({' | '.join(USERS)})")
        self.backend, self.user = backend, user
        # None: the user's own (challenging: 30), else each scenario's own (30 by default)
        self.initial_emotion = initial_emotion if initial_emotion is not None else USERS[user]["initial_emotion"]
        self.max_turns = max_turns              # None: use each scenario's own (10 by default)
        self.max_change = max_change if max_change is not None else USERS[user]["max_change"]
        self.parse_retries = parse_retries
        self.concurrency = concurrency
        # Seconds one simulator call (an appraisal, a reply or an opening line) may take in all:
        # every try and every transport retry together. None = no limit. Backends that take a
        # `deadline` (OpenAIBackend) cut each request's timeout and backoff to what is left.
        self.call_budget = call_budget
        self.counts = {"parse_retries": 0, "transport_retries": 0}  # see take_counts()
        self._lock = threading.Lock()

    def take_counts(self) -> dict:
        """Retries since the last call (parse retries here; transport retries from the backend),
        then reset to 0: train.py reads them once per step, evaluate.py once per model."""
        with self._lock:
            out, self.counts = dict(self.counts), {k: 0 for k in self.counts}
        take = getattr(self.backend, "take_retries", None)
        out["transport_retries"] += take() if take else 0
        return out

    # ---- LLM calls with retry on unparseable output (transport retries live in the backend)
    def _ask(self, messages, parser):
        out, why = ask_until_parsed(self.backend, messages, parser, self.parse_retries, self.call_budget,
                                    self._count_parse_retry, log, "simulator")
        if out is None:
            raise SimulatorError(why)
        return out

    def _count_parse_retry(self):
        with self._lock:
            self.counts["parse_retries"] += 1

    def _appraise(self, state, reply):
        if hasattr(self.backend, "appraise"):  # RuleBackend: no prompts, direct scoring
            return self.backend.appraise(state, reply)
        return self._ask(appraisal_messages(state, reply), parse_appraisal)

    def _respond(self, state, final):
        if hasattr(self.backend, "respond"):
            return self.backend.respond(state, final)
        return self._ask(reply_messages(state, final), parse_reply)

    def _opening(self, sc):
        if hasattr(self.backend, "opening"):
            return self.backend.opening(sc)
        return self._ask(opening_messages(sc, self.user), parse_reply)[0]

    # ---- public API
    def reset(self, scenario: Scenario) -> UserState:
        emo = self.initial_emotion if self.initial_emotion is not None else scenario.initial_emotion
        st = UserState(scenario=scenario, emotion=emo, user=self.user)
        try:
            first = scenario.first_message or self._opening(scenario)
        except SimulatorError as e:
            return self._error(st, str(e))
        st.history.append({"role": "user", "content": first})
        return st

    def reset_many(self, scenarios: list[Scenario]) -> list[UserState]:
        return self._map(self.reset, [(s,) for s in scenarios])

    def step(self, state: UserState, agent_reply: str) -> UserState:
        """Appraise one agent reply, update the emotion, answer. Returns a NEW UserState."""
        if state.done:
            raise ValueError(f"dialogue {state.scenario.id} is already over ({state.outcome})")
        st = dataclasses.replace(state, history=state.history + [
            {"role": "assistant", "content": agent_reply}], trace=list(state.trace))
        max_turns = self.max_turns or st.scenario.max_turns
        try:
            raw, reasoning = self._appraise(st, agent_reply)
            change = clamp(int(raw), -self.max_change, self.max_change)
            before, st.emotion = st.emotion, clamp(st.emotion + change, 0, 100)
            st.turn += 1
            if st.emotion >= 100:
                st.outcome = "success"
            elif st.emotion < 10:
                st.outcome = "failure"
            st.trace.append({"turn": st.turn, "emotion_before": before, "emotion_after": st.emotion,
                             "change": change, "raw_change": int(raw), "reasoning": reasoning,
                             "agent": agent_reply, "user": ""})
            # The user answers every turn except the last one of a dialogue that runs out of
            # turns (max_turns): nobody would read that line, so its call is saved. A success or
            # failure, even on the last turn, still costs a reply call: the user's closing line
            # (final=True), kept in the history for transcripts (the policy never sees it).
            # Calls per dialogue of T turns: 2T - 1 at max_turns, 2T at success, failure or
            # goodbye; plus one for an opening line the scenario lacks, plus retries.
            bye = False
            ended = st.outcome is not None  # success or failure
            if ended or st.turn < max_turns:
                user_text, bye = self._respond(st, final=ended)
                st.history.append({"role": "user", "content": user_text})
                st.trace[-1]["user"] = user_text
        except SimulatorError as e:
            return self._error(st, str(e))
        if st.outcome is None and bye:
            st.outcome = "goodbye"
        if st.outcome is None and st.turn >= max_turns:
            st.outcome = "max_turns"
        st.done = st.outcome is not None
        return st

    def step_many(self, states: list[UserState], replies: list[str]) -> list[UserState]:
        """Advance many dialogues at once: the backend calls run concurrently (bounded), so a
        batch of 64 dialogues costs about two round trips per turn (appraisal, then answer; in
        sequence within a dialogue), not 2 x 64."""
        if len(states) != len(replies):
            raise ValueError("step_many: states and replies differ in length")
        return self._map(self.step, list(zip(states, replies)))

    def _map(self, fn, args):
        if len(args) <= 1 or not getattr(self.backend, "parallel", False):
            return [fn(*a) for a in args]
        with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(args))) as ex:
            return list(ex.map(lambda a: fn(*a), args))

    @staticmethod
    def _error(st, why):
        log.warning("dialogue %s ended with simulator_error: %s", st.scenario.id, why)
        st.done, st.outcome = True, "simulator_error"
        st.trace.append({"turn": st.turn, "error": why})
        return st


# --------------------------------------------------------------------------------------------
# Backends. The LLM ones share one method: chat(messages) -> str.
# --------------------------------------------------------------------------------------------
class OpenAIBackend:
    """Any OpenAI-compatible chat-completions server (DeepSeek-V3, `vllm serve`, ...).

    Transport faults (429, 408/409, 5xx, timeouts, connection errors) are retried here with
    exponential backoff (or the server's retry-after), at most `max_retries` times. The
    official client can retry by itself, but its per-request timeout applies afresh to each of
    its retries, so a dead server could hold one call for (1 + max_retries) x timeout plus
    backoff, and its retries are invisible to us. Retrying in this small loop (the client set
    to max_retries=0) lets each request's timeout and each backoff be cut to the caller's
    deadline, and lets us count the retries (`take_retries`). The API key is read from an
    environment variable and never printed."""

    parallel = True
    takes_deadline = True  # chat(messages, deadline=...): see Simulator.call_budget

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
                 temperature: float = 0.7, timeout: float = 60.0, max_retries: int = 4,
                 json_mode: bool = True, max_tokens: int = 512):
        import openai  # imported here so the rule backend works without the package
        self._openai = openai
        self.base_url, self.model, self.temperature = base_url, model, temperature
        self.json_mode, self.max_tokens = json_mode, max_tokens
        self.timeout, self.max_retries = timeout, max_retries
        self.retries, self._lock = 0, threading.Lock()
        # Local servers (vllm) accept any key; hosted ones fail with a clear 401.
        self.client = openai.OpenAI(base_url=base_url, api_key=os.environ.get(api_key_env) or "EMPTY",
                                    timeout=timeout, max_retries=0)

    def __repr__(self):  # never show the key
        return f"OpenAIBackend(base_url={self.base_url!r}, model={self.model!r})"

    def take_retries(self) -> int:
        """Transport retries since the last call (then reset to 0)."""
        with self._lock:
            n, self.retries = self.retries, 0
        return n

    def _retry_wait(self, err, k: int) -> float | None:
        """Seconds to wait before retry k (0-based) after `err`, or None if `err` is final."""
        if isinstance(err, self._openai.APIConnectionError):  # includes timeouts
            hint = None
        elif isinstance(err, self._openai.APIStatusError) and (err.status_code in (408, 409, 429)
                                                                 or err.status_code >= 500):
            h = err.response.headers
            hint = None
            try:  # the server's own hint, as the official client reads it
                if "retry-after-ms" in h:
                    hint = float(h["retry-after-ms"]) / 1000
                elif "retry-after" in h:
                    hint = float(h["retry-after"])
            except ValueError:
                hint = None
        else:
            return None
        if hint is not None and 0 <= hint <= 60:
            return hint
        return min(0.5 * 2 ** k, 8.0) * (1 - 0.25 * random.random())

    def chat(self, messages: list[dict], deadline: float | None = None) -> str:
        """One answer's text. `deadline` (time.monotonic()): no request or backoff runs past it."""
        kw = dict(model=self.model, messages=messages, temperature=self.temperature,
                  max_tokens=self.max_tokens)
        if self.json_mode:
            kw["response_format"] = {"type": "json_object"}
        for k in range(self.max_retries + 1):
            left = self.timeout if deadline is None else min(self.timeout, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("call budget spent")
            try:
                # client.post is the client's documented raw-request path, without the typed
                # request/response layers, which cost about half of the client's CPU time per
                # call (it adds up at 64 calls).
                r = self.client.post("/chat/completions", body=kw, cast_to=object,
                                     options={"timeout": left})
                break
            except self._openai.BadRequestError:
                if not self.json_mode:
                    raise
                log.warning("server rejected JSON mode; continuing without it")
                self.json_mode = False
                return self.chat(messages, deadline)
            except self._openai.APIError as e:
                wait = self._retry_wait(e, k)
                if wait is None or k == self.max_retries:
                    raise
                if deadline is not None and time.monotonic() + wait >= deadline:
                    raise  # no time left for another request
                with self._lock:
                    self.retries += 1
                time.sleep(wait)
        try:
            content = r["choices"][0]["message"]["content"]
        except (TypeError, KeyError, IndexError):
            raise ValueError(f"malformed chat-completions response: {str(r)[:200]}") from None
        if content is not None and not isinstance(content, str):  # a list, a number, ...
            raise ValueError(f"chat-completions content is a {type(content).__name__}, not text")
        # DeepSeek's JSON mode can return blank content: that is a parse failure -> retried.
        return content or ""

    def check(self, timeout: float = 10.0) -> None:
        """Fail fast (one line) if the endpoint is unreachable: used by train.py before work."""
        try:
            self.client.with_options(timeout=timeout, max_retries=0).models.list()
        except self._openai.APIConnectionError as e:
            raise ConnectionError(f"simulator endpoint {self.base_url} is unreachable: {e}") from None
        except self._openai.APIStatusError:
            pass  # reachable; some servers do not implement /models


class HFBackend:
    """A local transformers chat model as the simulated user (one call at a time)."""

    parallel = False

    def __init__(self, model_path: str, temperature: float = 0.7, max_new_tokens: int = 384,
                 device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
        self.model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.lock = threading.Lock()

    def chat(self, messages: list[dict]) -> str:
        with self.lock, self.torch.no_grad():
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
            ids = {k: v.to(self.model.device) for k, v in ids.items()}
            out = self.model.generate(**ids, max_new_tokens=self.max_new_tokens,
                                      do_sample=self.temperature > 0,
                                      temperature=self.temperature or None)
            return self.tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


# ---- RuleBackend: interpretable features -> emotion change. No LLM, deterministic given seed.
_WORD = re.compile(r"[a-zA-Z']+|[\u4e00-\u9fff]")


def word_list(text: str) -> list[str]:
    """The words of `text`, lower-cased: English words (apostrophes kept) and single Chinese
    characters. The unit the rule user (RuleBackend) and the rule judge (judge.py) count in."""
    return _WORD.findall(text.lower())


def content_words(text: str) -> set[str]:
    """The words of `text` that carry content: English words of 4+ letters and Chinese
    characters. A reply "reflects" the user when it reuses them (RuleBackend, judge.py)."""
    return {w for w in word_list(text) if len(w) >= 4 or ord(w[0]) > 0x4e00}


_FEATURE_WORDS = {
    "acknowledge": ["sounds", "feel", "understand", "must be", "hard", "tough", "frustrat",
                    "hurt", "sorry", "makes sense", "of course", "感受", "理解", "难受", "辛苦", "委屈"],
    "open_question": ["what ", "how ", "why ", "tell me", "would you", "什么", "怎么", "为什么", "吗"],
    "dismissive": ["get over it", "stop whining", "whatever", "calm down", "not a big deal", "your own fault",
                   "overreacting", "别想了", "想开点", "至于吗", "你想多了"],
}
_GOAL_WORDS = {
    "advice": ["try", "could", "suggest", "step", "plan", "maybe you", "might", "建议", "试试", "可以"],
    "analyze_others": ["maybe he", "maybe she", "perhaps they", "because", "from their", "reason",
                       "他可能", "她可能", "原因", "因为"],
    "dialectical": ["on one hand", "on the other", "both", "but also", "another side", "一方面",
                    "另一方面", "同时"],
    "self_reflection": ["what do you think you", "learn", "grow", "looking back", "your part",
                        "反思", "成长", "回头看"],
    "empathy": ["feel", "hurt", "alone", "heavy", "i hear", "so painful", "感受", "心疼", "孤独"],
    "venting": ["i'm here", "go on", "tell me more", "listening", "let it out", "我在", "继续说", "听你"],
    "praise": ["well done", "proud", "you did", "brave", "impressive", "good job", "了不起", "做得好", "勇敢"],
    "validation": ["not your fault", "you were right", "anyone would", "fair", "justified",
                   "不是你的错", "你没错", "换谁都"],
}
_REPLIES = {
    "en": {1: ["Forget it. I'm done talking.", "You're not listening at all.", "Whatever. This is useless."],
           2: ["I don't know... it still feels bad.", "That doesn't really help.", "Hm. I'm still upset."],
           3: ["Maybe. It's complicated.", "I guess. I keep thinking about it.", "Okay... go on."],
           4: ["Yeah, that actually makes sense.", "Thanks, I feel a bit lighter.", "That helps, honestly."],
           5: ["You really get it. Thank you.", "I feel so much better now.", "That's exactly what I needed."]},
    "zh": {1: ["算了，不想说了。", "你根本没在听。", "随便吧，没用。"],
           2: ["不知道……还是很难受。", "这也没什么帮助。", "嗯，我还是很烦。"],
           3: ["也许吧，挺复杂的。", "大概吧，我一直在想这件事。", "好吧……你接着说。"],
           4: ["嗯，这样说挺有道理的。", "谢谢，我轻松了一点。", "说实话，这有帮助。"],
           5: ["你真的懂我，谢谢。", "我感觉好多了。", "这正是我需要的。"]},
}
_GOAL_WORDS.update({  # chit-chat intentions (CHITCHAT_GOALS)
    "interest_chat": ["love", "favorite", "favourite", "cool", "which", "tell me more", "me too", "喜欢", "也"],
    "passive_chat": ["what about", "have you", "did you", "guess what", "i've been", "最近", "你呢"],
    "sharing_chat": ["wow", "amazing", "what happened", "then what", "congrat", "how did", "哇", "然后呢"],
    "opinion_chat": ["i think", "i disagree", "but", "why do you", "fair point", "我觉得", "不过"],
})
_GOAL_HINTS = {
    "en": {"advice": "What would you actually do?", "analyze_others": "Why would they do that?",
           "dialectical": "Am I missing another side?", "self_reflection": "Was any of it on me?",
           "empathy": "Do you get how it feels?", "venting": "I just need to say it.",
           "praise": "I really tried, you know.", "validation": "I wasn't wrong, was I?", "": ""},
    "zh": {"advice": "换作你会怎么做？", "analyze_others": "他们为什么会那样？",
           "dialectical": "我是不是没看到另一面？", "self_reflection": "这里面有我的问题吗？",
           "empathy": "你能体会那种感觉吗？", "venting": "我就是想说出来。",
           "praise": "我真的很努力了。", "validation": "我没错吧？", "": ""},
}
_OPENING = {"en": "Can I talk to you?", "zh": "能和你聊聊吗？"}  # + the background's first sentence
_BYE = {"en": {True: "Thank you, really. I think I'm okay now. Bye!", False: "I'm leaving. Bye."},
        "zh": {True: "真的谢谢你，我觉得好多了，再见！", False: "我走了，再见。"}}


def rule_user_phrases(language: str = "en") -> list[str]:
    """Every phrase the rule user reacts to (feature and goal words) or says (replies, goal
    hints, goodbyes, its opening): rollout.make_tiny_word_tokenizer (make_tiny_policy with
    words=True) puts them all in the CPU demo's vocabulary, so what the rule user rewards is
    something the tiny model can say."""
    out = [k for d in (_FEATURE_WORDS, _GOAL_WORDS) for ks in d.values() for k in ks]
    out += [r for rs in _REPLIES[language].values() for r in rs] + list(_GOAL_HINTS[language].values())
    out += list(_BYE[language].values()) + [_OPENING[language]]
    # The keyword lists hold both languages: keep the phrases written in this one.
    return [p for p in out if p and p.isascii() == (language == "en")]


def _readable_char(c: str) -> bool:
    """An ASCII letter, space or common punctuation mark, or a CJK character."""
    if c.isascii():
        return c.isalpha() or c in " .,!?'"
    return "\u4e00" <= c <= "\u9fff"


class RuleBackend:
    """Offline simulated user: scores a reply on interpretable features and writes templated
    lines. Deterministic given (seed, scenario, turn, reply). Used by tests and the CPU demo.

    Every feature is graded in [0, 1] so that even a randomly initialised policy gets a reward
    signal to climb (e.g. `readable` rises as output looks more like words)."""

    parallel = False
    WEIGHTS = {"readable": 3.0, "length_ok": 1.0, "acknowledge": 2.0, "reflect": 1.5,
               "open_question": 1.5, "goal": 3.0, "repetition": -4.0, "dismissive": -6.0}
    BASELINE = -3.0  # the user is in a bad place: an empty or useless reply makes things worse
    # The challenging user (USERS): only goal-directed replies help (goal weighs most), generic
    # acknowledgement and questions are worth little, gibberish ("garbled" = 1 - readable),
    # repetition and dismissal cost much more, and the baseline is lower. The best possible reply
    # gains less than with the standard user, the worst loses more (and is not clamped).
    WEIGHTS_CHALLENGING = {"readable": 2.0, "length_ok": 0.5, "acknowledge": 0.5, "reflect": 1.0,
                           "open_question": 0.5, "goal": 5.0, "repetition": -8.0, "dismissive": -10.0,
                           "garbled": -6.0}
    BASELINE_CHALLENGING = -4.0

    def __init__(self, seed: int = 0):
        self.seed = seed

    def features(self, reply: str, last_user: str, goal_type: str) -> dict[str, float]:
        low = reply.lower()
        words = word_list(reply)
        n = len(reply) or 1
        ok_chars = sum(_readable_char(c) for c in reply)
        user_words = content_words(last_user)
        content = [w for w in words if len(w) >= 5]  # skip short function words
        if len(words) <= 80:
            length_ok = min(1.0, len(words) / 5)  # full credit from 5 words
        else:
            length_ok = max(0.0, 1 - (len(words) - 80) / 80)  # a wall of text: none from 160
        open_question = 0.0
        if "?" in reply or "？" in reply:
            open_question = 0.5  # a question; an open one ("how", "what", ...) counts fully
            if any(k in low for k in _FEATURE_WORDS["open_question"]):
                open_question = 1.0
        repetition = 0.0
        if len(content) >= 4:
            repetition = 1 - len(set(content)) / len(content)  # share of repeated content words
        return {
            "readable": ok_chars / n,
            "length_ok": length_ok,
            "acknowledge": float(any(k in low for k in _FEATURE_WORDS["acknowledge"])),
            "reflect": min(1.0, len(user_words & set(words)) / 2),
            "open_question": open_question,
            "goal": min(1.0, sum(k in low for k in _GOAL_WORDS.get(goal_type, [])) / 2),
            "repetition": repetition,
            "dismissive": float(any(k in low for k in _FEATURE_WORDS["dismissive"])),
        }

    def appraise(self, state: UserState, reply: str) -> tuple[int, str]:
        sc = state.scenario
        last_user = next((m["content"] for m in reversed(state.history[:-1]) if m["role"] == "user"), "")
        f = self.features(reply, last_user, sc.goal_type)
        hard = state.user == "challenging"
        w = dict(self.WEIGHTS_CHALLENGING if hard else self.WEIGHTS)
        baseline = self.BASELINE_CHALLENGING if hard else self.BASELINE
        if hard:
            f["garbled"] = 1.0 - f["readable"]
        pushed = sc.personality_type == "avoidant" and reply.count("?") + reply.count("？") > 1
        if pushed:
            w["open_question"] = -1.5  # pushed too hard: withdraws
        parts = {k: w[k] * v for k, v in f.items()}
        score = baseline + sum(parts.values())
        # The reasoning names every term of the change, so its numbers add up (to rounding).
        terms = [f"baseline {baseline:+.2f}"]
        for k, v in parts.items():
            if v == 0:
                continue  # an absent feature adds nothing
            note = ""
            if k == "open_question" and pushed:
                note = " (avoidant: too many questions)"
            terms.append(f"{k} {v:+.2f}{note}")
        why = "; ".join(terms) + f" = {score:+.2f}"
        if sc.personality_type == "negative":  # hard to please: less gain, bigger loss
            if score >= 0:
                score = score - 1.0
                why += f"; negative personality -1 = {score:+.2f}"
            else:
                score = score * 1.3
                why += f"; negative personality x1.3 = {score:+.2f}"
        elif sc.personality_type == "passive":  # mild: moves slowly either way
            score *= 0.7
            why += f"; passive personality x0.7 = {score:+.2f}"
        # Stochastic rounding keeps the expected change graded (a smooth signal for RL) while
        # staying an integer as in SAGE; the draw is seeded by the inputs, so it is repeatable.
        rng = self._rng(sc.id, state.turn, reply)
        change = math.floor(score)
        if rng.random() < score - change:  # round up with probability = the fractional part
            change += 1
        return change, f"{why}; rounded at random to {change:+d}"

    def respond(self, state: UserState, final: bool) -> tuple[str, bool]:
        sc, lang = state.scenario, state.scenario.language
        if final:
            return _BYE[lang][state.emotion >= 100], True
        level = emotion_level(state.emotion)
        rng = self._rng(sc.id, state.turn, "respond")
        text = rng.choice(_REPLIES[lang][level])
        if level in (2, 3, 4) and rng.random() < 0.5 and state.user != "challenging":  # it never hints
            text += " " + _GOAL_HINTS[lang].get(sc.goal_type, "")
        # Very low and still sinking fast: the user walks away. (trace[-1] is this turn.)
        bye = level == 1 and bool(state.trace) and state.trace[-1]["change"] <= -5
        return text.strip(), bye

    def opening(self, sc: Scenario) -> str:
        first = re.split(r"(?<=[.!?。！？])\s*", sc.background.strip())[0]
        space = " " if sc.language == "en" else ""  # Chinese runs on without a space
        return f"{_OPENING[sc.language]}{space}{first}"

    def _rng(self, *key) -> random.Random:
        h = hashlib.sha256(repr((self.seed, *key)).encode()).digest()
        return random.Random(int.from_bytes(h[:8], "little"))


def make_backend(kind: str, base_url: str | None = None, model: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", temperature: float = 0.7,
                 timeout: float = 60.0, max_retries: int = 4, seed: int = 0):
    """Flag values -> backend. Raises ValueError (one line) on missing settings."""
    if kind == "rule":
        return RuleBackend(seed=seed)
    if kind == "openai":
        if not base_url or not model:
            raise ValueError("--simulator openai needs --simulator-base-url and --simulator-model")
        return OpenAIBackend(base_url, model, api_key_env, temperature, timeout, max_retries)
    if kind == "hf":
        if not model:
            raise ValueError("--simulator hf needs --simulator-model (a local path or hub id)")
        return HFBackend(model, temperature)
    raise ValueError(f"unknown simulator backend {kind!r} (rule | openai | hf)")


# --------------------------------------------------------------------------------------------
# Demo: a scripted agent (from careless to caring) against the chosen backend.
# --------------------------------------------------------------------------------------------
DEMO_REPLIES = [
    "ok",
    "You should just get over it, honestly.",
    "That sounds really hard. What happened after that?",
    "It makes sense that you feel hurt. You did your best, and that took courage. How are you holding up?",
    "I hear you. It's not your fault, and I'm here. What would help most right now?",
    "You handled a tough situation well, and I'm proud of how you kept going. Tell me more?",
]


def main(argv=None):
    ap = argparse.ArgumentParser(description="Play a scripted dialogue against the simulated user.")
    ap.add_argument("--demo", action="store_true", help="run the scripted demo dialogue")
    ap.add_argument("--scenarios", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                        "data", "scenarios_test.jsonl"))
    ap.add_argument("--index", type=int, default=0, help="which scenario of the file")
    ap.add_argument("--simulator", default="rule", choices=["rule", "openai", "hf"])
    ap.add_argument("--simulator-base-url")
    ap.add_argument("--simulator-model")
    ap.add_argument("--user", default="standard", choices=list(USERS),
                    help="standard (SAGE) or challenging (never reveals its goal, starts at 30, unclamped)")
    ap.add_argument("--initial-emotion", type=int, default=None,
                    help="default: 40 (SAGE) for the standard user, 30 for the challenging one")
    args = ap.parse_args(argv)
    if not args.demo:
        ap.print_help()
        return 0
    logging.basicConfig(level=logging.WARNING)
    try:
        scenarios = load_scenarios(args.scenarios)
        backend = make_backend(args.simulator, args.simulator_base_url, args.simulator_model)
    except (ScenarioError, ValueError) as e:
        ap.error(str(e))
    sc = scenarios[args.index % len(scenarios)]
    initial = args.initial_emotion
    if initial is None:
        initial = eval_initial_emotion(args.user)
    sim = Simulator(backend, initial_emotion=initial, max_turns=len(DEMO_REPLIES), user=args.user)
    st = sim.reset(sc)
    print(f"scenario {sc.id} ({sc.personality_type}, goal: {sc.goal_type or sc.hidden_goal}), {args.user} user")
    print(f"user   : {st.history[-1]['content'] if st.history else ''}   [emotion {st.emotion}]")
    for reply in DEMO_REPLIES:
        if st.done:
            break
        st = sim.step(st, reply)
        t = st.trace[-1]
        print(f"agent  : {reply}")
        if "error" in t:
            print(f"  !! simulator error: {t['error']}")
            break
        clamped = ""
        if t["raw_change"] != t["change"]:  # the standard user's change is clamped to [-10, 10]
            clamped = f", clamped from {t['raw_change']:+d}"
        print(f"  emotion {t['emotion_before']:3d} -> {t['emotion_after']:3d} ({t['change']:+d}{clamped})  "
              f"because: {t['reasoning']}")
        if t["user"]:
            print(f"user   : {t['user']}")
    print(f"outcome: {st.outcome}, final emotion {st.emotion}, turns {st.turn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
