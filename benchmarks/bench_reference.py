"""The KL reference's pass before the update, in float32 and in bfloat16, in one run.

    python benchmarks/bench_reference.py                                  # the smollm2-cpu preset's step
    python benchmarks/bench_reference.py --model tiny --dialogues 2       # toy size (the suite)

With --kl-coef > 0 (the smollm2-cpu preset), every step reads the sampled dialogues with the
frozen reference model before the update (logprobs.add_logprobs: the log-probs of the agent's
tokens under the model training started from). The reference is never trained, so nothing
forces float32 on it: plumbing.models.REF_DTYPE reads it in bfloat16. This script reads the
same dialogues both ways with the same weights and prints the seconds of each pass, their ratio,
how far the bfloat16 log-probs are from float32 (mean, mean |difference|, max |difference|,
nats a token) and the KL that the rounding alone shows (update.kl_penalty's k3 of the float32
log-probs against the bfloat16 ones: what a policy equal to its reference would be charged).

The dialogues are the base model's held-out replies of data/goal_reader_labels_run5.jsonl, each
dialogue's three turns (the user's line, the reply) in the chat template, the replies' tokens
scored, as a step's dialogues are (--dialogues 16: the preset's 4 scenarios x 4). Each pass runs
once untimed first (warm-up), then --repeats times; the median is printed.
Exit status 1 when a precision failed; --json PATH writes the figures.
"""
import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import report  # noqa: E402 (after sys.path)
from logprobs import token_logprobs  # noqa: E402 (after sys.path)
from plumbing import models  # noqa: E402 (after sys.path)
from update import kl_penalty  # noqa: E402 (after sys.path)

LABELS = os.path.join(os.path.dirname(HERE), "data", "goal_reader_labels_run5.jsonl")


def dialogues(n: int) -> list[list[dict]]:
    """The base model's first n held-out dialogues, as chat messages (user, agent, ...)."""
    turns = defaultdict(list)
    with open(LABELS, encoding="utf-8") as f:
        for row in map(json.loads, f):
            if row["model"] == "smollm2":  # ids <scenario>-<turn>: one dialogue per scenario
                turns[row["id"].rsplit("-", 1)[0]] += [{"role": "user", "content": row["user_line"]},
                                                      {"role": "assistant", "content": row["reply"]}]
    return list(turns.values())[:n]


def encode(tok, chats: list[list[dict]]):
    """-> input_ids, attention_mask, loss_mask [N, T], right-padded: the agent's tokens scored."""
    rows = []
    for chat in chats:
        ids, scored = [], []
        for k in range(0, len(chat), 2):
            prompt = tok.apply_chat_template(chat[:k + 1], tokenize=False, add_generation_prompt=True)
            head = tok(prompt, add_special_tokens=False).input_ids[len(ids):]  # this turn's new prompt tokens
            reply = tok(chat[k + 1]["content"], add_special_tokens=False).input_ids
            ids, scored = ids + head + reply, scored + [0] * len(head) + [1] * len(reply)
        rows.append((ids, scored))
    width = max(len(ids) for ids, _ in rows)
    pad = lambda xs: xs + [0] * (width - len(xs))  # noqa: E731 (one line, used three times)
    return (torch.tensor([pad(ids) for ids, _ in rows]), torch.tensor([pad([1] * len(ids)) for ids, _ in rows]),
            torch.tensor([pad(s) for _, s in rows]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--dialogues", type=int, default=16, help="dialogues a pass reads (the preset: 16)")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows a forward pass (train.py's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if min(args.dialogues, args.micro_batch, args.repeats) < 1:
        ap.error("--dialogues, --micro-batch and --repeats must be >= 1")
    if args.model == "smollm2" and models.smollm2_missing():
        return report.finish(args.json, {}, {"smollm2": models.smollm2_missing()})
    torch.set_grad_enabled(False)
    model, tok = (models.make_tiny_policy(seed=0) if args.model == "tiny"
                  else models.load_policy("smollm2", 0, torch.float32))
    ids, am, lm = encode(tok, dialogues(args.dialogues))
    results, failed, logprobs = {}, {}, {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", models.REF_DTYPE)):
        try:
            ref = model.to(dtype).eval()
            token_logprobs(ref, ids, am, 1.0, args.micro_batch, positions=lm)  # warm-up
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                logprobs[name] = token_logprobs(ref, ids, am, 1.0, args.micro_batch, positions=lm).float()
                times.append(time.perf_counter() - t)
        except Exception as e:  # a precision that fails prints no row
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        results[name] = {"seconds": round(statistics.median(times), 3)}
    scored = lm.bool()
    print(report.command(argv))
    print(f"model {args.model}, {len(ids)} dialogues of 3 turns, {int(am.sum())} tokens "
          f"({int(scored.sum())} scored), micro-batch {args.micro_batch}, median of {args.repeats}")
    print(f"{'precision':<9} {'seconds':>8} {'x float32':>9}")
    for name, r in results.items():
        r["time_ratio"] = round(r["seconds"] / results["float32"]["seconds"], 3) if "float32" in results else None
        print(f"{name:<9} {r['seconds']:>8.2f} {r['time_ratio'] or float('nan'):>9.2f}")
    if len(logprobs) == 2:
        d = (logprobs["bfloat16"] - logprobs["float32"])[scored]
        kl = kl_penalty(logprobs["float32"][scored], logprobs["bfloat16"][scored], "k3")
        results["bfloat16"].update(mean_diff=round(d.mean().item(), 4), mean_abs_diff=round(d.abs().mean().item(), 4),
                                   max_abs_diff=round(d.abs().max().item(), 4),
                                   rounding_kl=float(f"{kl.mean().item():.3g}"))
        print("bfloat16 - float32 log-probs (nats a token): mean {mean_diff}, mean |d| {mean_abs_diff}, "
              "max |d| {max_abs_diff}; k3 KL of the rounding alone {rounding_kl}".format(**results["bfloat16"]))
    return report.finish(args.json, results, failed, cmd=report.command(argv))


if __name__ == "__main__":
    sys.exit(main())
