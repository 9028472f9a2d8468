"""How much the rule user pays for serving the hidden goal, measured on a model's own dialogues.
GRPO learns from a reply only through its dialogue's advantage over the other dialogues of its
group (the same scenario played again): a goal that is seldom served, or that lifts a dialogue
little against everything else the user pays, is not learned (docs/LEARNING.md, "Earlier users and
runs": user 3, run 4, where this measured why three runs did not learn it).

    for s in 0 1 2 3; do python evaluate.py --model smollm2 --eval-prompt train --judge none \\
        --scenarios data/scenarios_train.jsonl --temperature 1.0 --seed $s --initial-emotion 30 \\
        --max-turns 3 --max-new-tokens 40 --engine vllm --output-dir eval/probe-s$s; done
    python benchmarks/bench_goal_signal.py eval/probe-s*/smollm2/transcripts.jsonl \\
        --scenarios data/scenarios_train.jsonl

Every reply of every transcript is appraised again by today's rule user (rule_user.RuleBackend,
the user's lines as the transcript has them): its expected change (RuleBackend.expected_change,
before the random rounding, clamped as the simulator clamps), summed over the dialogue. The transcripts of one scenario
(one per file: one per seed) are a group, as in GRPO. Printed per goal type: the replies, the
share that serve the goal (plumbing.logs.reply_measures' goal_fit), the groups holding a
dialogue with such a reply, and those dialogues' mean advantage (summed change minus the group's
mean) in units of the standard deviation of all dialogues' advantages, with its standard error
and how many dialogues it rests on, and their advantage as GRPO computes it (grpo.group_advantages:
over the group's standard deviation): the signal GRPO has to find. The user each file was played
against (its protocol.json, when beside it) appraises it again; files of one model and user, one
per seed. Exit status 1 when no scenario was played twice or every group's dialogues are equal.
The user's lines are the transcript's own, written by the user that played it: the hint and
level each reply answered, not what today's user would have said; and the summed change ignores
the emotion's [0, 100] bounds (harmless at 3 turns from 30).
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import torch  # noqa: E402 (after sys.path)

import report  # noqa: E402 (after sys.path)
from evaluate import load_transcripts  # noqa: E402 (after sys.path)
from grpo import group_advantages  # noqa: E402 (after sys.path)
from plumbing.logs import AGENT_ROLES, fmt, reply_measures  # noqa: E402 (after sys.path)
from plumbing.scenarios import json_line, load_scenarios  # noqa: E402 (after sys.path)
from rule_user import RuleBackend  # noqa: E402 (after sys.path)
from simulator import USERS, UserState  # noqa: E402 (after sys.path)


def expected_change(user: RuleBackend, state: UserState) -> float:
    """The rule user's change for the last reply of `state.history` before its random rounding
    (RuleBackend.expected_change), clamped as the simulator clamps the rounded change (the same
    in expectation: the bounds are integers)."""
    score, _ = user.expected_change(state, state.history[-1]["content"])
    cap = USERS[state.user]["max_change"]
    return max(-cap, min(cap, score))


def dialogue_signal(record: dict, scenario, user: RuleBackend, who: str) -> dict:
    """-> the dialogue's goal type, summed expected change, replies with a goal, and those that serve it."""
    history, total, replies = record["history"], 0.0, 0
    for k, m in enumerate(history):
        if m.get("role") in AGENT_ROLES:
            state = UserState(scenario=scenario, emotion=30, history=history[:k + 1], turn=replies, user=who)
            total += expected_change(user, state)
            replies += 1
    fits = [m["goal_fit"] for m in reply_measures(history, scenario.goal_type) if m["goal_fit"] is not None]
    return {"goal": scenario.goal_type, "total": total, "replies": len(fits), "serving": int(sum(fits))}


