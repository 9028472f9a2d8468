"""The offline rule user (rule_user.py): deterministic, graded features, what it pays and docks."""
import dataclasses
import os

import pytest

from conftest import ROOT
from plumbing.scenarios import load_scenarios
from rule_user import RuleBackend, emotion_level
from simulator import Simulator, UserState
from test_simulator import sc


def mean_change(state: UserState, reply: str, draws: int = 40) -> float:
    """The rule user's change for `reply` at `state`, averaged over its stochastic rounding (whose
    draw is seeded by the scenario id: the same appraisal under `draws` ids)."""
    r = RuleBackend()
    return sum(r.appraise(dataclasses.replace(state, scenario=dataclasses.replace(state.scenario, id=str(k))), reply)[0]
               for k in range(draws)) / draws


def test_emotion_levels():
    assert [emotion_level(e) for e in (0, 19, 20, 45, 79, 80, 100)] == [1, 1, 2, 3, 4, 5, 5]


def test_rule_backend_is_deterministic_and_prefers_caring_replies():
    s = sc(goal_type="empathy", personality_type="passive")
    def run(replies, seed=0):
        sim = Simulator(RuleBackend(seed=seed), initial_emotion=40)
        st = sim.reset(s)
        for r in replies:
            st = sim.step(st, r)
        return st
    # four different caring replies: the same one said four times is care only once (appraise)
    caring = ["That sounds so painful. I hear you, and it makes sense you feel hurt. What was the hardest part?",
              "Losing work like that is tough. How are you holding up this week?",
              "I'm sorry, anyone would be shaken. What did they tell you?",
              "Of course it stings. Which moment keeps coming back?"]
    careless = ["\x07\x13 ~~ ###", "k", "\x00\x01", "..."]
    a, b = run(caring), run(caring)
    assert a.trace == b.trace and a.history == b.history
    assert run(caring).emotion > 50 > run(careless).emotion
    assert run(caring[:1] * 4).emotion < run(caring).emotion  # one caring line said four times: care once


def test_rule_backend_features_are_graded():
    f = RuleBackend().features
    assert f("abc def ghi", "", "")["readable"] == 1.0
    assert 0 < f("ab\x01\x02", "", "")["readable"] < 1
    assert f("again " * 20, "", "")["repetition"] > 0.9
    assert f("Maybe you could try a plan?", "", "advice")["goal"] == 1.0
    assert f("What happened?", "", "")["open_question"] == 1.0


def test_rule_user_walks_away_when_very_low_and_sinking():
    sim = Simulator(RuleBackend(), initial_emotion=25, max_turns=10)
    st = sim.reset(sc(personality_type="negative", goal_type="empathy"))
    while not st.done:
        st = sim.step(st, "Whatever. Just get over it and stop whining.")
    # 25 -> 18: below 20 (the lowest level) and down by >= 5 this turn -> the user leaves
    assert (st.outcome, st.emotion, st.turn, st.trace[-1]["change"]) == ("goodbye", 18, 1, -7)
    assert "dismissive -6.0" in st.trace[-1]["reasoning"]


def test_avoidant_user_dislikes_many_questions():
    r = RuleBackend()
    one = "That sounds hard. What happened?"
    many = "That sounds hard. What happened? Why? How? Who?"
    st = UserState(scenario=sc(personality_type="avoidant", goal_type=""), emotion=40,
                   history=[{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}])
    assert "open_question -1.5" in r.appraise(st, many)[1] and "open_question +1.5" in r.appraise(st, one)[1]


def test_rule_challenging_user_weighs_goal_more_and_gibberish_harder():
    def change(user, reply, goal="advice"):
        st = UserState(scenario=sc(goal_type=goal, personality_type=""), emotion=50, user=user,
                       history=[{"role": "user", "content": "I lost my job."}, {"role": "assistant", "content": reply}])
        return mean_change(st, reply)
    generic = "That sounds really hard, I understand how you feel."
    goal = "Maybe you could try a plan: one small step, then suggest the next."
    garbled = "\x07\x13 ~~ ### \x01"
    assert change("challenging", generic) <= 0 < change("standard", generic)  # generic comfort is not enough
    assert change("challenging", goal) > change("challenging", generic) + 2
    assert change("challenging", garbled) < change("standard", garbled) - 3
    assert change("challenging", "again " * 20) < change("standard", "again " * 20)


def test_challenging_rule_user_never_hints_at_its_goal():
    from rule_words import GOAL_HINTS
    hints = {h for lang in GOAL_HINTS.values() for h in lang.values() if h}
    for user, expect_hint in (("standard", True), ("challenging", False)):
        sim = Simulator(RuleBackend(seed=0), initial_emotion=50, max_turns=10, user=user)
        said = []
        for s in load_scenarios(os.path.join(ROOT, "data", "scenarios_test.jsonl")):
            st = sim.reset(s)
            for _ in range(4):
                if not st.done:
                    st = sim.step(st, "I see. Tell me more about it?")
            said += [m["content"] for m in st.history if m["role"] == "user"]
        assert any(h in t for t in said for h in hints) == expect_hint


