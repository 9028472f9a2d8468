"""One FSDP2 rollout on 2 CPU processes: sharded `generate` vs the gathered generation copy.

    python benchmarks/bench_fsdp_generate.py                  # launches itself on 2 processes
    python benchmarks/bench_fsdp_generate.py --hidden 256 --layers 4 --rounds 3 --new-tokens 32

Both modes are train.py's own code path, `run_rollout`: without a generation copy it generates on
the sharded model (`generation_mode`: synced_gpus; a process whose dialogues ended joins with
dummy forward passes, `any_process_active`), with one (`make_generation_copy`) it all-gathers the
weights once (`refresh_generation_copy`), then generates with no collectives. Each round plays
the same scenarios with the same seed in both modes (interleaved, medians over rounds). Collectives are
counted with the profiler (every gloo
operation on either path: FSDP's all-gathers, DTensor's, synced_gpus' all-reduces). Printed by
the main process: seconds per rollout, the ratio sharded / copy, and collectives per rollout.
On one CPU the collectives are cheap (loopback); on a GPU node each of FSDP's per-step
all-gathers moves a whole layer over the interconnect, so the ratio here is a lower bound.

Exit status non-zero when a mode failed on either process (raised, produced no agent token, or
a dialogue ended in simulator_error); nothing is printed for it then. --json PATH (written by
the main process) holds both modes' figures and counts.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import report  # noqa: E402 (after sys.path)


def count_collectives(fn):
    """(result, number of gloo collectives issued by fn) via the profiler's gloo:* events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    n = sum(e.count for e in prof.key_averages() if e.key.startswith("gloo:"))
    return out, n


def worker(args):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from plumbing.distributed import make_generation_copy, run_rollout
    from plumbing.models import make_tiny_policy
    from plumbing.scenarios import load_scenarios
    from rollout import RolloutConfig
    from rule_user import RuleBackend
    from simulator import Simulator

    acc = Accelerator()
    policy, tok = make_tiny_policy(seed=0, hidden_size=args.hidden, num_layers=args.layers)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.0)
    policy, opt = acc.prepare(policy, opt)
    scen = load_scenarios(os.path.join(ROOT, "data", "scenarios_train.jsonl"))
    mine = scen[acc.process_index * args.scenarios:(acc.process_index + 1) * args.scenarios]
    # Low start, so dialogues end at different turns on the two processes (as in training).
    sim = Simulator(RuleBackend(seed=0), initial_emotion=args.initial_emotion, max_turns=args.turns)
    gc = RolloutConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    copy = make_generation_copy(acc.unwrap_model(policy), acc.device, torch.float32)

    def sharded():  # train.py with --no-gather-for-generation
        return run_rollout(acc, policy, None, tok, sim, mine, args.group, False, gc)

    def gathered():  # train.py's default under FSDP: refresh the copy, then generate from it
        return run_rollout(acc, policy, copy, tok, sim, mine, args.group, False, gc)

    modes = (("sharded", sharded), ("copy", gathered))
    colls, toks, failed = {}, {}, {}
    for name, fn in modes:  # one profiled rollout each: collectives (the profiler slows ops down)
        torch.manual_seed(1000)
        batch, colls[name] = count_collectives(fn)
        toks[name] = int(batch.loss_mask.sum())
        errors = sum(m["outcome"] == "simulator_error" for m in batch.metrics)
        if errors or not toks[name]:
            failed[name] = f"process {acc.process_index}: {errors} simulator errors, {toks[name]} agent tokens"
    times = {"sharded": [], "copy": []}
    for r in range(args.rounds):  # timed rollouts, unprofiled, interleaved
        for name, fn in modes:
            torch.manual_seed(1000 + r)
            acc.wait_for_everyone()
            t0 = time.perf_counter()
            fn()
            acc.wait_for_everyone()
            times[name].append(time.perf_counter() - t0)
    failed = {k: v for f in gather_object([failed]) for k, v in f.items()}  # every process's, on every process
    results = {}
    if acc.is_main_process and not failed:
        ts, tc = statistics.median(times["sharded"]), statistics.median(times["copy"])
        print(f"model: hidden {args.hidden}, layers {args.layers}; per process {args.scenarios} scenarios x "
              f"{args.group}, {args.turns} turns, {args.new_tokens} new tokens; median of {args.rounds} rounds")
        print(f"sharded generate : {ts:7.2f} s/rollout  collectives {colls['sharded']:6d}  "
              f"agent tokens {toks['sharded']}")
        print(f"gathered copy    : {tc:7.2f} s/rollout  collectives {colls['copy']:6d}  agent tokens {toks['copy']}")
        print(f"ratio sharded / copy: {ts / tc:.2f}x time, {colls['sharded'] / max(colls['copy'], 1):.0f}x collectives")
        results = {name: {"s_per_rollout": statistics.median(times[name]), "times_s": times[name],
                          "collectives": colls[name], "agent_tokens": toks[name]} for name, _ in modes}
    if acc.is_main_process:
        report.finish(args.json, results, failed, cmd=report.command([a for a in sys.argv[1:] if a != "--worker"]))
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--scenarios", type=int, default=2, help="scenarios per process")
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--initial-emotion", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH", help="write both modes' figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        raise SystemExit(worker(args))
    print("command: " + report.command())
    if args.json and os.path.exists(args.json):
        os.remove(args.json)  # a launch that dies leaves no earlier run's results looking like its own
    cmd = [sys.executable, os.path.join(ROOT, "tests", "cpu_launch.py"), "--nproc", "2", "--mode", "fsdp2", "--",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    rc = subprocess.call(cmd)
    if rc:
        print(f"FAILED: the launch exited with status {rc}")
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