def protocol_of(path: str) -> dict:
    """evaluate.py's protocol.json beside a transcripts file ({} when there is none); one that is
    not a JSON object is a ValueError naming it."""
    beside = os.path.join(os.path.dirname(path), "protocol.json")
    if not os.path.isfile(beside):
        return {}
    try:
        with open(beside, encoding="utf-8") as f:
            protocol = json_line(f.read(), beside)
    except UnicodeDecodeError as e:
        raise ValueError(f"{beside}: not UTF-8 text (byte {e.start})") from None
    if not isinstance(protocol, dict):
        raise ValueError(f"{beside}: not a JSON object")
    return protocol


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("transcripts", nargs="+", help="transcripts.jsonl files of evaluate.py: one model, one per seed")
    ap.add_argument("--scenarios", default=os.path.join(os.path.dirname(HERE), "data", "scenarios_train.jsonl"))
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    def refuse(why: str):
        sys.exit(f"bench_goal_signal.py: {why}")
    if len({os.path.realpath(p) for p in args.transcripts}) < len(args.transcripts):
        refuse("a transcripts file is given twice: the same dialogues are no group")
    try:  # one line naming the file (and line) for a bad input
        scenarios = {s.id: s for s in load_scenarios(args.scenarios)}
        files = [(path, protocol_of(path), load_transcripts(path)) for path in args.transcripts]
    except ValueError as e:
        refuse(str(e))
    seeds = [(p.get("weights"), p.get("seed")) for _, p, _ in files if "seed" in p]
    if len(set(seeds)) < len(seeds):
        refuse("two files were played with the same weights and seed: the same dialogues are no group")
    if len({p.get("user", "standard") for _, p, _ in files}) > 1:
        refuse("the files were played against different users (protocol.json 'user')")
    user, groups, who = RuleBackend(), {}, files[0][1].get("user", "standard")
    for path, protocol, records in files:
        if not records:
            refuse(f"{path}: no dialogue")
        for n, rec in enumerate(records, 1):
            sc = scenarios.get(rec.get("scenario_id"))
            if sc is None:
                refuse(f"{path}: dialogue {n}: scenario {rec.get('scenario_id')!r} is not in {args.scenarios}")
            if rec["valid"] is True and any(m.get("role") in AGENT_ROLES for m in rec["history"]):  # as GRPO
                key = (protocol.get("weights", rec.get("model")), sc.id)
                groups.setdefault(key, []).append({**dialogue_signal(rec, sc, user, who), "group": key})
    played = [(key, g) for key, g in groups.items() if len(g) >= 2]
    if not played:
        return report.finish(args.json, {}, {"groups": "no scenario was played twice: no group, no advantage"})
    rows = [{**d, "advantage": d["total"] - statistics.mean(e["total"] for e in g)} for _, g in played for d in g]
    sd = statistics.pstdev(r["advantage"] for r in rows)
    if sd == 0:
        return report.finish(args.json, {}, {"spread": "every group's dialogues are equal: no advantage anywhere"})
    ids = torch.tensor([i for i, (_, g) in enumerate(played) for _ in g])  # rows are in the same order
    grpo = group_advantages(torch.tensor([r["total"] / 100 for r in rows]), ids).tolist()
    for r, a in zip(rows, grpo):
        r["grpo"] = a
    results = {}
    for goal in sorted({r["goal"] for r in rows}) + ["all"]:
        mine = [r for r in rows if goal in ("all", r["goal"])]
        serving = [r for r in mine if r["serving"]]
        adv = [r["advantage"] / sd for r in serving]
        replies = sum(r["replies"] for r in mine)
        results[goal] = {"replies": replies, "goal_fit": sum(r["serving"] for r in mine) / replies if replies else None,
                         "groups": len({r["group"] for r in mine}),
                         "groups_serving": len({r["group"] for r in serving}),
                         "dialogues_serving": len(serving),
                         "advantage_sd": statistics.mean(adv) if adv else None,
                         "advantage_se": statistics.stdev(adv) / len(adv) ** 0.5 if len(adv) > 1 else None,
                         "grpo_advantage": statistics.mean(r["grpo"] for r in serving) if serving else None}
    print(f"{'goal type':16} {'replies':>7} {'goal_fit':>8} {'groups':>6} {'serving':>7} {'n':>3} "
          f"{'advantage (sd)':>15} {'GRPO advantage':>14}")
    for goal, r in results.items():
        adv = fmt(r["advantage_sd"], "+.2f") + (f" ±{r['advantage_se']:.2f}" if r["advantage_se"] is not None else "")
        print(f"{goal:16} {r['replies']:7d} {fmt(r['goal_fit'], '8.3f'):>8} {r['groups']:6d} {r['groups_serving']:7d} "
              f"{r['dialogues_serving']:3d} {adv:>15} {fmt(r['grpo_advantage'], '+.2f'):>14}")
    print(f"n: the goal-serving dialogues; ±: one standard error; sd of all dialogues' advantages: {sd:.2f} "
          f"emotion points; {report.command()}")
    return report.finish(args.json, results, {})


if __name__ == "__main__":
    sys.exit(main())
