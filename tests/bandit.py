"""A tiny bandit-like task for learning tests: one fixed prompt, 8 sampled tokens, reward =
fraction of the sampled tokens that are lowercase letters or spaces (about 10% at random init)."""
import torch

from grpo import GRPOConfig, grpo_update
from logprobs import add_logprobs
from plumbing.models import make_tiny_policy
from ppo import PPOConfig, ValueModel, ppo_update
from rollout import RolloutConfig as GenConfig
from rollout import collate, generate_turn

GOOD = "abcdefghijklmnopqrstuvwxyz "


def bandit_run(algo: str, seed: int, steps: int = 40, groups: int = 4, group_size: int = 4,
               lr: float = 3e-3, critic_lr: float = 1e-2):
    torch.manual_seed(seed)
    model, tok = make_tiny_policy(seed=seed)
    good = set(tok.encode(GOOD))
    prompt = tok.encode("<|im_start|>assistant\n")
    eos, pad = tok.eos_token_id, tok.pad_token_id
    gen = GenConfig(max_new_tokens=8, temperature=1.0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    if algo == "ppo":
        critic = ValueModel.from_config(model.config)
        copt = torch.optim.Adam(critic.parameters(), lr=critic_lr)
        cfg = PPOConfig(minibatch_size=groups * group_size, micro_batch_size=8, entropy_coef=0.0)
    else:
        cfg = GRPOConfig(minibatch_size=groups * group_size, micro_batch_size=8)
    g = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(steps):
        outs = generate_turn(model, [prompt] * (groups * group_size), gen, eos, pad)
        rows = []
        for n, o in enumerate(outs):
            r = sum(t in good for t in o) / gen.max_new_tokens
            rows.append((prompt + o, [0] * len(prompt) + [1] * len(o), r, n // group_size, n))
        batch = add_logprobs(collate(rows, pad), model)
        curve.append(batch.rewards.mean().item())
        if algo == "ppo":
            ppo_update(model, critic, (opt, copt), batch, cfg, generator=g)
        else:
            grpo_update(model, opt, batch, cfg, generator=g)
    return curve
