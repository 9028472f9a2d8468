import json
import os
import subprocess
import sys

import pytest

from conftest import OFFICIAL_DATA, ROOT
from plumbing.backends import Asker
from plumbing.scenarios import GOAL_TYPES, PERSONALITY_TYPES, ScenarioError, load_scenarios
from rule_user import RuleBackend
from simulator import Scenario, Simulator, UserState, parse_appraisal, parse_reply


def sc(**kw):
    base = dict(id="s1", persona="Ann, 30", background="Lost her job.", hidden_goal="wants advice",
                first_message="I lost my job.", goal_type="advice", personality_type="passive")
    base.update(kw)
    return Scenario(**base)


class Scripted:
    """An LLM backend stand-in that returns canned outputs in order (exercises prompts+parser)."""
    parallel = False

    def __init__(self, outputs):
        self.outputs, self.calls = list(outputs), []

    def chat(self, messages):
        self.calls.append(messages)
        out = self.outputs.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


def A(change, analysis="ok"):
    return json.dumps({"analysis": analysis, "change": change})


def R(reply="fine", goodbye=False):
    return json.dumps({"thinking": "t", "reply": reply, "goodbye": goodbye})


# ---------------------------------------------------------------- emotion arithmetic
def test_change_is_clamped_to_10_and_emotion_to_100():
    sim = Simulator(Scripted([A(50), R("great, bye", True)]), initial_emotion=95)
    st = sim.step(sim.reset(sc()), "hello")
    assert st.trace[0]["raw_change"] == 50 and st.trace[0]["change"] == 10
    assert st.emotion == 100 and st.outcome == "success" and st.done


def test_emotion_clamped_at_zero_and_failure_below_10():
    sim = Simulator(Scripted([A(-10), R("bye", True)]), initial_emotion=3)
    st = sim.step(sim.reset(sc()), "whatever")
    assert st.emotion == 0 and st.outcome == "failure"
    sim = Simulator(Scripted([A(-1), R("bye", True)]), initial_emotion=10)
    st = sim.step(sim.reset(sc()), "meh")
    assert st.emotion == 9 and st.outcome == "failure"
    sim = Simulator(Scripted([A(-1), R("hm")]), initial_emotion=11)
    st = sim.step(sim.reset(sc()), "meh")
    assert st.emotion == 10 and not st.done  # 10 is not < 10


def test_trace_records_every_turn_and_state_is_not_mutated():
    sim = Simulator(Scripted([A(3, "nice"), R("ok"), A(-2, "meh"), R("hm")]), initial_emotion=30)
    s0 = sim.reset(sc())
    s1 = sim.step(s0, "first")
    s2 = sim.step(s1, "second")
    assert s0.emotion == 30 and len(s0.history) == 1 and s0.turn == 0  # untouched
    assert [(t["emotion_before"], t["emotion_after"], t["change"]) for t in s2.trace] == [(30, 33, 3), (33, 31, -2)]
    assert s2.trace[1]["reasoning"] == "meh"
    assert [m["role"] for m in s2.history] == ["user", "assistant", "user", "assistant", "user"]


def test_initial_emotion_from_scenario_or_override():
    assert Simulator(RuleBackend()).reset(sc(initial_emotion=30)).emotion == 30
    assert Simulator(RuleBackend(), initial_emotion=40).reset(sc()).emotion == 40


# ---------------------------------------------------------------- termination paths
def test_goodbye_ends_dialogue():
    sim = Simulator(Scripted([A(-2), R("I'm out. Bye.", True)]), initial_emotion=30)
    st = sim.step(sim.reset(sc()), "calm down")
    assert st.outcome == "goodbye" and st.done and st.history[-1]["content"] == "I'm out. Bye."


def test_max_turns_ends_without_extra_user_line():
    backend = Scripted([A(1), R("a"), A(1), R("b"), A(1)])
    sim = Simulator(backend, initial_emotion=30, max_turns=3)
    st = sim.reset(sc())
    for r in ["x", "y", "z"]:
        st = sim.step(st, r)
    assert st.outcome == "max_turns" and st.turn == 3 and st.emotion == 33
    assert len(backend.calls) == 5  # no reply is written after the last turn
    with pytest.raises(ValueError, match="already over"):
        sim.step(st, "again")


