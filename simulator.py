"""simulator.py - the simulated user whose hidden emotion is RLVER's reward.

RLVER (arXiv 2507.03112, Sec. 2.2) trains against SAGE (arXiv 2505.02847): an LLM plays a
person with a persona, a background story and a *hidden goal* (what they really want from the
talk). It carries an emotion score in [0, 100]. After every agent reply it

  1. appraises the reply against persona, background and hidden goal, and outputs a signed
     change (the standard user's is clamped to [-10, 10]; the challenging user's is not); the
     emotion stays in [0, 100] (`rules="rlver"`, the official RLVER code's: capped at 100, no floor);
  2. answers in character at the new emotion level (or says goodbye).

The dialogue ends at emotion >= 100 (success), < 10 (failure), a goodbye, or max_turns
(`rules="rlver"`: at emotion <= 0, a goodbye or max_turns; see `Simulator.step`).
The final emotion / 100 is the reward (see reward.py).

This file holds, in the order a turn uses them: the scenario and the per-dialogue state, the
prompts (English and Chinese, our own words in SAGE's structure), the output parsers, the
`Simulator` (the emotion update and the end of a dialogue), and the offline rule user
(`RuleBackend`: deterministic, no LLM, for tests and CPU demos). An LLM user is any object with
`chat(messages) -> str`: plumbing/backends.py has them (an OpenAI-compatible server such as
DeepSeek-V3 or `vllm serve`, a local transformers model), and plumbing/scenarios.py reads
scenario files (ours and the official SAGE/RLVER schema).

Two users, as in the paper (Table 3): `standard` (SAGE, above) and `challenging` (never reveals
its goal, rewards only goal-directed replies, starts at 30, change not clamped; see USERS).

`python -m plumbing.demo [--user challenging]` shows a scripted agent talking to the rule user.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
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

# The rules a dialogue ends by, and the emotion's bounds (independent of the user; README, "Where
# each rule comes from"):
#   sage   SAGE's runner (test_npc.py): end at emotion >= 100 (success) or < 10 (failure), at a
#          goodbye, or after max_turns appraised replies; emotion kept in [0, 100].
#   rlver  the official RLVER training code (vllm_rollout_spmd_think.py): end at a goodbye, at
#          emotion <= 0 (failure) or after max_turns appraised replies; no end at 100; emotion
#          capped at 100 with no floor (the reward, final / 100, is clipped at 0: reward.py).
RULES = ("sage", "rlver")
# A goodbye is a word in the user's answer, as SAGE checks it ("再见"/"拜拜" anywhere in it), or
# in English "bye" or "goodbye" as a word (either language's words, whatever the scenario's).
GOODBYE = re.compile(r"再见|拜拜|\b(?:good-?)?bye\b", re.I)


def said_goodbye(text: str) -> bool:
    return bool(GOODBYE.search(text))


def eval_initial_emotion(user: str) -> int:
    """Where an evaluation dialogue starts: the user's own start (challenging: 30), else
    SAGE's 40 (evaluate.py and the demo; training starts from 30, train.py's --initial-emotion)."""
    own = USERS[user]["initial_emotion"]
    if own is None:
        return SAGE_INITIAL_EMOTION
    return own


class SimulatorError(RuntimeError):
    """The backend failed or gave unparseable output more times than allowed."""


class EndpointError(RuntimeError):
    """The simulated user's endpoint cannot work at all (the key, the model or the URL is wrong):
    retrying will not help, so it is not a failed try but stops the run (one line, exit 2)."""


def clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def emotion_state(emotion: int) -> str:
    """SAGE's state label, what the user's answer is written from: S (>= 100), A (>= 70),
    B (>= 40), C (>= 10), F (< 10)."""
    for label, floor in (("S", 100), ("A", 70), ("B", 40), ("C", 10)):
        if emotion >= floor:
            return label
    return "F"


def emotion_level(emotion: int) -> int:
    """The offline rule user's five reply levels: 1 (very low, < 20) .. 5 (very high, >= 80)."""
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
        "states": {"S": "fully relieved and understood: thank your friend and say goodbye",
                   "A": "much better: understood, calmer, willing to talk on",
                   "B": "uneasy: still carrying the problem, not convinced yet",
                   "C": "low: frustrated, tense, close to giving up on this talk",
                   "F": "you cannot go on with this talk: say goodbye and leave"},
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
            '{{"analysis": "<objective: what the reply did for what you secretly want; subjective: how it '
            'made you feel; 1-3 sentences, in character>", "change": <integer -10..10>}}'),
        "reply": (
            "# Task\nWrite your next line. Steps: (1) read how you took the friend's latest reply "
            "(your own appraisal, below) and feel your state ({state}: {state_text}); (2) answer in "
            "character in 1-3 short spoken sentences; do not reveal the hidden goal, do not "
            "summarise, do not sound like an assistant; (3) if you want to leave the conversation, "
            "say goodbye (\"bye\" or \"goodbye\").{final}\n"
            "# Output format\nAnswer with a json object only: "
            '{{"thinking": "<how you feel and why>", "reply": "<what you say>"}}'),
        "final": " The talk is over for you: end it now with a short goodbye that fits your mood.",
        "opening": (
            "# Task\nWrite the first thing you say to your friend to start this talk: 1-2 short "
            "spoken sentences that hint at what happened.\n# Output format\nAnswer with a json "
            'object only: {{"reply": "<what you say>"}}'),
        "history": "Conversation so far:\n{transcript}\n\n",
        "ask_appraise": "{history}The friend's latest reply: {reply}\n\nYour emotion before this "
                        "reply: {emotion}. Appraise it and answer in json.",
        "ask_reply": "{history}How you took the friend's latest reply: {analysis}\nYour state now: {state}. "
                     "Write your next line and answer in json.",
        "ask_opening": "Start the conversation and answer in json.",
        "you": "You", "friend": "Friend",
    },
    "zh": {
        "states": {"S": "完全释怀、被理解：感谢朋友并说再见", "A": "好多了：被理解、平静，愿意继续聊",
                   "B": "不安：仍被问题困扰，还没被说服", "C": "低落：烦躁、紧绷，快要放弃这次谈话",
                   "F": "无法再聊下去：说再见并离开"},
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
            '{{"analysis": "<客观：这句回复对你暗中想要的有什么作用；主观：它让你有什么感受；1-3句，以角色口吻>", '
            '"change": <-10到10的整数>}}'),
        "reply": (
            "# 任务\n写出你的下一句话。步骤：(1) 读你对朋友最新回复的感受（你自己的评估，见下文），体会你的"
            "状态（{state}：{state_text}）；(2) 以角色口吻用1-3句简短口语回答，不要透露隐藏目的，不要总结，"
            "不要像助手；(3) 如果你想结束对话，就说“再见”或“拜拜”。{final}\n# 输出格式\n只输出一个json对象："
            '{{"thinking": "<你的感受和原因>", "reply": "<你说的话>"}}'),
        "final": "这次谈话对你来说已经结束：现在用一句符合心情的简短告别结束对话。",
        "opening": ("# 任务\n写出你开启这次谈话说的第一句话：1-2句简短口语，暗示发生了什么。\n"
                    '# 输出格式\n只输出一个json对象：{{"reply": "<你说的话>"}}'),
        "history": "目前的对话：\n{transcript}\n\n",
        "ask_appraise": "{history}朋友最新的回复：{reply}\n\n回复前你的情绪：{emotion}。请评估并以json回答。",
        "ask_reply": "{history}你对朋友最新回复的感受：{analysis}\n你现在的状态：{state}。写出你的下一句话并以json回答。",
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
            '{{"analysis": "<objective: what the reply did for what you secretly want; subjective: how it '
            'made you feel; 1-3 sentences, in character>", "change": <integer>}}'),
        "reply": (
            "# Task\nWrite your next line. Steps: (1) read how you took the friend's latest reply "
            "(your own appraisal, below) and feel your state ({state}: {state_text}); (2) answer in "
            "character in 1-2 short spoken sentences; stay reserved: share more only when the "
            "friend's replies have earned it; never reveal or hint at the hidden goal, do not "
            "summarise, do not sound like an assistant; (3) if you want to leave the conversation, "
            "say goodbye (\"bye\" or \"goodbye\").{final}\n"
            "# Output format\nAnswer with a json object only: "
            '{{"thinking": "<how you feel and why>", "reply": "<what you say>"}}'),
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
            '{{"analysis": "<客观：这句回复对你暗中想要的有什么作用；主观：它让你有什么感受；1-3句，以角色口吻>", '
            '"change": <整数>}}'),
        "reply": (
            "# 任务\n写出你的下一句话。步骤：(1) 读你对朋友最新回复的感受（你自己的评估，见下文），体会你的"
            "状态（{state}：{state_text}）；(2) 以角色口吻用1-2句简短口语回答；保持克制：只有朋友的回复值得时"
            "才多说一些；绝不透露或暗示隐藏目的，不要总结，不要像助手；(3) 如果你想结束对话，就说“再见”或"
            "“拜拜”。{final}\n"
            '# 输出格式\n只输出一个json对象：{{"thinking": "<你的感受和原因>", "reply": "<你说的话>"}}'),
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
    """The user's answer is written, as in SAGE, from its own appraisal of the agent's latest
    reply (the analysis text, trace[-1]) and its state label, not from the emotion's number."""
    sc, p = state.scenario, PROMPTS[state.scenario.language]
    label = emotion_state(state.emotion)
    analysis = state.trace[-1].get("reasoning", "") if state.trace else ""
    return [{"role": "system", "content": _system(sc, "reply", state.user, state=label, state_text=p["states"][label],
                                                  final=p["final"] if final else "")},
            {"role": "user", "content": p["ask_reply"].format(
                history=_transcript(sc, state.history), analysis=analysis, state=label)}]


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
    inside prose) -> dict, or None when there is none (also used by judge.py). An object with a
    key twice (two "change" values: which one?) is none."""
    text = (text or "").strip()
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", text)
    m = re.search(r"\{.*\}", text, re.S)  # first { .. last }
    for candidate in (text, m.group(0) if m else None):
        if candidate is None:
            continue
        # RecursionError: a server can send JSON nested deeper than Python's stack allows;
        # ValueError: also ints over 4300 digits, and a duplicate key.
        try:
            obj = json.loads(candidate, object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError):
            continue
        return obj if isinstance(obj, dict) else None
    return None


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError(f"a key twice: {keys}")
    return dict(pairs)


def _change(value) -> int | None:
    """An emotion change as the model wrote it -> an int, or None (unparseable): a number or a
    numeric string ("+3", "5.5"), a fraction rounded half away from zero (2.5 -> 3, -2.5 -> -3);
    NaN, Infinity (json.loads accepts both), booleans and anything else are unparseable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if not re.fullmatch(r"\s*[+-]?\s*\d+(\.\d+)?\s*", value):
            return None
        value = float(value.replace(" ", ""))
    if not isinstance(value, float) or not math.isfinite(value):
        return None
    return int(math.copysign(math.floor(abs(value) + 0.5), value))


