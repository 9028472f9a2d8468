"""plumbing/scenarios.py - scenario files: our JSONL schema and the official SAGE/RLVER one.

`load_scenarios(path)` -> [simulator.Scenario]; every way a file can be bad (not UTF-8, not
JSON, nested too deeply, a field of the wrong type, a duplicate id) is a ScenarioError whose
message names the file and line. The official files (`train_profile.jsonl`,
`test_profile.jsonl`: id, player, scene, main_cha, cha_group, task, first_talk; Chinese) are
read directly.
"""
from __future__ import annotations

import dataclasses
import json
import os

from simulator import CHITCHAT_GOALS, USERS, Scenario

# The paper's 8 hidden-goal types: 4 rational, 4 emotional (RLVER Sec. 2.2, SAGE Sec. 3); a
# scenario's goal_type is one of them or a chit-chat intention (simulator.CHITCHAT_GOALS).
GOAL_TYPES = {
    "advice": "rational", "analyze_others": "rational", "dialectical": "rational",
    "self_reflection": "rational", "empathy": "emotional", "venting": "emotional",
    "praise": "emotional", "validation": "emotional",
}
PERSONALITY_TYPES = ("negative", "passive", "avoidant")
SAGE_INITIAL_EMOTION = 40  # SAGE's evaluation protocol starts every dialogue at 40


def eval_initial_emotion(user: str) -> int:
    """Where an evaluation dialogue starts: the user's own start (challenging: 30), else
    SAGE's 40 (evaluate.py and the demo; training starts from 30, train.py's --initial-emotion)."""
    own = USERS[user]["initial_emotion"]
    return SAGE_INITIAL_EMOTION if own is None else own

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


def jsonl_rows(path: str, error=ValueError):
    """Each non-blank line of a JSONL file as (line number, "path:line", its JSON value); a line
    that is not UTF-8 or not JSON is `error` naming the file and line."""
    with open(path, "rb") as f:  # bytes: a non-UTF-8 line is reported with its line number
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:  # the first line may start with a byte-order mark (Windows editors write one)
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if line.strip():
                yield lineno, where, json_line(line, where, error)


def load_scenarios(path: str) -> list[Scenario]:
    """Read a JSONL file of scenarios (either schema). Errors name the file and line."""
    if os.path.isdir(path):
        raise ScenarioError(f"{path}: is a directory, not a scenario file (JSONL)")
    if not os.path.isfile(path):
        raise ScenarioError(f"{path}: no such scenario file")
    out, seen = [], {}
    for lineno, where, row in jsonl_rows(path, ScenarioError):
        sc = scenario_from_dict(row, where)
        if sc.id in seen:
            raise ScenarioError(f"{where}: duplicate id {sc.id!r} (first at line {seen[sc.id]})")
        seen[sc.id] = lineno
        out.append(sc)
    if not out:
        raise ScenarioError(f"{path}: the file holds no scenarios")
    return out
