"""mp_checks.py - multi-process checks that need real processes; run under tests/cpu_launch.py:

    python tests/cpu_launch.py --nproc 2 --mode fsdp2 -- tests/mp_checks.py OUT.json

Each process holds a slice of one fixed batch of rows; the main process then recomputes the
same update on ALL rows in one process (no accelerate) and compares. Results go to OUT.json:
  grad_rel_l2[case]  relative L2 distance between the 2-process and the 1-process gradients
                     (GRPO: token-mean and seq-mean-token-mean; PPO: policy and critic), for
                     an uneven split (one process holds far fewer agent tokens) and for a split
                     where one process holds only padding rows;
  copy_max_diff      the gathered generation copy vs the full state dict (train.py);
  same_generation    sampling from the copy == sampling from a one-process model, same seed;
  saved_logits_diff  plumbing.checkpoints.save_final's directory reloaded with transformers vs the copy.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from accelerate import Accelerator  # noqa: E402 (after sys.path)

import plumbing.distributed as train  # noqa: E402 (after sys.path)
from grpo import GRPOConfig, grpo_update  # noqa: E402 (after sys.path)
from plumbing.checkpoints import save_final  # noqa: E402 (after sys.path)
from plumbing.distributed import pad_rows  # noqa: E402 (after sys.path)
from plumbing.lora import add_adapter  # noqa: E402 (after sys.path)
from plumbing.models import make_tiny_policy  # noqa: E402 (after sys.path)
from ppo import PPOConfig, ValueModel, ppo_update  # noqa: E402 (after sys.path)
from rollout import RolloutConfig as GenConfig  # noqa: E402 (after sys.path)
from rollout import collate, end_of_turn_id, generate_turn  # noqa: E402 (after sys.path)


class Capture(torch.optim.SGD):
    """SGD that records each step's gradient (whole, also when FSDP shards it) by name."""

    def __init__(self, named, lr=0.0):
        named = list(named)
        super().__init__([p for _, p in named], lr=lr)
        self.names, self.grads = [n for n, _ in named], []

    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"]]
        full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in ps]
        self.grads.append({n: g.detach().clone().cpu() for n, g in zip(self.names, full)})
        return super().step(closure)