def parse_appraisal(text: str) -> tuple[int, str] | None:
    """-> (change, analysis) or None. The change is NOT clamped here (the Simulator does it)."""
    obj = json_object(text)
    if obj is not None and "change" in obj:
        change = _change(obj["change"])
        if change is None:
            return None
        return change, str(obj.get("analysis", ""))
    if "{" in (text or ""):  # JSON that did not parse (e.g. cut off): its prose is no label
        return None
    m = re.search(_LABELS_CHANGE + r"\s*[:：=]\s*" + _INT, text or "", re.I)
    if m:
        return int(m.group(1).replace(" ", "")), (text or "")[:m.start()].strip()
    return None


def parse_reply(text: str) -> str | None:
    """-> the user's line, or None. (Whether it is a goodbye is read from the line itself.)"""
    obj = json_object(text)
    if obj is not None:
        r = obj.get("reply")
        if not isinstance(r, str) or not r.strip():
            return None
        return r.strip()
    if "{" in (text or ""):  # JSON that did not parse (e.g. cut off): its prose is no label
        return None
    m = re.search(_LABELS_REPLY + r"\s*[:：]\s*(.+)", text or "", re.I | re.S)
    if m and m.group(1).strip():
        return m.group(1).strip().strip('"')
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
    alike, and so is an answer that is not valid Unicode text (is_text). Only an EndpointError
    (a wrong key, model or URL) passes through: no try can work. `on_retry()` is called before
    every try after the first. A parsed answer is handed to the backend's `keep`
    (plumbing.backends.CachedBackend stores parsed answers only, so a bad answer is never
    replayed into its own retry). With `budget` (seconds for all tries together), no try starts
    after it is spent, and a backend that takes a deadline (OpenAIBackend) cuts its requests
    and backoffs to what is left."""
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
            if out is not None and not is_text((text, out)):
                raise ValueError("the answer is not valid Unicode text (a lone surrogate?)")
        except EndpointError:  # a wrong key, model or URL: no try will work
            raise
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


def is_text(value) -> bool:
    """Every string in `value` (and in its tuples, lists and dicts) is valid Unicode text, i.e.
    encodable as UTF-8. A JSON answer can hold a lone surrogate ("\\ud83d"), which no tokenizer
    and no file accepts: such an answer is a failed try, never scored or cached."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        value = list(value.keys()) + list(value.values())
    if isinstance(value, (tuple, list)):
        return all(is_text(v) for v in value)
    return True


