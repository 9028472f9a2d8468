"""Rollout throughput with a simulator behind a real HTTP server that adds a fixed latency.

    python benchmarks/bench_rollout.py                       # B in {8, 32, 64}, 4 turns, 200 ms
    python benchmarks/bench_rollout.py --batch 64 --latency 0.5 --device cuda --model-size 0.5b

Every dialogue turn needs two simulator calls in sequence (appraisal, then the user's reply; the
last turn only the appraisal), so the critical path of a T-turn rollout is (2T - 1) round trips.
ideal = (2T - 1) x latency + time spent inside generate(); ratio = wall / ideal. Without
concurrency the ratio would grow with B (B x the round trips); the goal is < 1.5 at B = 64.
"""
import argparse
import contextlib
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

import torch  # noqa: E402

from rollout import GenConfig, make_tiny_policy, rollout  # noqa: E402
from simulator import OpenAIBackend, Simulator, load_scenarios  # noqa: E402


@contextlib.contextmanager
def fake_server(latency):
    """The chat-completions server in its own process, as a real simulator server would be
    (in-process, its request handling would compete with the rollout for the GIL)."""
    p = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(HERE), "tests", "fake_openai.py"),
                          "--latency", str(latency)], stdout=subprocess.PIPE, text=True)
    try:
        yield p.stdout.readline().strip()
    finally:
        p.terminate()
        p.wait()


def policy_for(size, device):
    if size == "tiny":
        model, tok = make_tiny_policy(seed=0)
    else:  # a Qwen2-architecture model of realistic shape, random weights, built from a config
        from bench_train import qwen_config_policy
        model, tok = qwen_config_policy(size)
    return model.to(device), tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--latency", type=float, default=0.2, help="seconds added to every simulator call")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", default="tiny", choices=["tiny", "0.5b", "1.5b"])
    args = ap.parse_args()
    print("command: python benchmarks/bench_rollout.py " + " ".join(sys.argv[1:]))
    model, tok = policy_for(args.model_size, args.device)
    scen = [s for s in load_scenarios(os.path.join(os.path.dirname(HERE), "data", "scenarios_train.jsonl")) if s.first_message]
    gen_time = [0.0]
    orig = model.generate

    def timed_generate(**kw):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = orig(**kw)
        if args.device == "cuda":
            torch.cuda.synchronize()
        gen_time[0] += time.perf_counter() - t
        return out

    model.generate = timed_generate
    print(f"model {args.model_size} on {args.device}, {args.turns} turns, {args.max_new_tokens} new tokens/turn, "
          f"simulator latency {args.latency * 1000:.0f} ms/call")
    print(f"{'B':>4} {'wall s':>8} {'ideal s':>8} {'ratio':>6} {'dialogues/s':>12} {'gen tok/s':>10} {'sim calls':>10}")
    for B in args.batch:
        calls = [0]
        with fake_server(args.latency) as url:
            backend = OpenAIBackend(url, "fake", timeout=30, max_retries=0)
            chat = backend.chat
            def counted(messages):
                calls[0] += 1
                return chat(messages)
            backend.chat = counted
            sim = Simulator(backend, initial_emotion=30,
                            max_turns=args.turns, concurrency=B)
            scenarios = (scen * (B // len(scen) + 1))[:B]
            gen_time[0] = 0.0
            torch.manual_seed(0)
            t = time.perf_counter()
            batch = rollout(model, tok, sim, scenarios, 1, False, GenConfig(max_new_tokens=args.max_new_tokens),
                            compute_logprobs=False)
            wall = time.perf_counter() - t
        turns = max(m["turns"] for m in batch.metrics)
        ideal = (2 * turns - 1) * args.latency + gen_time[0]
        gen_tokens = sum(sum(m["response_lengths"]) for m in batch.metrics)
        print(f"{B:>4} {wall:>8.2f} {ideal:>8.2f} {wall / ideal:>6.2f} {B / wall:>12.2f} {gen_tokens / wall:>10.0f} "
              f"{calls[0]:>10}")


if __name__ == "__main__":
    main()
