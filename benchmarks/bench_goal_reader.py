"""How far the rule user's goal cues agree with readers, on replies readers labelled by meaning.
The rule user pays `goal` for the cues of the person's goal type and docks `clash` for those of a
goal type that fails them (rule_user.RuleBackend.features, rule_words.py GOAL_WORDS); the
held-out `goal_fit` statistic counts the same cues (plumbing.logs.reply_measures). Both stand for
"the reply gives this person what they need". This script measures how often they do, against
readers (language-model assistants told to judge by meaning, blind to the cues) who labelled the
same replies (docs/LEARNING.md, "How each line of the bar is measured").

    python benchmarks/bench_goal_reader.py      # data/goal_reader_labels.jsonl: the base model's probe
    python benchmarks/bench_goal_reader.py data/goal_reader_labels_runs.jsonl --by model  # held out, 3 models

Each labelled reply (a model's reply, the user line it answers, the user's goal type) is graded by
today's rule user: it fits when `goal` > 0 and `clash` is 0, as goal_fit counts it. A reader's
label fits when it serves the goal and does not clash. Printed per goal type (or per model, --by
model): the replies, those the reader says fit, those the cues say fit, both, recall (the share of
the reader's the cues find), precision (the share of the cues' the reader agrees with) and Cohen's
kappa (agreement beyond chance); the same for a clash; and where a second reader labelled a reply
too, the readers' kappa on fit and on clash: how far the labels themselves can be trusted. Exit
status 1 when no reply has a label.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import report  # noqa: E402 (after sys.path)
from plumbing.logs import fmt, reply_measures  # noqa: E402 (after sys.path)
from plumbing.scenarios import jsonl_rows  # noqa: E402 (after sys.path)
from rule_words import GOAL_WORDS  # noqa: E402 (after sys.path)
from simulator import CHITCHAT_GOALS  # noqa: E402 (after sys.path)

FIELDS = {"id": str, "model": str, "goal_type": str, "user_line": str, "reply": str, "serves": bool, "clash": bool}


def load_labels(path: str) -> list[dict]:
    """The labelled replies of `path` (JSONL, FIELDS; "why": the reader's reason, a few words, when
    it marked one; "second": a second reader's serves and clash, optional); a bad line is one
    ValueError naming the file and line."""
    rows = []
    for _, where, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object")
        bad = [k for k, t in FIELDS.items() if not isinstance(row.get(k), t)]
        if bad:
            raise ValueError(f"{where}: missing or mistyped {', '.join(bad)}")
        if row["goal_type"] not in GOAL_WORDS or row["goal_type"] in CHITCHAT_GOALS:
            raise ValueError(f"{where}: unknown goal type {row['goal_type']!r}")
        second = row.get("second")
        if second is not None and not (isinstance(second, dict) and
                                       all(isinstance(second.get(k), bool) for k in ("serves", "clash"))):
            raise ValueError(f"{where}: 'second' needs serves and clash, true or false")
        rows.append(row)
    return rows


def agreement(pairs: list[tuple[bool, bool]]) -> dict:
    """(reader, other) judgments -> counts, recall and precision of `other` against the reader, and
    Cohen's kappa: (observed agreement - chance agreement) / (1 - chance agreement)."""
    n, a, b = len(pairs), sum(r for r, _ in pairs), sum(o for _, o in pairs)
    both = sum(r and o for r, o in pairs)
    observed = sum(r == o for r, o in pairs) / n if n else None
    chance = (a * b + (n - a) * (n - b)) / n ** 2 if n else None
    kappa = None if not n or chance == 1 else (observed - chance) / (1 - chance)
    return {"n": n, "reader": a, "other": b, "both": both, "recall": both / a if a else None,
            "precision": both / b if b else None, "kappa": kappa}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("labels", nargs="?",
                    default=os.path.join(os.path.dirname(HERE), "data", "goal_reader_labels.jsonl"))
    ap.add_argument("--by", choices=["goal_type", "model"], default="goal_type", help="one row for each of these")
    ap.add_argument("--show", action="store_true", help="print each reply where the cues and the reader differ")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    try:
        rows = load_labels(args.labels)
    except (OSError, ValueError) as e:
        sys.exit(f"bench_goal_reader.py: {e}")
    if not rows:
        return report.finish(args.json, {}, {"labels": f"no labelled reply in {args.labels}"})
    for r in rows:  # goal_fit and clash read only the reply and the line it answers
        m = reply_measures([{"role": "user", "content": r["user_line"]}, {"role": "assistant", "content": r["reply"]}],
                           r["goal_type"])[0]
        r["cue_fit"], r["cue_clash"] = bool(m["goal_fit"]), m["rule_clash"] > 0
        r["reader_fit"] = r["serves"] and not r["clash"]
    results = {}
    for group in list(dict.fromkeys(sorted(r[args.by] for r in rows) if args.by == "goal_type" else
                                    (r["model"] for r in rows))) + ["all"]:  # models in the file's order
        mine = [r for r in rows if group in ("all", r[args.by])]
        two = [(r, r["second"]) for r in mine if r.get("second")]
        results[group] = {"fit": agreement([(r["reader_fit"], r["cue_fit"]) for r in mine]),
                          "clash": agreement([(r["clash"], r["cue_clash"]) for r in mine]),
                          "readers": agreement([(r["reader_fit"], b["serves"] and not b["clash"]) for r, b in two])
                          if two else None,
                          "readers_clash": agreement([(r["clash"], b["clash"]) for r, b in two]) if two else None}
    print(f"{args.by.replace('_', ' '):16} {'replies':>7} | fit: {'reader':>6} {'cues':>4} {'both':>4} {'recall':>6} "
          f"{'precision':>9} {'kappa':>5} | clash: {'reader':>6} {'cues':>4} {'both':>4} {'kappa':>5} | "
          f"readers' kappa: fit, clash")
    for group, r in results.items():
        fit, clash, two, two_clash = r["fit"], r["clash"], r["readers"], r["readers_clash"]
        print(f"{group:16} {fit['n']:7d} |      {fit['reader']:6d} {fit['other']:4d} {fit['both']:4d} "
              f"{fmt(fit['recall'], '.2f'):>6} {fmt(fit['precision'], '.2f'):>9} "
              f"{fmt(fit['kappa'], '+.2f'):>5} |        "
              f"{clash['reader']:6d} {clash['other']:4d} {clash['both']:4d} {fmt(clash['kappa'], '+.2f'):>5} | "
              + (f"{fmt(two['kappa'], '+.2f')}, {fmt(two_clash['kappa'], '+.2f')} (n {two['n']}; second reader's fit "
                 f"{two['other']}, clash {two_clash['other']})" if two else "-"))
    if args.show:
        for r in rows:
            if r["reader_fit"] != r["cue_fit"]:
                print(f"{'reader' if r['reader_fit'] else 'cues':6} {r['model']:8} {r['goal_type']:15} "
                      f"{r['reply'][:150]!r}")
    print(f"fit: serves the goal with no clash; recall: of the reader's, found by the cues; precision: of the "
          f"cues', the reader's too; {report.command()}")
    return report.finish(args.json, results, {})


if __name__ == "__main__":
    sys.exit(main())
