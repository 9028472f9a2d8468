"""plumbing/demo.py - watch a scripted agent (from careless to caring) talk to the simulated user.

    python -m plumbing.demo                      # the offline rule user, first test scenario
    python -m plumbing.demo --user challenging   # the paper's challenging user

Each turn prints the emotion before and after, the change and the user's reasoning (for the rule
user: every term of its score, so the numbers add up).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from transformers import HfArgumentParser

from plumbing.backends import SimulatorArgs, make_backend, make_simulator
from plumbing.checks import check_floats
from plumbing.files import InputError
from plumbing.scenarios import ScenarioError, eval_initial_emotion, load_scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEMO_REPLIES = [
    "ok",
    "You should just get over it, honestly.",
    "That sounds really hard. What happened after that?",
    "It makes sense that you feel hurt. You did your best, and that took courage. How are you holding up?",
    "I hear you. It's not your fault, and I'm here. What would help most right now?",
    "You handled a tough situation well, and I'm proud of how you kept going. Tell me more?",
]


def main(argv=None):
    ap = HfArgumentParser(SimulatorArgs, description="Play a scripted dialogue against the simulated user.")
    ap.add_argument("--scenarios", default=os.path.join(ROOT, "data", "scenarios_test.jsonl"))
    ap.add_argument("--index", type=int, default=0, help="which scenario of the file")
    ap.add_argument("--initial-emotion", type=int, default=None,
                    help="default: 40 (SAGE) for the standard user, 30 for the challenging one")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        scenarios = load_scenarios(args.scenarios)
        sim_args = SimulatorArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimulatorArgs)})
        check_floats(sim_args)
        backend = make_backend(sim_args)
    except (ScenarioError, ValueError, InputError) as e:
        ap.error(str(e))
    sc = scenarios[args.index % len(scenarios)]
    initial = args.initial_emotion
    if initial is None:
        initial = eval_initial_emotion(args.user)
    sim = make_simulator(args, backend, initial, len(DEMO_REPLIES))
    st = sim.reset(sc)
    print(f"scenario {sc.id} ({sc.personality_type}, goal: {sc.goal_type or sc.hidden_goal}), {sim.user} user, "
          f"{sim.rules} rules")
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