def test_the_rule_user_does_not_reward_a_stock_line_said_again():
    """Issue 24: a policy trained against the rule user learned to open every turn with the same
    validation ("It's completely understandable that..."), which the rule user scored as new each
    time. The echo feature (the share of a reply's content words the agent already used in this
    dialogue) makes a repeated line cost, as a repetitive reply does for the LLM user."""
    line = "It's completely understandable that you feel hurt. That sounds really painful."
    f = RuleBackend().features
    assert f(line, "", "empathy")["echo"] == 0.0 and f(line, "", "empathy", earlier=line)["echo"] == 1.0
    fresh = "What happened when your manager said it? Tell me more about the meeting."
    assert f(fresh, "", "empathy", earlier=line)["echo"] == 0.0
    sim = Simulator(RuleBackend(), initial_emotion=40, max_turns=2)
    same = sim.step(sim.step(sim.reset(sc(goal_type="empathy")), line), line)
    assert same.trace[1]["change"] < same.trace[0]["change"] and "echo -3.00" in same.trace[1]["reasoning"]


def test_the_same_acknowledgement_every_turn_pays_half():
    """Issue 39: a SmolLM2 run said "feel" in 30 of its 60 held-out replies ("How do you feel?",
    "I feel..."): acknowledging paid in full every turn, and the word, 4 letters, escaped `echo`
    (then over 5+ letter words). A reply that acknowledges only in words it already used earns
    half, one in new words in full; echo now counts the unit evaluate.py's repeat rate counts."""
    f = RuleBackend().features
    assert f("How do you feel about it?", "", "empathy", earlier="")["acknowledge"] == 1.0
    assert f("How do you feel now?", "", "empathy", earlier="How do you feel about it?")["acknowledge"] == 0.5
    assert f("That sounds so hard.", "", "empathy", earlier="How do you feel about it?")["acknowledge"] == 1.0
    assert f("How do you feel now?", "", "empathy",
             earlier="How do you feel about it?")["echo"] == 1.0  # its one content word
    assert f("Okay.", "", "empathy", earlier="How do you feel?")["acknowledge"] == 0.0


def expected_change(f: dict) -> float:
    """The rule user's change before rounding, for a user with no personality multiplier."""
    return RuleBackend.BASELINE + sum(RuleBackend.WEIGHTS[k] * v for k, v in f.items())


def test_the_rule_user_docks_a_stack_of_questions():
    """Issue 39: a SmolLM2 run learned to ask four or five questions in one reply, since the
    rule user paid a question once whatever the count. One open question still pays; each
    question after it is docked (`stacked`), so the stack earns less than the single one."""
    f = RuleBackend().features
    one = "That sounds really hard. How does that feel?"
    stack = ("That sounds really hard. How does that feel? Is that a choice? How can that happen? "
             "How can that bother you?")
    assert f(one, "", "empathy")["stacked"] == 0.0 and f(one, "", "empathy")["open_question"] == 1.0
    assert f("How does that feel? What happened?", "", "empathy")["stacked"] == 0.5
    assert f("你还好吗？发生了什么？", "", "empathy")["stacked"] == 0.5
    assert f(stack, "", "empathy")["stacked"] == 1.0
    assert expected_change(f(stack, "", "empathy")) < expected_change(f(one, "", "empathy"))
    sim = Simulator(RuleBackend(), initial_emotion=40, max_turns=2)
    assert "stacked -2.00" in sim.step(sim.reset(sc(goal_type="empathy", personality_type="")),
                                       stack).trace[0]["reasoning"]


def test_the_rule_user_docks_a_reply_cut_off_mid_sentence():
    """Issue 39: replies that ran into the 40-token cap mid-sentence were paid like finished ones
    (and a longer reply collects more keywords). `unfinished` docks a reply that ends no sentence."""
    f = RuleBackend().features
    assert f("That sounds hard. What happened?", "", "")["unfinished"] == 0.0
    assert f('He said "I\'m done."', "", "")["unfinished"] == 0.0  # a closing quote may follow
    assert f("我明白。", "", "")["unfinished"] == 0.0
    cut = "That sounds hard. What happened when you went to"
    assert f(cut, "", "")["unfinished"] == 1.0 and f("", "", "")["unfinished"] == 1.0
    assert expected_change(f(cut, "", "empathy")) < \
        expected_change(f("That sounds hard. What happened?", "", "empathy"))