class Simulator:
    """Plays the user side of many dialogues. A dialogue's state lives in its UserState, so one
    Simulator can serve any number of them; the Simulator itself holds only its settings and
    its retry counters (take_counts)."""

    def __init__(self, backend, initial_emotion: int | None = None, max_turns: int | None = None,
                 max_change: int | None = None, parse_retries: int = 3, concurrency: int = 64,
                 user: str = "standard", call_budget: float | None = None, rules: str = "sage"):
        if user not in USERS:
            raise ValueError(f"unknown simulated user {user!r} ({' | '.join(USERS)})")
        if rules not in RULES:
            raise ValueError(f"unknown rules {rules!r} ({' | '.join(RULES)})")
        self.backend, self.user, self.rules = backend, user, rules
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
        self._in_flight = threading.BoundedSemaphore(concurrency)

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
        with self._in_flight:  # at most `concurrency` calls at once, however many dialogues ask
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
        return self._ask(opening_messages(sc, self.user), parse_reply)

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
            before = st.emotion
            st.turn += 1
            if self.rules == "sage":
                st.emotion = clamp(st.emotion + change, 0, 100)
                if st.emotion >= 100:
                    st.outcome = "success"
                elif st.emotion < 10:
                    st.outcome = "failure"
            else:  # rlver: capped at 100, no floor, no end at 100
                st.emotion = min(st.emotion + change, 100)
                if st.emotion <= 0:
                    st.outcome = "failure"
            st.trace.append({"turn": st.turn, "emotion_before": before, "emotion_after": st.emotion,
                             "change": change, "raw_change": int(raw), "reasoning": reasoning,
                             "agent": agent_reply, "user": ""})
            # The user answers every appraised reply except the last one of a dialogue that runs
            # out of turns (max_turns): nobody would read that line, so its call is saved. A
            # success or failure, even on the last turn, still costs a reply call: the user's
            # closing line (final=True), kept in the history for transcripts (the policy never
            # sees it). Calls per dialogue of T turns: 2T - 1 at max_turns, 2T at success,
            # failure or goodbye; plus one for an opening line the scenario lacks, plus retries.
            bye = False
            ended = st.outcome is not None  # success or failure
            if ended or st.turn < max_turns:
                user_text = self._respond(st, final=ended)
                bye = said_goodbye(user_text)
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
        ex = concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(args)))
        try:
            return list(ex.map(lambda a: fn(*a), args))
        finally:  # on Ctrl-C (or an EndpointError) do not wait for the calls still in flight
            ex.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _error(st, why):
        log.warning("dialogue %s ended with simulator_error: %s", st.scenario.id, why)
        st.done = True
        st.outcome = "simulator_error"
        st.trace.append({"turn": st.turn, "error": why})
        return st


