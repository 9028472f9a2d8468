"""How much the rule user pays for serving the hidden goal, measured on a model's own dialogues.
GRPO learns from a reply only through its dialogue's advantage over the other dialogues of its
group (the same scenario played again): a goal that is seldom served, or that lifts a dialogue
little against everything else the user pays, is not learned (docs/LEARNING.md, issue 50's
fourth run, where this measured why three runs did not learn it).

    for s in 0 1 2 3; do python evaluate.py --model smollm2 --eval-prompt train --judge none \\
        --scenarios data/scenarios_train.jsonl --temperature 1.0 --seed $s --initial-emotion 30 \\
        --max-turns 3 --max-new-tokens 40 --engine vllm --output-dir eval/probe-s$s; done
    python benchmarks/bench_goal_signal.py eval/probe-s*/smollm2/transcripts.jsonl \\
        --scenarios data/scenarios_train.jsonl

Every reply of every transcript is appraised again by today's rule user (rule_user.RuleBackend,
the user's lines as the transcript has them): its expected change (before the random rounding,
clamped to the standard user's +-10), summed over the dialogue. The transcripts of one scenario
(one per file: one per seed) are a group, as in GRPO. Printed per goal type: the replies, the
share that serve the goal (plumbing.logs.reply_measures' goal_fit), the groups holding a
dialogue with such a reply, and those dialogues' mean advantage (summed change minus the group's
mean) in units of the standard deviation of all dialogues' advantages: the signal GRPO has to
find. Exit status 1 when no scenario was played twice (no group, no advantage).
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import report  # noqa: E402
from evaluate import load_transcripts  # noqa: E402
from plumbing.logs import reply_measures  # noqa: E402
from plumbing.scenarios import load_scenarios  # noqa: E402
from rule_user import RuleBackend  # noqa: E402
from simulator import USERS, UserState  # noqa: E402


def expected_change(user: RuleBackend, state: UserState) -> float:
    """The rule user's change for the last reply of `state.history` before its random rounding:
    the last sum its reasoning states ("... = +2.50; passive personality x0.7 = +1.75; rounded
    at random to +2": the terms add up, tests/test_rule_user.py), clamped as the simulator clamps."""
    _, why = user.appraise(state, state.history[-1]["content"])
    score = float(why.rsplit("; rounded", 1)[0].rsplit("= ", 1)[1])
    cap = USERS["standard"]["max_change"]
    return max(-cap, min(cap, score))


def dialogue_signal(record: dict, scenario, user: RuleBackend) -> tuple[float, int, int]:
    """-> (the dialogue's summed expected change, its replies, those that serve the goal)."""
    history, total = record["history"], 0.0
    for k, m in enumerate(history):
        if m["role"] == "assistant":
            state = UserState(scenario=scenario, emotion=30, history=history[:k + 1],
                              turn=sum(h["role"] == "assistant" for h in history[:k]))
            total += expected_change(user, state)
    fits = [m["goal_fit"] for m in reply_measures(history, scenario.goal_type)]
    return total, len(fits), int(sum(f or 0 for f in fits))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("transcripts", nargs="+", help="transcripts.jsonl files of evaluate.py, one per seed")
    ap.add_argument("--scenarios", default=os.path.join(os.path.dirname(HERE), "data", "scenarios_train.jsonl"))
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    scenarios = {s.id: s for s in load_scenarios(args.scenarios)}
    user, groups = RuleBackend(), {}
    for path in args.transcripts:
        try:
            records = load_transcripts(path)
        except ValueError as e:  # one line naming the file and line
            sys.exit(f"bench_goal_signal.py: {e}")
        for rec in records:
            sc = scenarios.get(rec.get("scenario_id"))
            if sc is None:
                sys.exit(f"{path}: scenario {rec.get('scenario_id')!r} is not in {args.scenarios}")
            if rec["valid"] and rec["history"]:
                groups.setdefault((rec.get("model"), sc.id), []).append((sc.goal_type, *dialogue_signal(rec, sc, user)))
    played = {k: g for k, g in groups.items() if len(g) >= 2}
    if not played:
        return report.finish(args.json, {}, {"groups": "no scenario was played twice: no group, no advantage"})
    rows = [(g[0][0], total - statistics.mean(t for _, t, _, _ in g), n, fit, key)
            for key, g in played.items() for _, total, n, fit in g]
    sd = statistics.pstdev(adv for _, adv, _, _, _ in rows) or 1.0
    results = {}
    for goal in sorted({r[0] for r in rows}) + ["all"]:
        mine = [r for r in rows if goal in ("all", r[0])]
        serving = [adv for _, adv, _, fit, _ in mine if fit]
        results[goal] = {"replies": sum(r[2] for r in mine), "goal_fit": sum(r[3] for r in mine) / max(1, sum(r[2] for r in mine)),
                         "groups": len({r[4] for r in mine}), "groups_serving": len({r[4] for r in mine if r[3]}),
                         "dialogues_serving": len(serving),
                         "advantage_sd": statistics.mean(serving) / sd if serving else None}
    print(f"{'goal type':16} {'replies':>7} {'goal_fit':>8} {'groups':>6} {'serving':>7} {'advantage (sd)':>14}")
    for goal, r in results.items():
        adv = f"{r['advantage_sd']:+.2f}" if r["advantage_sd"] is not None else "-"
        print(f"{goal:16} {r['replies']:7d} {r['goal_fit']:8.3f} {r['groups']:6d} {r['groups_serving']:7d} {adv:>14}")
    print(f"sd of the dialogues' advantages: {sd:.2f} emotion points; {report.command()}")
    return report.finish(args.json, results, {})


if __name__ == "__main__":
    sys.exit(main())
