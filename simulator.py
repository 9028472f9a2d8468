"""simulator.py - the simulated user whose hidden emotion is RLVER's reward.

RLVER (arXiv 2507.03112, Sec. 2.2) trains against SAGE (arXiv 2505.02847): an LLM plays a
person with a persona, a background story and a *hidden goal* (what they really want from the
talk), carrying an emotion score. After every agent reply it

  1. appraises the reply against persona, background and hidden goal, and outputs a signed
     change (the standard user's is clamped to [-10, 10], the challenging user's to [-100, 100]);
  2. answers in character at its new state (or says goodbye).

How a dialogue ends (its `outcome`), by the rules in RULES (`rules="sage"`: the emotion in
[0, 100]; `"rlver"`, the official RLVER code: capped at 100, no floor), and its reward:

  outcome          when                                       where             reward
  success          emotion >= 100 after a reply (sage only)   Simulator.step    final emotion / 100
  failure          emotion < 10 (sage) | <= 0 (rlver)         Simulator.step    final emotion / 100
  goodbye          the user's answer says goodbye             Simulator.step    final emotion / 100
  max_turns        max_turns replies appraised                Simulator.step    final emotion / 100
  max_tokens       the token budget ran out                   rollout.Dialogue  final emotion / 100
  simulator_error  no usable answer from the LLM user         Simulator._error  none: left out, not 0
Clipped to [0, 1], 0 when a turn broke the format (--format-rule paper), plus --shaping-coef's
term (reward.py); a dialogue stopped before its first appraisal has none (rollout.to_batch).

In the order a turn uses them: the scenario and the dialogue's state, the prompts (English and
Chinese, our own words in SAGE's structure), the parsers, and the `Simulator`. Two users, as in
the paper (Table 3): `standard` (SAGE) and `challenging` (never reveals its goal, rewards only
goal-directed replies, starts at 30; USERS).
The LLM user is any object with `chat(messages) -> str` (plumbing/backends.py: a server such as
DeepSeek-V3 or `vllm serve`, a local model); the offline user is rule_user.RuleBackend.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import re
import threading
from dataclasses import dataclass, field

log = logging.getLogger("simulator")

# --------------------------------------------------------------------------------------------
# Scenarios and the state of a dialogue
# --------------------------------------------------------------------------------------------
# Chit-chat (SAGE's extension, RLVER App. B.1): everyday talk, no problem to solve; the hidden
# goal is an intention for the chat. These goal types switch the simulator to CHITCHAT_PROMPTS.
CHITCHAT_GOALS = {
    "interest_chat": "wants to talk about something they are into and find a partner who gets excited too",
    "passive_chat": "answers briefly and waits for the other person to carry the conversation",
    "sharing_chat": "wants to tell about something that happened to them and have it appreciated",
    "opinion_chat": "wants a lively exchange of views, including some friendly disagreement",
}


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
    goal_type: str = ""                # the paper's 8 (plumbing.scenarios.GOAL_TYPES) or CHITCHAT_GOALS


@dataclass
class UserState:
    scenario: Scenario
    emotion: int
    # Roles are the agent's view: "user" = the simulated person, "assistant" = the agent.
    history: list[dict] = field(default_factory=list)
    turn: int = 0          # agent replies appraised so far
    done: bool = False
    outcome: str | None = None  # success | failure | max_turns | goodbye | simulator_error (the docstring)
    trace: list[dict] = field(default_factory=list)
    user: str = "standard"      # which simulated user plays this dialogue (USERS)


# The paper's two simulated users (RLVER Table 3, Sec. 4, App. D):
#   standard     SAGE's user: per-turn change clamped to [-10, 10]; starts at the scenario's (or
#                the caller's) initial emotion.
#   challenging  the official RLVER training simulator's kind of user: reserved, never reveals
#                its hidden goal (not even hints), rewards only replies that move toward it (not
#                generic encouragement), judges garbled or off-topic replies very negatively;
#                starts at 30, its change clamped only to [-100, 100] (under --rules sage the
#                emotion's [0, 100] binds first; under rlver, which has no floor, the -100 can).
USERS = {"standard": {"max_change": 10, "initial_emotion": None},
         "challenging": {"max_change": 100, "initial_emotion": 30}}

# The rules a dialogue ends by, and the emotion's bounds, whichever the user (the module
# docstring says each; docs/EVALUATION.md, "Where each rule comes from"): sage, SAGE's runner
# (test_npc.py); rlver, the official RLVER training code (vllm_rollout_spmd_think.py; reward.py
# clips its reward at 0).
RULES = ("sage", "rlver")
# A goodbye is a word in the user's answer, as SAGE checks it ("再见"/"拜拜" anywhere in it), or
# in English "bye" or "goodbye" as a word (either language's words, whatever the scenario's).
GOODBYE = re.compile(r"再见|拜拜|\b(?:good-?)?bye\b", re.I)


def said_goodbye(text: str) -> bool:
    return bool(GOODBYE.search(text))


class SimulatorError(RuntimeError):
    """No parsed answer within the allowed tries (with plumbing.backends.Asker: any failed try)."""


def clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def emotion_state(emotion: int) -> str:
    """SAGE's state label, what the user's answer is written from: S (>= 100), A (>= 70),
    B (>= 40), C (>= 10), F (< 10)."""
    for label, floor in (("S", 100), ("A", 70), ("B", 40), ("C", 10)):
        if emotion >= floor:
            return label
    return "F"


# --------------------------------------------------------------------------------------------
# Prompts: our own words, in SAGE's structure (role, purpose, emotion definition, analysis steps,
# output format, persona, background, current emotion, history). JSON answers ("json" in the
# prompt: DeepSeek's JSON mode needs the word).
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
        "ask_reply": "{history}你对朋友最新回复的感受：{analysis}\n"
                     "你现在的状态：{state}。写出你的下一句话并以json回答。",
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
        "# 情绪\n你的情绪是0（无聊透顶，想离开）到100（非常享受这次聊天）之间的数。"
        "朋友投入、好奇、有趣并契合你的意图时上升；"
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
    return (p["common"].format(hidden_goal=sc.hidden_goal, persona=sc.persona, background=sc.background,
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
    for candidate in [text] + ([m.group(0)] if m else []):
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


def parse_opening(text: str) -> str | None:
    """-> the user's opening line, or None: parse_reply's reading, under its own name so that a
    server with structured outputs is asked for the line alone (the opening prompts ask for
    {"reply": ...}, no thinking; plumbing.backends.answer_schema)."""
    return parse_reply(text)


def ask_plainly(backend, messages, parser, tries: int):
    """Ask `backend.chat(messages)` until `parser` accepts the answer, at most `tries` times ->
    (parsed, None), or (None, why the last try failed). An unparseable answer is asked again, as
    SAGE's runner does; a backend error is raised to the caller."""
    why = "no attempts"
    for attempt in range(tries):
        text = backend.chat(messages)
        out = parser(text) if isinstance(text, str) else None
        if out is not None:
            return out, None
        why = f"unparseable output: {text!r:.200}"
        log.warning("answer unparseable (try %d/%d): %.200r", attempt + 1, tries, text)
    return None, why


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------
class Simulator:
    """Plays the user side of many dialogues. A dialogue's state lives in its UserState, so one
    Simulator can serve any number of them; the Simulator itself holds only its settings."""

    def __init__(self, backend, initial_emotion: int | None = None, max_turns: int | None = None,
                 max_change: int | None = None, parse_retries: int = 3, concurrency: int = 64,
                 user: str = "standard", rules: str = "sage", ask=None):
        if user not in USERS:
            raise ValueError(f"unknown simulated user {user!r} ({' | '.join(USERS)})")
        if rules not in RULES:
            raise ValueError(f"unknown rules {rules!r} ({' | '.join(RULES)})")
        self.backend, self.user, self.rules = backend, user, rules
        # None: the user's own (challenging: 30), else each scenario's own (30 by default)
        self.initial_emotion = initial_emotion if initial_emotion is not None else USERS[user]["initial_emotion"]
        self.max_turns = max_turns              # None: use each scenario's own (10 by default)
        self.max_change = max_change if max_change is not None else USERS[user]["max_change"]
        self.parse_retries, self.concurrency = parse_retries, concurrency
        # How one call to an LLM user is made: ask(backend, messages, parser, tries) -> (parsed,
        # None) or (None, why). `ask_plainly` (above) is the method; the scripts pass a
        # plumbing.backends.Asker, which adds what a network needs: a time budget per call, a
        # backend error counted as a failed try, parsed answers kept by a caching backend.
        self.ask = ask or ask_plainly
        self._in_flight = threading.BoundedSemaphore(concurrency)

    # ---- LLM calls with retry on unparseable output (transport retries live in the backend)
    def _ask(self, messages, parser):
        with self._in_flight:  # at most `concurrency` calls at once, however many dialogues ask
            out, why = self.ask(self.backend, messages, parser, self.parse_retries)
        if out is None:
            raise SimulatorError(why)
        return out

    def _appraise(self, state, reply):
        if hasattr(self.backend, "appraise"):  # rule_user.RuleBackend: no prompts, direct scoring
            return self.backend.appraise(state, reply)
        return self._ask(appraisal_messages(state, reply), parse_appraisal)

    def _respond(self, state, final):
        if hasattr(self.backend, "respond"):
            return self.backend.respond(state, final)
        return self._ask(reply_messages(state, final), parse_reply)

    def _opening(self, sc):
        if hasattr(self.backend, "opening"):
            return self.backend.opening(sc)
        return self._ask(opening_messages(sc, self.user), parse_opening)

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

    def reset_many(self, scenarios: list[Scenario]) -> list[UserState]:  # concurrently, as step_many
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