def test_scenario_max_turns_used_when_simulator_has_none():
    sim = Simulator(RuleBackend(), initial_emotion=40)
    st = sim.reset(sc(max_turns=2))
    st = sim.step(sim.step(st, "That sounds hard."), "I hear you.")
    assert st.outcome == "max_turns" and st.turn == 2


def test_unparseable_output_is_retried_then_simulator_error():
    sim = Simulator(Scripted(["nonsense", A(2), R("ok")]), initial_emotion=30)
    st = sim.step(sim.reset(sc()), "hi")
    assert st.emotion == 32 and not st.done
    sim = Simulator(Scripted(["nonsense", "", "{}"]), initial_emotion=30, parse_retries=3)
    st = sim.step(sim.reset(sc()), "hi")
    assert st.outcome == "simulator_error" and st.done and "unparseable" in st.trace[-1]["error"]
    # A backend error: the lesson's loop (simulator.ask_plainly) raises it; the scripts' Asker
    # counts it as a failed try, and three of them end the dialogue.
    sim = Simulator(Scripted([RuntimeError("down")] * 3), initial_emotion=30)
    with pytest.raises(RuntimeError, match="down"):
        sim.step(sim.reset(sc()), "hi")
    ask = Asker()
    sim = Simulator(Scripted(["nonsense", RuntimeError("down"), "{}"]), initial_emotion=30, ask=ask)
    st = sim.step(sim.reset(sc()), "hi")
    assert st.outcome == "simulator_error" and ask.take_counts(sim.backend) == {"parse_retries": 2,
                                                                                "transport_retries": 0}


def test_opening_line_written_when_missing():
    sim = Simulator(Scripted([R("Hey... got a minute?")]))
    st = sim.reset(sc(first_message=None))
    assert st.history == [{"role": "user", "content": "Hey... got a minute?"}]
    st = Simulator(RuleBackend()).reset(sc(first_message=None))
    assert "Lost her job" in st.history[0]["content"]


def test_prompts_carry_persona_goal_emotion_history_and_language():
    backend = Scripted([A(1), R("ok")])
    sim = Simulator(backend, initial_emotion=37)
    sim.step(sim.reset(sc(persona="Zed the baker", hidden_goal="secret-goal-xyz")), "agent-said-this")
    sys_msg, user_msg = backend.calls[0][0]["content"], backend.calls[0][1]["content"]
    for s in ("Zed the baker", "secret-goal-xyz", "Lost her job.", "json"):
        assert s in sys_msg
    assert "agent-said-this" in user_msg and "37" in user_msg and "I lost my job." in user_msg
    backend = Scripted([A(1), R("好")])
    sim = Simulator(backend)
    sim.step(sim.reset(sc(language="zh")), "你好")
    assert "你的角色" in backend.calls[0][0]["content"] and "json" in backend.calls[0][0]["content"]


# ---------------------------------------------------------------- parsing
@pytest.mark.parametrize("text,expected", [
    ('{"analysis": "good", "change": 4}', 4),
    ('```json\n{"analysis": "x", "change": -7}\n```', -7),
    ('Sure! Here it is: {"analysis": "x", "change": "+3"} hope that helps', 3),
    ('{"change": 2.6}', 3),
    ("Analysis: they ignored me.\nChange: -4", -4),
    ("分析：还行\n变化：+2", 2),
    ('{"change": 25}', 25),  # clamping is the simulator's job, not the parser's
])
def test_parse_appraisal_good_and_partial(text, expected):
    assert parse_appraisal(text)[0] == expected


@pytest.mark.parametrize("text", ["", "I feel better", '{"analysis": "no number"}', '{"change": "a lot"}',
                                  '{"change": true}', "[1, 2]", '{"change": '])
def test_parse_appraisal_garbage(text):
    assert parse_appraisal(text) is None