def test_the_rule_user_does_not_pay_its_own_words_said_back():
    """Issue 39: with stacked questions docked, a SmolLM2 run learned to copy the user's last
    message back ("I'm still upset, ..."), which `reflect` (the user's content words reused)
    paid in full. `parrot` docks a verbatim run of 4 or more of the user's words, so a reply
    that reflects the same words in a sentence of its own earns more than the copy."""
    f = RuleBackend().features
    user = "I'm still upset, I keep thinking about what she said."
    copy = "I'm still upset, I keep thinking about what she said. That sounds hard."
    own = "It sounds like her words are still with you. What part of it hurts most?"
    assert f(copy, user, "empathy")["parrot"] == 1.0 and f(copy, user, "empathy")["reflect"] == 1.0
    assert f(own, user, "empathy")["parrot"] == 0.0 and f(own, user, "empathy")["reflect"] == 1.0
    assert f("So you keep thinking about it.", user, "empathy")["parrot"] == 0.0  # 3 words refer, not copy
    assert f("You keep thinking about what happened.", user, "empathy")["parrot"] == pytest.approx(1 / 3)
    assert expected_change(f(copy, user, "empathy")) < expected_change(f(own, user, "empathy"))
    # a Chinese character counts half a word: 6 characters copied are 3 words, not a parrot
    assert f("你一直很难过", "我一直很难过，睡不着", "empathy")["parrot"] == 0.0
    assert f("我一直很难过，晚上睡不着觉", "我一直很难过，晚上睡不着觉", "empathy")["parrot"] == 1.0
    sim = Simulator(RuleBackend(), initial_emotion=40, max_turns=3)
    state = sim.reset(sc(goal_type="empathy", personality_type="", first_message=user))
    assert "parrot -3.00" in sim.step(state, copy).trace[0]["reasoning"]


# The trained SmolLM2's replies to the held-out scenario en-043 (docs/LEARNING.md, from the run
# before this user docked stacks and cut-offs), and the user's line they answered.
EN043_USER = "I keep seeing that house. I haven't told anyone."
EN043_TRAINED = [
    "Hey, that feels really overwhelming. How can that be helpful? I'm sorry. How that makes sense? What makes you "
    "find a custom dwelling? My house looks neat. Is this your grandi",
    "It can feel overwhelming. How does that feel? Is that a choice? Are you becoming stressed about your appearance "
    "or personal preferences? It feels urgent. How can that happen? How can that bother you",
]


@pytest.mark.parametrize("user", ["standard", "challenging"])
def test_a_finished_reply_with_one_question_beats_the_gamed_replies_of_the_earlier_run(user):
    """Issue 39: checked against the earlier run's transcript: its stacked, cut-off replies now
    earn less than a finished reply with one open question that names the feeling and the topic,
    for the standard user and the challenging one (its own weights)."""
    good = "That sounds really painful, seeing that house again. What about it stays with you most?"

    def change(reply):
        return mean_change(UserState(scenario=sc(goal_type="empathy", personality_type=""), emotion=50, user=user,
                                     history=[{"role": "user", "content": EN043_USER},
                                              {"role": "assistant", "content": reply}]), reply)
    for gamed in EN043_TRAINED:
        assert change(gamed) < change(good) - 1.5, (gamed, change(gamed), change(good))


# The replies of the run that met every other line of issue 39's bar (docs/LEARNING.md, "Earlier users and runs"),
# to the held-out scenario en-043: a question about how it feels, said again from the second turn.
EN043_RUN2 = [("I keep seeing that house. I haven't told anyone.", "How would it feel?”"),
              ("I don't know... it still feels bad. Am I missing another side?",
               "How would it feel, if you just says, how it feels?”")]