def rows(pad_id):
    """Six fixed rows: prompt (mask 0) then agent tokens (mask 1), uneven lengths, 3 groups."""
    g = torch.Generator().manual_seed(0)
    spec = [(20, 3), (18, 4), (10, 30), (12, 26), (9, 44), (15, 35)]  # (prompt len, agent tokens)
    out = []
    for i, (p, a) in enumerate(spec):
        ids = torch.randint(3, 250, (p + a,), generator=g).tolist()
        out.append((ids, [0] * p + [1] * a, [0.2, 0.9, 0.4, 0.7, 0.1, 0.6][i], i // 2, i))
    return collate(out, pad_id)


def relative_l2(a: dict, b: dict) -> float:
    num = sum(((a[k].float() - b[k].float()) ** 2).sum() for k in b)
    return float(num.sqrt() / sum((b[k].float() ** 2).sum() for k in b).sqrt())


def fresh(algo, lora=False):
    """The tiny policy (and PPO's critic); lora: each with a rank-4 adapter added before
    prepare, as train.py does, its B random (nonzero: A gets a gradient too)."""
    torch.manual_seed(0)
    policy, tok = make_tiny_policy(seed=0)
    critic = None
    if algo == "ppo":
        critic = ValueModel.from_config(policy.config)
        torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # nonzero: backbone gets gradient
    if lora:
        args = SimpleNamespace(lora_rank=4, lora_alpha=0.0, lora_target_modules="")
        policy = add_adapter(policy, args, "tiny")
        if critic is not None:
            critic.backbone = add_adapter(critic.backbone, args, "tiny")
        with torch.no_grad():
            for model in (policy, critic):
                for name, p in (model.named_parameters() if model is not None else []):
                    if "lora_B" in name:
                        p.normal_(std=0.05)
    return policy, tok, critic


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def update(algo, agg, batch, policy, critic, accelerator):
    """One update with Capture optimizers -> (policy grads, critic grads or None)."""
    opt = Capture(trainable(policy))
    copt = Capture(trainable(critic)) if critic is not None else None
    if accelerator is not None:
        accelerator = Accelerator()  # a fresh model list (the shared process state is kept)
        policy, opt = accelerator.prepare(policy, opt)
        if critic is not None:
            critic, copt = accelerator.prepare(critic, copt)
        opt, copt = opt.optimizer, (copt.optimizer if copt is not None else None)
    common = dict(minibatch_size=6, micro_batch_size=2, max_grad_norm=1e9)  # all 6 rows of the step: one minibatch
    gen = torch.Generator().manual_seed(1)
    if algo == "grpo":
        grpo_update(policy, opt, batch, GRPOConfig(loss_agg=agg, **common), accelerator, gen)
    else:
        ppo_update(policy, critic, (opt, copt), batch, PPOConfig(entropy_coef=0.01, **common), accelerator, gen)
    return opt.grads[0], (copt.grads[0] if copt is not None else None), (policy, accelerator)


def main(out_path):
    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    assert world == 2, world
    _, tok, _ = fresh("grpo")
    full = rows(tok.pad_token_id)
    # Two splits of the same rows over the 2 processes (groups stay whole, as in train.py):
    #   uneven: process 0 holds group 0 (7 agent tokens), process 1 groups 1 and 2 (214 tokens)
    #   padding: process 0 holds everything, process 1 only padding rows (zero loss mask)
    splits = {"uneven": [[0, 1], [2, 3, 4, 5]], "padding": [[0, 1, 2, 3, 4, 5], []]}
    res = {"grad_rel_l2": {}}
    policy = None
    cases = [("grpo", "token-mean", False), ("grpo", "seq-mean-token-mean", False), ("grpo", "token-mean", True),
             ("ppo", "token-mean", True), ("ppo", "token-mean", False)]  # LoRA (issue 49): adapters only
    for algo, agg, lora in cases:
        for split, parts in splits.items():
            mine = full.select(parts[rank]) if parts[rank] else collate([], tok.pad_token_id)
            mine = pad_rows(mine, max(len(p) for p in parts), tok.pad_token_id)  # as train.py does
            p, _, c = fresh(algo, lora)
            g, cg, (policy, acc) = update(algo, agg, mine, p, c, accelerator)
            if rank == 0:
                p1, _, c1 = fresh(algo, lora)
                g1, cg1, _ = update(algo, agg, full, p1, c1, None)
                assert not lora or all("lora_" in k or "value_head" in k for k in {**g1, **(cg1 or {})}), list(g1)[:3]
                key = f"{algo}/{agg}/{split}" + ("/lora" if lora else "")
                res["grad_rel_l2"][key] = relative_l2(g, g1)
                if cg is not None:
                    res["grad_rel_l2"][key + "/critic"] = relative_l2(cg, cg1)
            accelerator.wait_for_everyone()

    # The generation copy (built and refreshed as train.py does) and the final save, on the
    # last prepared (PPO) policy.
    accelerator = acc
    with torch.no_grad():  # move the weights away from their initial values first
        for prm in accelerator.unwrap_model(policy).parameters():
            prm.add_(0.01)
    copy = train.make_generation_copy(accelerator.unwrap_model(policy), accelerator.device, torch.float32)
    train.refresh_generation_copy(accelerator.unwrap_model(policy), copy)
    state = accelerator.get_state_dict(policy)  # a different gather path (full state dict)
    save_dir = tempfile.mkdtemp() if rank == 0 else None
    save_dir = accelerator.gather_for_metrics([save_dir], use_gather_object=True)[0]
    save_final(accelerator, policy, tok, save_dir)
    if rank == 0:
        cs = copy.state_dict()
        res["copy_max_diff"] = max(float((cs[k] - v).abs().max()) for k, v in state.items())
        res["copy_keys_match"] = set(state) <= set(cs)
        one, _, _ = fresh("grpo")
        one.load_state_dict(state, strict=False)
        gc, eos = GenConfig(max_new_tokens=12, temperature=1.0), end_of_turn_id(tok)
        ctx = [full.input_ids[i, :15].tolist() for i in range(4)]
        outs = []
        for model in (copy, one):
            torch.manual_seed(123)
            outs.append(generate_turn(model, ctx, gc, eos, tok.pad_token_id))
        res["same_generation"] = outs[0] == outs[1]
        res["generated_tokens"] = sum(len(t) for t in outs[0])
        from transformers import AutoModelForCausalLM
        loaded = AutoModelForCausalLM.from_pretrained(save_dir)
        with torch.no_grad():
            a = loaded(full.input_ids, attention_mask=full.attention_mask).logits
            b = copy(full.input_ids, attention_mask=full.attention_mask).logits
        res["saved_logits_diff"] = float((a - b).abs().max())
        res["distributed_type"] = str(accelerator.distributed_type)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