def test_parse_reply():
    # Issue 29: the answer is the line alone; a goodbye is read from its words, as SAGE does
    # (it was a JSON goodbye flag).
    assert parse_reply(R("hi there")) == "hi there"
    assert parse_reply('{"reply": "no goodbye field"}') == "no goodbye field"
    assert parse_reply("Thinking: sad\nReply: leave me alone") == "leave me alone"
    assert parse_reply("回复：好吧") == "好吧"
    for bad in ["", "{}", '{"reply": ""}', '{"reply": 3}', "just words"]:
        assert parse_reply(bad) is None


def test_a_goodbye_is_a_word_in_the_answer():
    from simulator import said_goodbye
    for text in ["OK, bye.", "Goodbye!", "Bye-bye", "good-bye then", "BYE", "那我先走了，再见。", "拜拜啦"]:
        assert said_goodbye(text), text
    for text in ["I'll stand by you", "byelaws", "maybe", "goodbyes are hard", "好吧"]:
        assert not said_goodbye(text), text


# ---------------------------------------------------------------- loader
def test_our_scenario_sets_cover_goal_and_personality_types():
    train = load_scenarios(os.path.join(ROOT, "data", "scenarios_train.jsonl"))
    test = load_scenarios(os.path.join(ROOT, "data", "scenarios_test.jsonl"))
    assert len(train) >= 40 and len(test) >= 20
    for rows in (train, test):
        assert {s.goal_type for s in rows} == set(GOAL_TYPES)
        assert {s.personality_type for s in rows} == set(PERSONALITY_TYPES)
        assert all(s.language == "en" and s.persona and s.background and s.hidden_goal for s in rows)
    assert all(s.first_message for s in test)
    assert not {s.id for s in train} & {s.id for s in test}


OFFICIAL_ROW = {"id": "abc", "player": "* 姓名：李华\n* 年龄：30岁", "scene": "## 背景故事\n李华丢了工作。",
                "main_cha": "负面型", "cha_group": ["急躁", "直率"],
                "task": "你想获得能真实帮助你解决当下困境的建议", "first_talk": "唉，工作没了。"}


def test_loader_reads_official_schema(tmp_path):
    p = tmp_path / "off.jsonl"
    p.write_text(json.dumps(OFFICIAL_ROW, ensure_ascii=False) + "\n\n", encoding="utf-8")
    [s] = load_scenarios(str(p))
    assert (s.id, s.language, s.personality_type, s.goal_type, s.traits, s.first_message) == (
        "abc", "zh", "negative", "advice", ["急躁", "直率"], "唉，工作没了。")
    row = dict(OFFICIAL_ROW)
    del row["first_talk"]  # the official training file has no first_talk
    p.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_scenarios(str(p))[0].first_message is None


@pytest.mark.parametrize("name,n,has_first", [("train_profile.jsonl", 500, False), ("test_profile.jsonl", 100, True)])
def test_loader_on_shared_official_files(name, n, has_first):
    path = os.path.join(OFFICIAL_DATA, name)
    if not os.path.exists(path):
        pytest.skip("official RLVER data not present beside the checkout")
    rows = load_scenarios(path)
    assert len(rows) == n and all(s.language == "zh" for s in rows)
    assert {s.goal_type for s in rows} == set(GOAL_TYPES)  # every official task string is mapped
    assert {s.personality_type for s in rows} == set(PERSONALITY_TYPES)
    assert all((s.first_message is not None) == has_first for s in rows)
    sim = Simulator(RuleBackend(), initial_emotion=40)  # the Chinese path runs end to end
    st = sim.step(sim.reset(rows[0]), "我理解你的感受，这真的很难受。发生了什么？")
    assert st.turn == 1 and not st.outcome == "simulator_error"


