"""One FSDP2 rollout on 2 CPU processes: sharded `generate` vs the gathered generation copy.

    python benchmarks/bench_fsdp_generate.py                  # launches itself on 2 processes
    python benchmarks/bench_fsdp_generate.py --hidden 256 --layers 4 --rounds 3 --new-tokens 32

Both modes are train.py's own code path, `run_rollout`: without a generation copy it generates on
the sharded model (`generation_mode`: synced_gpus; a process whose dialogues ended joins with
dummy forward passes, `any_process_active`), with one (`make_generation_copy`) it all-gathers the
weights once (`refresh_generation_copy`), then generates with no collectives. Each round plays
the same scenarios with the same seed in both modes (interleaved, medians over rounds). Collectives are counted with the profiler (every gloo
operation on either path: FSDP's all-gathers, DTensor's, synced_gpus' all-reduces). Printed by
the main process: seconds per rollout, the ratio sharded / copy, and collectives per rollout.
On one CPU the collectives are cheap (loopback); on a GPU node each of FSDP's per-step
all-gathers moves a whole layer over the interconnect, so the ratio here is a lower bound.
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
    from rollout import GenConfig, make_tiny_policy
    from simulator import RuleBackend, Simulator, load_scenarios
    from train import Config, make_generation_copy, run_rollout

    acc = Accelerator()
    policy, tok = make_tiny_policy(seed=0, hidden_size=args.hidden, num_layers=args.layers)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.0)
    policy, opt = acc.prepare(policy, opt)
    scen = load_scenarios(os.path.join(ROOT, "data", "scenarios_train.jsonl"))
    mine = scen[acc.process_index * args.scenarios:(acc.process_index + 1) * args.scenarios]
    # Low start, so dialogues end at different turns on the two processes (as in training).
    sim = Simulator(RuleBackend(seed=0), initial_emotion=args.initial_emotion, max_turns=args.turns)
    gc = GenConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    copy = make_generation_copy(acc.unwrap_model(policy), acc.device, torch.float32)
    cfg = Config(group_size=args.group, think=False)

    def sharded():  # train.py with --no-gather-for-generation
        return run_rollout(acc, policy, None, tok, sim, mine, cfg, gc)

    def gathered():  # train.py's default under FSDP: refresh the copy, then generate from it
        return run_rollout(acc, policy, copy, tok, sim, mine, cfg, gc)

    modes = (("sharded", sharded), ("copy", gathered))
    colls, toks = {}, {}
    for name, fn in modes:  # one profiled rollout each: collectives (the profiler slows ops down)
        torch.manual_seed(1000)
        batch, colls[name] = count_collectives(fn)
        toks[name] = int(batch.loss_mask.sum())
    times = {"sharded": [], "copy": []}
    for r in range(args.rounds):  # timed rollouts, unprofiled, interleaved
        for name, fn in modes:
            torch.manual_seed(1000 + r)
            acc.wait_for_everyone()
            t0 = time.perf_counter()
            fn()
            acc.wait_for_everyone()
            times[name].append(time.perf_counter() - t0)
    if acc.is_main_process:
        ts, tc = statistics.median(times["sharded"]), statistics.median(times["copy"])
        print(f"model: hidden {args.hidden}, layers {args.layers}; per process {args.scenarios} scenarios x "
              f"{args.group}, {args.turns} turns, {args.new_tokens} new tokens; median of {args.rounds} rounds")
        print(f"sharded generate : {ts:7.2f} s/rollout  collectives {colls['sharded']:6d}  agent tokens {toks['sharded']}")
        print(f"gathered copy    : {tc:7.2f} s/rollout  collectives {colls['copy']:6d}  agent tokens {toks['copy']}")
        print(f"ratio sharded / copy: {ts / tc:.2f}x time, {colls['sharded'] / max(colls['copy'], 1):.0f}x collectives")


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
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, os.path.join(ROOT, "tests", "cpu_launch.py"), "--nproc", "2", "--mode", "fsdp2", "--",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
