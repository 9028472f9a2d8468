import pytest

from reward import dialogue_reward, emotion_reward, format_ok, split_think
from simulator import Scenario, UserState

S = Scenario(id="a", persona="p", background="b", hidden_goal="g")


def state(emotion, outcome="max_turns", changes=()):
    return UserState(scenario=S, emotion=emotion, outcome=outcome, done=True,
                     trace=[{"change": c} for c in changes])


def test_emotion_reward_is_final_emotion_over_100():
    assert emotion_reward(state(0)) == 0.0
    assert emotion_reward(state(55)) == 0.55
    assert emotion_reward(state(100)) == 1.0


@pytest.mark.parametrize("text,thought,reply,ok", [
    ("<think>she is sad</think>That sounds hard.", "she is sad", "That sounds hard.", True),
    ("  <think>\nplan\n</think>\n\nHi.", "plan", "Hi.", True),
    ("That sounds hard.", "", "That sounds hard.", False),
    ("<think>only thinking</think>", "only thinking", "", False),
    ("<think></think>Hi", "", "Hi", False),
    ("<think>a</think>b<think>c</think>d", "", "abcd", False),
    ("Hi <think>late</think> there", "", "Hi late there", False),
    ("<think>unclosed thought and reply", "", "unclosed thought and reply", False),
])
def test_split_think(text, thought, reply, ok):
    assert split_think(text) == (thought, reply, ok)


def test_format_ok_both_modes():
    assert format_ok("<think>x</think>y", think=True)
    assert not format_ok("y", think=True)
    assert format_ok("y", think=False)
    assert not format_ok("<think>x</think>y", think=False)
    assert not format_ok("   ", think=False)


def test_violation_gives_zero_reward():
    st = state(80)
    assert dialogue_reward(st, ["<think>a</think>b", "<think>c</think>d"], think=True) == 0.8
    assert dialogue_reward(st, ["<think>a</think>b", "no think"], think=True) == 0.0
    assert dialogue_reward(st, ["plain", "plain"], think=False) == 0.8


def test_shaping_is_off_by_default_and_adds_mean_delta():
    st = state(60, changes=[10, 10, 10])
    assert dialogue_reward(st, ["x"], think=False) == 0.6
    assert dialogue_reward(st, ["x"], think=False, shaping_coef=1.0) == pytest.approx(0.7)
    assert dialogue_reward(state(60, changes=[]), ["x"], think=False, shaping_coef=1.0) == 0.6


def test_simulator_error_is_never_scored():
    with pytest.raises(ValueError, match="exclude"):
        dialogue_reward(state(50, outcome="simulator_error"), ["x"], think=False)


def test_format_rule_none_is_the_official_code():
    """Issue 29: the official code has no format penalty; what reaches the user is the text after
    the last </think>, or all of it (reasoning included) when the tag is missing."""
    from reward import spoken_reply
    st = UserState(scenario=Scenario(id="a", persona="p", background="b", hidden_goal="g"), emotion=64)
    broken = ["no tags here, just talking", "<think>a</think>b</think>c"]
    assert dialogue_reward(st, broken, think=True) == 0.0
    assert dialogue_reward(st, broken, think=True, format_rule="none") == 0.64
    assert spoken_reply("I think <think> so", True, "none") == "I think <think> so"
    assert spoken_reply("<think>a</think>b</think> c ", True, "none") == "c"
    assert spoken_reply("<think>a</think> b", True, "paper") == "b"
    assert spoken_reply(" hi ", False, "none") == "hi"