def test_care_said_again_is_paid_only_for_what_is_new():
    """Issue 39: run 2's policy asked "how would it feel" again from the second turn (held-out
    repeat rate 0.09 -> 0.21): the care features (acknowledge, reflect, open question, goal) paid
    in full whatever the reply had said before, and `echo` (-3 x its share) cost less than they
    paid. They now earn their weight times the share of the reply's content words that is new,
    so the repeat earns less than a fresh finished reply with one open question, by a margin."""
    r = RuleBackend()
    (u1, a1), (u2, a2) = EN043_RUN2
    fresh = "That sounds heavy to carry alone. What part of it weighs on you most?"

    def turn2(reply):  # the second turn, after run 2's first reply
        return UserState(scenario=sc(goal_type="dialectical", personality_type=""), emotion=50,
                         history=[{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                                  {"role": "user", "content": u2}, {"role": "assistant", "content": reply}])
    assert r.features(a2, u2, "dialectical", a1)["echo"] == pytest.approx(0.4)  # would, feel of 5 words
    assert mean_change(turn2(a2), a2) < mean_change(turn2(fresh), fresh) - 2.0, \
        (mean_change(turn2(a2), a2), mean_change(turn2(fresh), fresh))
    why = r.appraise(turn2(a2), a2)[1]
    assert "open_question +0.90 (60% new)" in why and "echo -1.20" in why
    # the reasoning still adds up: the terms before "=" sum to the total after it
    terms, total = why.split(" = ")[0], float(why.split(" = ")[1].split(";")[0])
    assert sum(float(t.split()[1]) for t in terms.split("; ")) == pytest.approx(total, abs=0.02)


def score_before_rounding(reply: str, goal_type: str, earlier: str = "", last_user: str = "") -> float:
    """The standard rule user's change for `reply` before its random rounding (no personality):
    its own sum, as appraise() weighs it (care paid for the new share)."""
    r = RuleBackend()
    f = r.features(reply, last_user, goal_type, earlier)
    new = 1.0 - f["echo"]
    return r.BASELINE + sum(r.WEIGHTS[k] * v * (new if k in r.CARE and r.WEIGHTS[k] > 0 else 1.0) for k, v in f.items())


def test_a_short_line_said_again_pays_nothing_and_counts_as_a_repeat():
    """Issue 50 item 1: "Go on. How so?" has no content word (4+ letters), so its echo was 0 and
    its care was paid in full every time (+3.8 each); reply_measures counted no repeat. It is now
    said again in its words: the second and third time earn at least 1.5 less, and repeat 1."""
    from plumbing.logs import reply_measures
    line = "Go on. How so?"
    first = score_before_rounding(line, "venting")
    second = score_before_rounding(line, "venting", earlier=line)
    third = score_before_rounding(line, "venting", earlier=line + " " + line)
    assert first - second >= 1.5 and first - third >= 1.5, (first, second, third)
    history = [m for _ in range(3) for m in ({"role": "user", "content": "I lost my job."},
                                              {"role": "assistant", "content": line})]
    assert [m["repeat"] for m in reply_measures(history, "venting")] == [0.0, 1.0, 1.0]


def test_a_word_said_in_most_replies_is_a_tic():
    """Issue 50 item 1: a word (not a function word) said in most of a dialogue's replies is a
    tic, counted each time it is said (a trained model said "too" 1.05 times a reply)."""
    from plumbing.logs import reply_measures
    def dialogue(replies):
        return [m for r in replies
                for m in ({"role": "user", "content": "It was awful."}, {"role": "assistant", "content": r})]
    tic = reply_measures(dialogue(["That hurts too.", "I'm sad too, truly.", "You matter too."]), "empathy")
    varied = reply_measures(dialogue(["That hurts.", "What happened next?", "You matter to me."]), "empathy")
    assert [m["tic"] for m in tic] == [1, 1, 1] and [m["tic"] for m in varied] == [0, 0, 0]


def test_the_tic_reaches_the_training_log_and_the_reply_statistics():
    """Issue 50 item 1 asks for the tic in the training log and in evaluate.py --reply-stats too:
    both give `tics_per_reply`, the mean over the replies of all dialogues ("too" in each of the
    first dialogue's 3 replies, no tic in the second's 2: 3 / 5)."""
    from types import SimpleNamespace

    from evaluate import reply_stats
    from plumbing.logs import rollout_stats
    def dialogue(replies):
        history = [m for r in replies for m in ({"role": "user", "content": "It was awful."},
                                                {"role": "assistant", "content": r})]
        return {"history": history, "goal_type": "empathy", "valid": True, "outcome": "max_turns", "reward": 0.5,
                "emotion": 50, "turns": len(replies), "response_lengths": [4] * len(replies), "format_violations": 0,
                "scenario_id": "x"}
    both = [dialogue(["That hurts too.", "I'm sad too, truly.", "You matter too."]),
            dialogue(["That hurts.", "Go on."])]
    assert rollout_stats(SimpleNamespace(metrics=both))["tics_per_reply"] == pytest.approx(3 / 5)
    assert reply_stats(both)["tics_per_reply"] == pytest.approx(3 / 5)


@pytest.mark.parametrize("goal,right,wrong", [
    ("venting", "I'm here. Let it out, I'm listening.", "You should try to make a plan, one step at a time."),
    ("empathy", "That sounds so heavy. I hear you, you're not alone in this.",
     "On one hand it was bad, on the other hand it may help. Try a plan."),
    ("validation", "That was not your fault. Anyone would have done the same.",
     "Maybe he had his reasons. From their side, looking back, what was your part?"),
    ("praise", "Well done. You should be proud, that was brave.",
     "Looking back, what was your part in it? Next time, try a plan."),
    ("advice", "You could try one small step: make a plan for Monday.", "I'm here. Go on, tell me more, let it out."),
    ("self_reflection", "Looking back, what do you think you could learn from your part?",
     "It was not your fault. Anyone would have done it, you were right."),
])
def test_what_the_person_needs_pays_and_what_clashes_with_it_costs(goal, right, wrong):
    """Issue 50 item 2: a reply a reader would call right for the person earns the goal and no
    clash; one that serves a goal type that fails this person (rule_user.GOAL_CLASHES: advice to
    someone who came to vent, the others' side to someone who wants to hear they were right,
    ...) is docked, and ends lower than saying nothing of any goal."""
    from rule_user import GOAL_CLASHES
    f = RuleBackend().features
    good, bad = f(right, "", goal), f(wrong, "", goal)
    assert good["goal"] >= 0.5 and good["clash"] == 0.0, good
    assert bad["clash"] >= 0.5 and bad["goal"] == 0.0, bad
    neutral = "That sounds hard."
    assert score_before_rounding(wrong, goal) < score_before_rounding(neutral, goal) < \
        score_before_rounding(right, goal)
    assert GOAL_CLASHES[goal] and all(len(reason) > 10 for reason in GOAL_CLASHES[goal].values())


ANSWERS_TO_THE_HINT = {  # what a person says to each hint (rule_words.GOAL_HINTS); English: one cue each
    "advice": ["You could start small: call her tomorrow.", "你可以试试先和她聊一次。"],
    "analyze_others": ["Maybe they were scared of losing their own spot.", "他们可能也有自己的难处。"],
    "dialectical": ["There may be more to it than the part that hurt.", "换个角度看，事情也许没那么简单。"],
    "self_reflection": ["What could you have changed, do you think?", "回头看，你会怎么反思这件事？"],
    "empathy": ["That is a lot to carry.", "我能体会，这真的让人心疼。"],
    "venting": ["I'm all ears, say as much as you need.", "慢慢说，我在听，我陪你。"],
    "praise": ["All that effort shows.", "你的付出大家都看得到，我为你骄傲。"],
    "validation": ["You weren't wrong to say no.", "你是对的，换谁都会难过。"],
}


@pytest.mark.parametrize("goal", sorted(ANSWERS_TO_THE_HINT))
def test_what_a_person_says_to_the_hint_serves_the_goal_and_pays_most(goal):
    """Issue 50, after three runs: SmolLM2 at the training temperature said a cue of 3 of the 8
    goal types (dialectical, self-reflection, validation) in none of 60 replies each, and one
    cue paid half the goal (+1.5, less than naming the feeling, +2): the goal was neither found
    nor worth finding (docs/LEARNING.md, "Earlier users and runs"). What a person says to each hint now serves its
    goal, one cue pays it in full, and it pays most: more than any other care feature, so the
    answer earns more than "That sounds hard."; as the person ("I'm all ears") it is no self-talk."""
    from rule_user import goal_words
    from rule_words import GOAL_HINTS
    r = RuleBackend()
    for lang, answer in zip(("en", "zh"), ANSWERS_TO_THE_HINT[goal]):
        f = r.features(answer, GOAL_HINTS[lang][goal], goal)
        assert f["goal"] == 1.0 and f["clash"] == 0.0 and f["self_talk"] == 0.0, (lang, f)
    assert goal_words(ANSWERS_TO_THE_HINT[goal][0], goal, GOAL_HINTS["en"][goal])[0] == 1  # one cue: in full
    assert r.WEIGHTS["goal"] >= r.WEIGHTS["acknowledge"] + r.WEIGHTS["reflect"]  # more than feeling + their words
    answer, hint = ANSWERS_TO_THE_HINT[goal][0], GOAL_HINTS["en"][goal]
    assert score_before_rounding(answer, goal, last_user=hint) > \
        score_before_rounding("That sounds hard.", goal, last_user=hint)
    # naming the feeling is `acknowledge`, paid once: no goal of its own, not even the empathy user's
    assert r.features("That must feel so hurtful.", "", goal)["goal"] == 0.0


@pytest.mark.parametrize("goal,swapped", [("praise", "You worked so hard on this."), ("praise", "That is hard work."),
                                          ("dialectical", "The other half of this?"),
                                          ("analyze_others", "They might act like that."),
                                          ("validation", "Your feelings are valid.")])
def test_the_hint_said_back_in_other_pronouns_serves_no_goal(goal, swapped):
    """From a review of the cues above: the said-back rule takes only a cue the user's line holds
    word for word, so a cue that was the hint in other pronouns ("you worked" for "I worked so
    hard ...") paid the goal for saying the hint back (+8.3 against "That sounds hard."'s +2.6):
    no cue is one. Nor is a phrase said to anyone ("Your feelings are valid": a clash for
    someone who asked what was on them)."""
    from rule_words import GOAL_HINTS
    hint = "I don't know... it still feels bad. " + GOAL_HINTS["en"][goal]
    f = RuleBackend().features(swapped, hint, goal)
    assert f["goal"] == 0.0 and f["clash"] == 0.0, f
    assert RuleBackend().features(swapped, "", "self_reflection")["clash"] == 0.0


RUN4_HELD_OUT = {  # (the user's line, run 4's reply) from eval/smollm2-r3-run4, goal analyze_others (en-042)
    "My review says I'm not a team player because I skip drinks.": "How frustrating can that can be?",
    "Hm. I'm still upset. Why would they act like that?":
        "How hard can it be to miss a break on your partner feels like?",
}


def test_how_hard_can_it_be_is_dismissive_not_care():
    """Issue 50's run 4 learned one template, 59 of its 60 held-out replies: a question opening
    "How" and a feeling word ("How hard can it be to ...?"), which paid `acknowledge` and a full
    open question every turn (+4.35 a turn). "How hard can it be?" says it is easy: dismissive
    now, in English and Chinese, while a question that asks how hard it is stays care."""
    f = RuleBackend().features
    for user, reply in RUN4_HELD_OUT.items():
        assert f(reply, user, "analyze_others")["dismissive"] == 1.0
        assert score_before_rounding(reply, "analyze_others", last_user=user) < \
            score_before_rounding("That sounds hard.", "analyze_others", last_user=user)
    assert f("这有什么难的？", "", "empathy")["dismissive"] == 1.0
    for care in ("How hard has this been for you?", "How are you holding up? That sounds tough.", "这一定很难吧？"):
        assert f(care, "", "empathy")["dismissive"] == 0.0, care


def test_a_reply_that_strings_every_goal_together_earns_a_fraction_of_any():
    """Issue 50 item 2: goal was paid for any two of the goal type's cues, whatever else the
    reply said: advice, praise, validation and "tell me more" strung together earned it for
    every goal. Now only the user's own cues' share of the reply's goal cues is paid."""
    from rule_words import GOAL_WORDS
    scatter = ("You could try a plan. Well done, I'm proud of you. It was not your fault. I'm here, tell me more. "
               "Maybe he had his reasons. On one hand, on the other hand.")
    f = RuleBackend().features
    for goal in ("advice", "praise", "validation", "venting", "analyze_others", "dialectical"):
        focused = " ".join(k for k in GOAL_WORDS[goal][:3] if k.isascii()) + "."
        assert f(scatter, "", goal)["goal"] <= 0.5 < f(focused, "", goal)["goal"], goal


def test_every_goal_has_a_hint_a_reader_can_tell_apart_said_at_every_middle_level():
    """Issue 50 item 2: the user's hint at its hidden goal, in both languages, for every goal
    type and chit-chat intention: present, each different, and said with every answer at levels
    2-4 (was: half of them). None says a goal cue: test_no_hint_says_a_goal_cue_..."""
    from plumbing.scenarios import GOAL_TYPES
    from rule_words import GOAL_HINTS
    from simulator import CHITCHAT_GOALS
    for lang, hints in GOAL_HINTS.items():
        goals = [g for g in hints if g]
        assert set(goals) == set(GOAL_TYPES) | set(CHITCHAT_GOALS), lang
        assert len({hints[g] for g in goals}) == len(goals), lang
    sim = Simulator(RuleBackend(seed=0), initial_emotion=50, max_turns=6)
    for goal in ("venting", "advice", "passive_chat"):
        st = sim.reset(sc(goal_type=goal))
        for _ in range(3):
            st = sim.step(st, "I see. That sounds hard.")
        answers = [m["content"] for m in st.history[1:] if m["role"] == "user"]
        assert answers and all(GOAL_HINTS["en"][goal] in a for a in answers), answers


def test_no_hint_says_a_goal_cue_and_the_users_words_said_back_serve_no_goal():
    """Issue 50, after two runs: "another side" was both the dialectical user's hint and one of
    its goal cues ("feel" the empathy user's), so a reply that said the hint back earned `goal`
    and held-out `goal_fit` (empathy 0.00 -> 0.67) without weighing anything. No hint now says
    any goal type's cue, and a cue the user's last line said is no goal served (`reflect` pays
    the user's words), while the goal's own words still pay."""
    from rule_user import _hits
    from rule_words import GOAL_HINTS, GOAL_WORDS
    said = [(lang, g, t) for lang, hints in GOAL_HINTS.items() for g, h in hints.items()
            for t, cues in GOAL_WORDS.items() if _hits(h.lower(), cues)]
    assert not said, said
    f = RuleBackend().features
    user = "I don't know... it still feels bad. Is there another side to this I'm not seeing?"
    echo = f("There is another side to this.", user, "dialectical")
    weighed = f("On one hand you were hurt; on the other, they may not have known.", user, "dialectical")
    assert echo["goal"] == 0.0 and echo["reflect"] > 0 and weighed["goal"] == 1.0
    assert f("There is another side to this.", "", "dialectical")["goal"] > 0  # not said by the user: its own
    # the said-back filter spares the agent's own cues only, and takes the user's whole words (review)
    assert f("Go on, tell me more.", "Okay... go on. What should I actually do next?", "advice")["clash"] == 1.0
    from rule_user import goal_words
    assert goal_words("Maybe you could try a small step.", "advice",
                      "I keep trying to fix my stepmother thing.")[0] == 4
    assert goal_words("我也喜欢这个！", "interest_chat", "也许吧，挺复杂的。")[0] == 2  # 也 alone is no word said back
    assert goal_words("I'm here. Go on.", "venting", "I’m here again.")[0] == 1  # a curly apostrophe in the user's line
    from plumbing.logs import reply_measures
    history = [{"role": "user", "content": user}, {"role": "assistant", "content": "There is another side to this."}]
    assert reply_measures(history, "dialectical")[0]["goal_fit"] == 0.0


def test_a_cut_off_tail_pays_no_care():
    """Issue 50's second run ran on to the 40-token cap in 95% of its replies: the feeling words
    and goal cues of a run-on tail paid more than `unfinished` (-2) docked. The care features
    and `echo` now grade only the finished sentences (rule_user.finished_part), so a reply cut
    off mid-sentence earns less than its finished part alone."""
    from rule_user import finished_part
    assert finished_part("That sounds hard. I feel") == "That sounds hard."
    assert finished_part('He said "no." And then') == 'He said "no."' and finished_part("我明白。你") == "我明白。"
    assert finished_part("no end at all") == "" and finished_part("Done.") == "Done."
    user = "My sister never calls me back."
    short = "That sounds lonely."
    run_on = short + " It must be hard to feel alone and hurt, and it is so painful when your sister never"
    f = RuleBackend().features
    assert f(run_on, user, "empathy")["goal"] == 0.0 and f(run_on, user, "empathy")["reflect"] == 0.0
    assert score_before_rounding(run_on, "empathy", last_user=user) < \
        score_before_rounding(short, "empathy", last_user=user)
    cut = "It must be hard to feel alone and hurt when your sister never"  # no finished sentence: no care
    assert all(f(cut, user, "empathy")[k] == 0.0 for k in RuleBackend.CARE)
    stale = "It sounds lonely. Your sister never calls. Brand new words running past every"  # the tail is no news
    assert f(stale, user, "empathy", earlier="It sounds lonely. Your sister never calls.")["echo"] == 1.0
    said = "That sounds so hard and lonely, how are you holding up with all of it?"  # nor a new first sentence (review)
    assert f("Ok. That sounds so hard and lonely, how are you holding up with all", user, "empathy",
             said)["echo"] == 1.0
    assert f("I hear you. You could try to make a plan and", "", "venting")["clash"] == 1.0  # a tail's cost stays
    assert f("I hear you. Whatever, calm down and", "", "venting")["dismissive"] == 1.0
    assert finished_part("他说「好。」然后") == "他说「好。」"


def test_goal_fit_per_goal_type_in_the_reply_statistics():
    """Issue 50 item 3: evaluate.py --reply-stats gives goal_fit, the share of replies whose goal
    cues are the user's own and none of a clashing type, over all replies and per goal type."""
    from evaluate import reply_stats
    def record(sid, reply):
        return {"scenario_id": sid, "valid": True, "outcome": "max_turns",
                "history": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": reply}]}
    recs = [record("v", "I'm here. Let it out."), record("v", "Try a plan."), record("a", "Try a plan, one step.")]
    stats = reply_stats(recs, {"v": "venting", "a": "advice"})
    assert stats["goal_fit[venting]"] == 0.5 and stats["goal_fit[advice]"] == 1.0
    assert stats["goal_fit"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("user,goal,as_the_person,to_the_person", [
    ("I covered three doubles and the only thing my manager noticed was a typo.", "empathy",
     "I'm sorry my manager has only seen two types of codes, but I don't have a duplicate code.",
     "That sounds so unfair: you covered three doubles and your manager only noticed a typo."),
    ("They cut my scholarship in half. My family depends on that money.", "empathy",
     "I feel hurt when my family doesn't receive enough money.",
     "That must hurt, with your family depending on that money. I hear you."),
    ("我的经理只看到了一个错字。", "empathy", "我的经理只看到了错字，我很难受。",
     "你的付出没被看见，一定很委屈，我能感受到。"),
])
def test_the_agent_speaking_as_the_person_is_docked(user, goal, as_the_person, to_the_person):
    """Issue 50, after its first SmolLM2 run (docs/LEARNING.md): the policy learned to answer as if
    it were the person ("I'm sorry my manager ...", "I feel hurt when my family ...": acknowledge,
    reflect and empathy's cues "feel" and "hurt" paid it). A feeling said of oneself names none of
    the person's, and `self_talk` docks the first person outside an agent's frames ("I'm sorry",
    "I hear you", ...): the reply to the person earns more than a plain "That sounds hard.",
    which earns more than the reply as the person. Not in chit-chat, where the agent may speak of
    itself ("What about you?"); frames are whole words and a curly apostrophe is one (review)."""
    f = RuleBackend().features
    mine, theirs = f(as_the_person, user, goal), f(to_the_person, user, goal)
    assert mine["self_talk"] == 1.0 and theirs["self_talk"] == 0.0, (mine, theirs)
    assert score_before_rounding(as_the_person, goal, last_user=user) < \
        score_before_rounding("That sounds hard.", goal, last_user=user) < \
        score_before_rounding(to_the_person, goal, last_user=user)
    assert f("I think there is another side to it, but also theirs.", user, "dialectical")["self_talk"] == 0.0
    assert f("I’m sorry you’re going through this. I’m glad you told me.", user, goal)["self_talk"] == 0.0
    assert f("I seem to lose my job.", user, goal)["self_talk"] == 1.0  # "i see" is no frame inside "I seem"
    assert f("我感觉你很委屈。", user, goal)["acknowledge"] == 1.0  # "I sense you ...": a feeling of theirs
    assert f("Ha, my weekend was quiet too. What about yours?", "Anyway. What about you?",
             "passive_chat")["self_talk"] == 0.0


def reader_of(nats: dict):
    """A stub reader (plumbing.reader.load_reader's shape): each reply's nats a token from a table;
    what it was asked is kept in .asked."""
    def read(before, reply):
        read.asked.append((before, reply))
        return nats.get(reply, -3.0)
    read.asked, read.name = [], "stub"
    return read


def test_the_reader_gates_the_care_and_nothing_else():
    """A reply a fluent speaker could not read earns no care: `fluent` (the reader's nats a token
    through RuleBackend.FLUENT) scales the care features; what docks a reply is docked as before,
    and with no reader the user is the one of before (no `fluent`, the same change)."""
    lo, hi = RuleBackend.FLUENT
    salad = "How hurtsome feeling overwhelmlingly you? What dreams it sadness?"
    plain, reading = RuleBackend(), RuleBackend(reader=reader_of({salad: lo - 1.0}))
    st = UserState(scenario=sc(goal_type="empathy", personality_type=""), emotion=50,
                   history=[{"role": "user", "content": "They cut my hours."}, {"role": "assistant", "content": salad}])
    f = reading.features(salad, "They cut my hours.", "empathy")
    assert f.pop("fluent") == 0.0 and f == plain.features(salad, "They cut my hours.", "empathy")
    assert "fluent" not in plain.features(salad, "They cut my hours.", "empathy")
    care = sum(plain.WEIGHTS[k] * f[k] for k in plain.CARE)
    assert care > 2  # the gamed reply names a feeling and asks: care the letters-only user paid
    (paid, why), (unread, why_unread) = plain.expected_change(st, salad), reading.expected_change(st, salad)
    assert unread == pytest.approx(paid - care)
    assert "fluent 0.00" in why_unread and "fluent" not in why
    terms, total = why_unread.split(" = ")[0], float(why_unread.split(" = ")[1].split(";")[0])
    assert sum(float(t.split()[1]) for t in terms.split("; ")) == pytest.approx(total, abs=0.02)
    # the gate: none at or below FLUENT[0], all at or above FLUENT[1] (more likelihood earns nothing), linear between
    for nats, gate in [(lo, 0.0), ((lo + hi) / 2, 0.5), (hi, 1.0), (hi + 3.0, 1.0)]:
        assert RuleBackend(reader=reader_of({salad: nats})).fluent("They cut my hours.", salad) == pytest.approx(gate)
    empty = RuleBackend(reader=lambda before, reply: None)
    assert empty.fluent("They cut my hours.", "") == 0.0
    # the reader reads the reply as the answer to the user's last line alone
    reader = reader_of({})
    RuleBackend(reader=reader).expected_change(st, salad)
    assert reader.asked == [([{"role": "user", "content": "They cut my hours."}], salad)]


def test_the_reader_is_part_of_the_users_identity_and_its_flag_is_the_rule_users():
    """evaluate.py records identity(backend) with the transcripts: runs read by different readers
    never mix (check_protocol); no reader keeps the identity older records have."""
    from plumbing.backends import SimulatorArgs, describe, identity, make_backend
    assert identity(RuleBackend(seed=3)) == {"kind": "rule", "seed": 3}
    reading = RuleBackend(seed=3, reader=reader_of({}))
    assert identity(reading) == {"kind": "rule", "seed": 3, "reader": "stub"}
    assert "reading with stub" in describe(reading)
    with pytest.raises(ValueError, match="--user-reader smollm2: only the rule user reads with it"):
        make_backend(SimulatorArgs(simulator="openai", simulator_base_url="http://127.0.0.1:1/v1",
                                   simulator_model="m", user_reader="smollm2"))
    assert make_backend(SimulatorArgs(user_reader="none")).reader is None


def test_a_tiny_reader_is_refused_in_one_line():
    from plumbing.reader import load_reader
    assert load_reader("none") is None
    with pytest.raises(ValueError, match="--user-reader tiny: a random model's vocabulary reads nothing"):
        load_reader("tiny")
    with pytest.raises(ValueError, match="--user-reader /no/such/model: cannot load it"):
        load_reader("/no/such/model")