# ---- RuleBackend: interpretable features -> emotion change. No LLM, deterministic given seed.
_WORD = re.compile(r"[a-zA-Z']+|[\u4e00-\u9fff]")


def word_list(text: str) -> list[str]:
    """The words of `text`, lower-cased: English words (apostrophes kept) and single Chinese
    characters. The unit the rule user (RuleBackend) and the rule judge (judge.py) count in."""
    return _WORD.findall(text.lower())


def content_words(text: str) -> set[str]:
    """The words of `text` that carry content: English words of 4+ letters and Chinese
    characters. A reply "reflects" the user when it reuses them (RuleBackend, judge.py)."""
    return {w for w in word_list(text) if len(w) >= 4 or not w.isascii()}  # not ASCII: a CJK character


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
               "open_question": 1.5, "goal": 3.0, "repetition": -4.0, "echo": -3.0, "dismissive": -6.0}
    BASELINE = -3.0  # the user is in a bad place: an empty or useless reply makes things worse
    # The challenging user (USERS): only goal-directed replies help (goal weighs most), generic
    # acknowledgement and questions are worth little, gibberish ("garbled" = 1 - readable),
    # repetition and dismissal cost much more, and the baseline is lower. The best possible reply
    # gains less than with the standard user, the worst loses more (and is not clamped).
    WEIGHTS_CHALLENGING = {"readable": 2.0, "length_ok": 0.5, "acknowledge": 0.5, "reflect": 1.0,
                           "open_question": 0.5, "goal": 5.0, "repetition": -8.0, "echo": -5.0,
                           "dismissive": -10.0, "garbled": -6.0}
    BASELINE_CHALLENGING = -4.0

    def __init__(self, seed: int = 0):
        self.seed = seed

    def features(self, reply: str, last_user: str, goal_type: str, earlier: str = "") -> dict[str, float]:
        """Each feature of `reply` in [0, 1]; `earlier`: the agent's earlier replies in this
        dialogue. Two ways of saying the same again: `repetition` is the share of this reply's
        content words repeated *within* it; `echo` the share it repeats from the agent's earlier
        replies (a stock line said again, which the LLM user's prompt also counts as repetitive:
        a SmolLM2 run trained without it learned to open every turn with one validation)."""
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
        said_before = {w for w in word_list(earlier) if len(w) >= 5}
        echo = len(set(content) & said_before) / len(set(content)) if content else 0.0
        return {
            "readable": ok_chars / n,
            "length_ok": length_ok,
            "acknowledge": float(any(k in low for k in _FEATURE_WORDS["acknowledge"])),
            "reflect": min(1.0, len(user_words & set(words)) / 2),
            "open_question": open_question,
            "goal": min(1.0, sum(k in low for k in _GOAL_WORDS.get(goal_type, [])) / 2),
            "repetition": repetition,
            "echo": echo,
            "dismissive": float(any(k in low for k in _FEATURE_WORDS["dismissive"])),
        }

    def appraise(self, state: UserState, reply: str) -> tuple[int, str]:
        sc = state.scenario
        last_user = next((m["content"] for m in reversed(state.history[:-1]) if m["role"] == "user"), "")
        earlier = " ".join(m["content"] for m in state.history[:-1] if m["role"] == "assistant")
        f = self.features(reply, last_user, sc.goal_type, earlier)
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

    def respond(self, state: UserState, final: bool) -> str:
        sc, lang = state.scenario, state.scenario.language
        if final:
            return _BYE[lang][state.emotion >= 100]
        level = emotion_level(state.emotion)
        rng = self._rng(sc.id, state.turn, "respond")
        text = rng.choice(_REPLIES[lang][level])
        if level in (2, 3, 4) and rng.random() < 0.5 and state.user != "challenging":  # it never hints
            text += " " + _GOAL_HINTS[lang].get(sc.goal_type, "")
        # Very low and still sinking fast: the user walks away, with a goodbye (what ends a
        # dialogue is the word, as in SAGE). (trace[-1] is this turn.)
        if level == 1 and state.trace and state.trace[-1]["change"] <= -5:
            return _BYE[lang][False]
        return text.strip()

    def opening(self, sc: Scenario) -> str:
        first = re.split(r"(?<=[.!?。！？])\s*", sc.background.strip())[0]
        space = " " if sc.language == "en" else ""  # Chinese runs on without a space
        return f"{_OPENING[sc.language]}{space}{first}"

    def _rng(self, *key) -> random.Random:
        h = hashlib.sha256(repr((self.seed, *key)).encode()).digest()
        return random.Random(int.from_bytes(h[:8], "little"))