@pytest.mark.parametrize("content,msg", [
    ('{"id": "a", "persona": "p", "background": "b"}\n', r":1: missing field 'hidden_goal'"),
    ('{"id": "a", "persona": "p", "background": "b", "hidden_goal": "g"}\n{oops\n', r":2: invalid JSON"),
    ('{"id": "a", "persona": 3, "background": "b", "hidden_goal": "g"}\n', r":1: field 'persona' must be"),
    ('{"id": "a", "persona": "p", "background": "b", "hidden_goal": "g", "max_turns": "10"}\n',
     r"max_turns' must be an integer"),
    ('{"id": "a", "persona": "p", "background": "b", "hidden_goal": "g", "initial_emotion": 140}\n', r"\[0, 100\]"),
    ('{"id": "a", "persona": "p", "background": "b", "hidden_goal": "g", "persnality": "x"}\n', r"unknown field"),
    ('{"id": "a", "persona": "p", "background": "b", "hidden_goal": "g", "traits": "shy"}\n', r"traits"),
    ('[1, 2]\n', r":1: expected a JSON object"),
    ('\n\n', r"holds no scenarios"),
    ('{"id": "a", "persona": "p", "background": "b", "hidden_goal": "g"}\n' * 2,
     r":2: duplicate id 'a' \(first at line 1\)"),
    ('{"id": "a", "player": "p", "scene": "s", "main_cha": "负面型", "cha_group": "x", "task": "t"}\n', r"cha_group"),
])
def test_loader_errors_name_file_and_line(tmp_path, content, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(ScenarioError, match=msg) as e:
        load_scenarios(str(p))
    assert str(p) in str(e.value)


def test_loader_missing_file():
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenarios("does/not/exist.jsonl")


def test_demo_prints_emotion_trace():
    out = subprocess.run([sys.executable, "-m", "plumbing.demo"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "emotion" in out.stdout and "outcome:" in out.stdout and "->" in out.stdout


# ---------------------------------------------------------------- the challenging user
def test_challenging_user_starts_at_30_and_its_change_is_not_clamped():
    sim = Simulator(Scripted([A(35), R("hm."), A(-50), R("...")]), user="challenging")
    st = sim.reset(sc())
    assert st.emotion == 30 and st.user == "challenging"
    st = sim.step(st, "hello")
    assert st.trace[0]["change"] == 35 and st.emotion == 65
    st = sim.step(st, "whatever")
    assert st.trace[1]["change"] == -50 and st.emotion == 15 and not st.done  # termination as before
    assert Simulator(Scripted([]), user="challenging", initial_emotion=40).reset(sc()).emotion == 40
    with pytest.raises(ValueError, match="unknown simulated user"):
        Simulator(Scripted([]), user="hard")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_challenging_prompts_forbid_revealing_the_goal_and_have_no_change_range(lang):
    from simulator import appraisal_messages, opening_messages, reply_messages
    s = sc(language=lang, hidden_goal="secret-goal-xyz", first_message=None)
    hard, std = UserState(scenario=s, emotion=30, user="challenging"), UserState(scenario=s, emotion=30)
    for st in (hard, std):
        st.history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    never = {"en": "Never reveal it", "zh": "绝不能透露"}[lang]
    bounded = {"en": "-10 to +10", "zh": "-10到+10"}[lang]
    for msgs in (appraisal_messages(hard, "hello"), reply_messages(hard, False), opening_messages(s, "challenging")):
        assert "secret-goal-xyz" in msgs[0]["content"] and never in msgs[0]["content"] and "json" in msgs[0]["content"]
    assert bounded not in appraisal_messages(hard, "hello")[0]["content"]
    assert bounded in appraisal_messages(std, "hello")[0]["content"]
    assert never not in appraisal_messages(std, "hello")[0]["content"]
    # the simulator sends them: an LLM backend sees the challenging prompts
    backend = Scripted([R("Hey."), A(0), R("hm.")])
    sim = Simulator(backend, user="challenging")
    sim.step(sim.reset(s), "hello")
    assert all(never in call[0]["content"] for call in backend.calls)


def play_scripted(user, scenarios, initial_emotion=None):
    from plumbing.demo import DEMO_REPLIES
    sim = Simulator(RuleBackend(seed=0), initial_emotion=initial_emotion, max_turns=len(DEMO_REPLIES), user=user)
    finals = []
    for s in scenarios:
        st = sim.reset(s)
        for r in DEMO_REPLIES:
            if not st.done:
                st = sim.step(st, r)
        finals.append(st.emotion)
    return sum(finals) / len(finals)


def test_same_scripted_agent_scores_lower_against_the_challenging_user():
    test = load_scenarios(os.path.join(ROOT, "data", "scenarios_test.jsonl"))
    # each user with its own start (SAGE evaluation: 40; challenging: 30), and both from 30
    assert play_scripted("challenging", test) < play_scripted("standard", test, 40) - 10
    assert play_scripted("challenging", test, 30) < play_scripted("standard", test, 30) - 10


def test_demo_with_the_challenging_user():
    out = subprocess.run([sys.executable, "-m", "plumbing.demo", "--user", "challenging"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "challenging user" in out.stdout and "[emotion 30]" in out.stdout


def test_the_demo_plays_the_rules_it_is_given(capsys):
    """`python -m plumbing.demo --rules rlver` took the flag and played SAGE's rules."""
    from plumbing.demo import main as demo
    demo(["--rules", "rlver", "--simulator-concurrency", "2"])
    assert "standard user, rlver rules" in capsys.readouterr().out


# ---------------------------------------------------------------- issue 29: the sources' rules
class Appraiser:
    """A user whose every appraisal is the same change and whose lines are scripted (the rule
    user's interface: appraise / respond / opening)."""

    def __init__(self, change, lines=("I see.",)):
        self.change, self.lines = change, list(lines)

    def appraise(self, state, reply):
        return self.change, f"change {self.change}"

    def respond(self, state, final):
        return self.lines[(state.turn - 1) % len(self.lines)]

    def opening(self, sc):
        return "hi"


def play(sim, n=20):
    st = sim.reset(sc())
    while not st.done and st.turn < n:
        st = sim.step(st, "hello")
    return st


def test_sage_rules_end_at_100_below_10_a_goodbye_or_the_turn_limit():
    assert (play(Simulator(Appraiser(+10), initial_emotion=80)).outcome, play(Simulator(Appraiser(+10),
            initial_emotion=80)).turn) == ("success", 2)
    st = play(Simulator(Appraiser(-10), initial_emotion=25))
    assert (st.outcome, st.emotion, st.turn) == ("failure", 5, 2)
    st = play(Simulator(Appraiser(0, ["fine", "ok then, goodbye"]), initial_emotion=50))
    assert (st.outcome, st.turn) == ("goodbye", 2)
    st = play(Simulator(Appraiser(0), initial_emotion=50, max_turns=9))
    assert (st.outcome, st.turn) == ("max_turns", 9)


def test_rlver_rules_no_end_at_100_capped_no_floor_end_at_or_below_0():
    """The official code: emotion capped at 100 with no end there, no floor, an end at <= 0."""
    st = play(Simulator(Appraiser(+10), initial_emotion=80, max_turns=9, rules="rlver"))
    assert (st.outcome, st.emotion, st.turn) == ("max_turns", 100, 9)
    st = play(Simulator(Appraiser(-10), initial_emotion=25, rules="rlver"))
    assert (st.outcome, st.emotion, [t["emotion_after"] for t in st.trace]) == ("failure", -5, [15, 5, -5])
    st = play(Simulator(Appraiser(-1), initial_emotion=9, max_turns=3, rules="rlver"))
    assert (st.outcome, st.emotion) == ("max_turns", 6)  # below 10 is no end here
    st = play(Simulator(Appraiser(0, ["拜拜"]), initial_emotion=50, rules="rlver"))
    assert st.outcome == "goodbye"  # a goodbye word (any language's) in the user's answer
    from reward import emotion_reward
    assert emotion_reward(st.__class__(scenario=st.scenario, emotion=-5)) == 0.0  # max(e, 0) / 100


def test_the_llm_user_answers_from_its_appraisal_and_state_label_not_the_number():
    """SAGE writes the user's answer from the appraisal's own text and the state label
    (S/A/B/C/F); ours passed the number and a 20-point band."""
    from simulator import emotion_state
    assert [emotion_state(e) for e in (100, 99, 70, 69, 40, 39, 10, 9, 0)] == list("SAAB" "BCCFF")
    backend = Scripted([A(+5, "objective: it named my worry; subjective: I feel heard"), R("yes")])
    sim = Simulator(backend, initial_emotion=37)
    st = sim.step(sim.reset(sc()), "That sounds scary.")
    system, ask = backend.calls[1][0]["content"], backend.calls[1][1]["content"]
    assert "objective: it named my worry; subjective: I feel heard" in ask and "state now: B" in ask
    assert "42" not in system + ask and st.emotion == 42
