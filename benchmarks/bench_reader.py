"""What the rule user's reader costs a training step, and how far its bfloat16 read is from float32.

    python benchmarks/bench_reader.py --metrics runs/learning-s0/metrics.jsonl

The smollm2-cpu preset's user reads every appraised reply with a frozen SmolLM2 (--user-reader
smollm2, plumbing.reader.load_reader): a step appraises batch_size x group_size x max_turns
replies (4 x 4 x 3 = 48). This script reads that many committed replies
(data/goal_reader_labels_run5.jsonl: the user's line, then the reply) as the rule user does,
with the reader in bfloat16 (what the preset runs) and again in float32 (evaluate.py's
--fluency-model precision), and prints the seconds a step's reads take, their share of the
median step time of a finished run (--metrics: its metrics.jsonl), and the largest difference
between the two precisions (nats a token). With --transcripts (evaluate.py's transcripts.jsonl
files) it also prints how the reader reads each file's replies, as the rule user reads them
(after the user's line): the median, the 10th and 5th percentiles (how RuleBackend.FLUENT was
set, on the base model's replies to the training scenarios) and how many fall below the gate's
top (rule_user.RuleBackend.FLUENT[1]). --json PATH writes the figures.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import report  # noqa: E402 (after sys.path)
from plumbing import models  # noqa: E402 (after sys.path)
from plumbing.reader import load_reader, reply_logprob  # noqa: E402 (after sys.path)
from rule_user import RuleBackend  # noqa: E402 (after sys.path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replies", type=int, default=48, help="replies read (a preset step appraises 48)")
    ap.add_argument("--metrics", default="", help="a finished run's metrics.jsonl: its median step time")
    ap.add_argument("--transcripts", nargs="*", default=[], help="evaluate.py transcripts: how the reader reads them")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    if args.replies < 1:
        ap.error("--replies: must be >= 1")
    if models.smollm2_missing():
        return report.finish(args.json, {}, {"reader": models.smollm2_missing()})
    with open(os.path.join(os.path.dirname(HERE), "data", "goal_reader_labels_run5.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:args.replies]
    reader = load_reader("smollm2")
    reader([{"role": "user", "content": "Hi."}], "Hello.")  # warm up
    t = time.perf_counter()
    bf16 = [reader([{"role": "user", "content": r["user_line"]}], r["reply"]) for r in rows]
    seconds = time.perf_counter() - t
    model, tok = models.load_policy("smollm2", 0, torch.float32)
    with torch.inference_mode():
        fp32 = [reply_logprob(model.eval(), tok, [{"role": "user", "content": r["user_line"]}], r["reply"])
                for r in rows]
    res = {"replies": len(rows), "seconds": round(seconds, 3), "seconds_per_read": round(seconds / len(rows), 4),
           "max_abs_diff_fp32": round(max(abs(a - b) for a, b in zip(bf16, fp32)), 4)}
    print(f"{len(rows)} replies read in {seconds:.2f} s ({seconds / len(rows) * 1000:.0f} ms a read); bfloat16 "
          f"against float32: at most {res['max_abs_diff_fp32']:.3f} nats a token apart")
    if args.metrics:
        steps = [r["step_time"] for r in map(json.loads, open(args.metrics, encoding="utf-8")) if r.get("step_time")]
        res["median_step_s"] = round(statistics.median(steps), 2)
        res["share_of_step"] = round(seconds / res["median_step_s"], 3)
        print(f"a step's reads: {seconds:.2f} s of a median step of {res['median_step_s']:.1f} s "
              f"({args.metrics}): {res['share_of_step']:.3f} of a step")
    for path in args.transcripts:
        res.setdefault("transcripts", {})[path] = read_transcripts(reader, path)
    return report.finish(args.json, {"smollm2": res}, {})


def read_transcripts(reader, path: str) -> dict:
    """Each agent reply of an evaluate.py transcript file, read as the rule user reads it."""
    values = []
    with open(path, encoding="utf-8") as f:
        for history in (json.loads(line)["history"] for line in f if line.strip()):
            last_user = ""
            for m in history:
                if m["role"] == "user":
                    last_user = m["content"]
                elif last_user:
                    values.append(reader([{"role": "user", "content": last_user}], m["content"]))
    values = [v for v in values if v is not None]
    top = RuleBackend.FLUENT[1]
    p5, p10, median = (round(float(x), 2) for x in np.percentile(values, [5, 10, 50]))  # linear interpolation
    out = {"replies": len(values), "median": median, "p10": p10, "p5": p5,
           "below_gate_top": sum(v < top for v in values)}
    print(f"{path}: {out['replies']} replies, median {median:.2f} nats a token, 10th percentile {p10:.2f}, "
          f"5th {p5:.2f}; {out['below_gate_top']} below the gate's top {top}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
