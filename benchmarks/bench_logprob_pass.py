"""The pass before the update (old log-probs, PPO's critic values) over rows of mixed lengths,
three ways of grouping the rows into forward passes, in one run.

    python benchmarks/bench_logprob_pass.py                         # 64 per-turn rows, 128-2048 tokens
    python benchmarks/bench_logprob_pass.py --model-size tiny --rows 8 --max-len 64   # toy size (the suite)

  full width   what logprobs.add_logprobs and ppo.critic_values did before: micro-batches in
               row order, every one at the batch's full width (the longest row of the step)
  trimmed      micro-batches in row order, each cut to its own longest row
  grouped      what they do now (logprobs.micro_batches): rows sorted by length, so each
               micro-batch holds rows of similar length, each cut to its own longest row

The rows imitate per-turn samples (the paper preset's think mode: a row per agent turn, each
holding the dialogue so far): lengths spread evenly between --min-len and --max-len, in a
shuffled order, as a rollout's rows come. Printed: seconds per pass (policy log-probs), tokens
the model processed (padding included), and the ratios against full width; the log-probs of
the three ways agree (max |difference| printed: different batch shapes, the same numbers).
Exit status 1 when a way failed; --json PATH writes the figures.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402 (after sys.path)

import report  # noqa: E402 (after sys.path)
from logprobs import micro_batches, token_logprobs  # noqa: E402 (after sys.path)


def model_for(size: str):
    if size == "tiny":
        from plumbing.models import make_tiny_policy
        return make_tiny_policy(seed=0)[0]
    # a small Qwen2-architecture model (random weights) whose forward cost grows with length
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=1024, max_position_embeddings=4096))


def plans(attention_mask, micro_batch: int) -> dict:
    n, width = attention_mask.shape
    in_order = [torch.arange(s, min(s + micro_batch, n)) for s in range(0, n, micro_batch)]
    lengths = attention_mask.sum(1)
    return {"full width": [(idx, width) for idx in in_order],
            "trimmed": [(idx, int(lengths[idx].max())) for idx in in_order],
            "grouped": micro_batches(attention_mask, micro_batch)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-size", default="small", choices=["tiny", "small"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model = model_for(args.model_size).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(args.min_len, args.max_len, args.rows).long()[torch.randperm(args.rows, generator=g)]
    width = int(lengths.max())
    ids = torch.randint(3, model.config.vocab_size, (args.rows, width), generator=g)
    am = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = ids * am  # right-padded with 0
    results, failed, ref = {}, {}, None
    for name, plan in plans(am, args.micro_batch).items():
        try:
            t = time.perf_counter()
            lp = token_logprobs(model, ids, am, 1.0, positions=am, plan=plan)
            seconds = time.perf_counter() - t
        except Exception as e:  # a way that fails prints no row
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        ref = lp if ref is None else ref
        results[name] = {"seconds": seconds, "tokens_processed": sum(len(idx) * w for idx, w in plan),
                         "max_abs_diff": float((lp - ref).abs().max())}
    real = int(am.sum())
    print(report.command(argv))
    print(f"model {args.model_size}, {args.rows} rows of {args.min_len}-{args.max_len} tokens ({real} real), "
          f"micro-batch {args.micro_batch}")
    print(f"{'way':<11} {'seconds':>8} {'tokens processed':>17} {'x full width':>12} {'max |diff|':>10}")
    base = results.get("full width")
    for name, r in results.items():
        ratio = r["seconds"] / base["seconds"] if base else float("nan")
        r["time_ratio"] = ratio
        print(f"{name:<11} {r['seconds']:>8.2f} {r['tokens_processed']:>17} {ratio:>12.2f} {r['max_abs_diff']:>10.1e}")
    return report.finish(args.json, results, failed, cmd=report.command(argv))


if __name__ == "__main__":
    sys.exit(main())
