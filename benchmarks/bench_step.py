"""One training step with `--engine vllm`, two ways of getting pi_old, in one run.

    python benchmarks/bench_step.py --model-size smollm2                  # the smollm2-cpu preset's step
    python benchmarks/bench_step.py --model-size tiny64 --steps 2 --batch-size 1 --max-new-tokens 4

  separate pass  what train.py did before: with the vLLM engine, pi_old (the trainer's log-probs
                 of the sampled tokens) was always computed in a forward pass of its own, only
                 to log how far the engine's sampler was from the trainer
  from update    what it does now: when the update is one optimizer step, pi_old is the policy as
                 the update finds it, so the update's own forward gives those log-probs
                 (update.update_loop leaves them in the batch) and the mismatch is read from them

Each way runs `train.py --preset smollm2-cpu --engine vllm` (its sizes, from flags) as a process
of its own (the separate pass: with update.needs_old_logprobs always true, set before train.py
runs) for --steps steps in a fresh output folder; the first step (the engine's warm-up) is left out of the means.
Printed: seconds per step and per rollout for each, and the ratio of the step times. The runs
sample the same dialogues (same seed), so both steps do the same work but for the pass.

Exit status 1 when a way failed (no row printed for it); --json PATH writes the figures.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import report  # noqa: E402 (after sys.path)
from plumbing.models import make_tiny_policy  # noqa: E402 (after sys.path)

ROOT = os.path.dirname(HERE)
# The old rule, for the separate pass: train.py imports needs_old_logprobs from update when it
# starts, so setting it on update first makes train.py take a pass of its own every step.
OLD_RULE = ("import runpy, sys, update; update.needs_old_logprobs = lambda *a, **k: True; "
            "sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')")

WAYS = ("separate pass", "from update")


def model_flag(size: str, folder: str) -> str:
    if size == "smollm2":
        return "smollm2"
    # the tiny word-level model with 2 heads of 64 (vLLM's CPU attention needs a head of >= 32)
    model, tok = make_tiny_policy(seed=0, hidden_size=128, num_heads=2, words=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run(way: str, args, model: str, folder: str) -> dict:
    flags = ["--preset", "smollm2-cpu", "--model", model, "--engine", "vllm", "--steps", str(args.steps),
             "--batch-size", str(args.batch_size), "--max-turns", str(args.max_turns), "--max-new-tokens",
             str(args.max_new_tokens), "--vllm-kv-cache-gb", str(args.vllm_kv_cache_gb), "--save-every",
             str(args.steps + 1), "--report-to", "none", "--output-dir", folder]
    # the old rule for the separate pass: a pass of its own whenever an engine sampled
    cmd = ["-c", OLD_RULE] if way == "separate pass" else ["train.py"]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *cmd, *flags], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"train.py exited {p.returncode}: {p.stderr.strip()[-500:]}")
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") if line.strip()]
    timed = rows[1:] or rows  # the first step warms the engine up
    return {"steps": len(rows), "wall_s": wall, "step_s": sum(r["step_time"] for r in timed) / len(timed),
            "rollout_s": sum(r["rollout_time"] for r in timed) / len(timed),
            "mismatch_mean": rows[-1].get("sampler_logprob_diff_mean"),
            "rewards": [r["reward"] for r in rows]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-size", default="smollm2", choices=["tiny64", "smollm2"])
    ap.add_argument("--steps", type=int, default=4, help="steps per way (the first is not timed)")
    ap.add_argument("--batch-size", type=int, default=4, help="scenarios per step (x 4 dialogues, GRPO)")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--vllm-kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    results, failed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_flag(args.model_size, os.path.join(tmp, "model"))
        for way in WAYS:
            try:
                results[way] = run(way, args, model, os.path.join(tmp, way.replace(" ", "_")))
            except Exception as e:  # a way that fails prints no row
                failed[way] = f"{type(e).__name__}: {e}"
    print(report.command(argv))
    print(f"model {args.model_size}, {args.batch_size} scenarios x 4 dialogues x {args.max_turns} turns x "
          f"{args.max_new_tokens} tokens, {args.steps} steps (the first not timed)")
    print(f"{'pi_old':<14} {'s/step':>7} {'s/rollout':>9} {'mismatch':>9}")
    for way, r in results.items():
        print(f"{way:<14} {r['step_s']:>7.2f} {r['rollout_s']:>9.2f} {r['mismatch_mean'] or 0:>9.2e}")
    if len(results) == len(WAYS):
        ratio = results["from update"]["step_s"] / results["separate pass"]["step_s"]
        print(f"step time, from update / separate pass: {ratio:.2f}x")
        results["from update"]["step_ratio"] = ratio
    return report.finish(args.json, results, failed, cmd=report.command(argv))


if __name__ == "__main__":
    sys.exit(main())
