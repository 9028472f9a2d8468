"""ppo.py - PPO with a learned critic and GAE, for token sequences, in plain PyTorch.

RLVER (arXiv 2507.03112, Sec. 2.4/4.1) trains with PPO and with GRPO. PPO here is the standard
RLHF recipe: a policy (the LLM), a separate critic (another LLM with a scalar head, the paper
initialises it from the same checkpoint), and the dialogue reward placed on the last token the
policy sampled. Read top to bottom, this file is the algorithm:

  1. critic values V(s_t) for every policy token     (ValueModel, critic_values)
  2. per-token rewards: 0 everywhere, R on the last agent token, optional KL penalty
                                                     (token_rewards; update.kl_penalty)
  3. GAE advantages over the agent's tokens, skipping user text   (compute_gae; Schulman 2016)
  4. advantage whitening over valid tokens           (masked_whiten)
  5. clipped surrogate policy loss                   (policy_loss; update.clipped_surrogate)
  6. clipped value loss                              (value_loss)
  7. the update: update.update_loop with PPO's loss = policy + entropy bonus + value loss, one
     optimizer step per minibatch for the actor and for the critic          (ppo_update)

The pieces GRPO shares (masked statistics, the clipped surrogate, the KL estimators, the
minibatch loop, the counts over several processes) are in update.py.

Alignment convention (logprobs.py): position t of every [N, T] tensor is the token x_t;
logprobs[t] = log pi(x_t | x_<t); values[t] = V(x_<t), the value of the state in which x_t was
chosen; loss_mask[t] = 1 when x_t was sampled by the policy.

Paper defaults: actor lr 1e-6, critic lr 5e-6, clip 0.2, value clip 0.5, entropy 1e-3, grad
clip 1.0, batch 32, 1 epoch, KL 0, gamma = lambda = 1.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from logprobs import micro_batches
from update import UpdateConfig, all_sum, clipped_surrogate, kl_penalty, masked_mean, masked_sum, update_loop


@dataclass
class PPOConfig(UpdateConfig):
    value_clip: float = field(default=0.5, metadata={"help": "PPO: how far a value may move from its rollout-time "
                                                              "value unclipped"})
    gamma: float = field(default=1.0, metadata={"help": "PPO discount"})
    lam: float = field(default=1.0, metadata={"help": "PPO GAE lambda"})


# --------------------------------------------------------------------------------------------
# 1. The critic: a causal-LM backbone with a scalar head, one value per token.
# --------------------------------------------------------------------------------------------
class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # A zero head starts every value at 0: the first advantages are the plain returns.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, **kw) -> "ValueModel":
        """Backbone from a causal-LM checkpoint (its LM head is dropped), new value head. A
        directory this class saved (with value_head.pt) gets its trained head back."""
        from transformers import AutoModel
        backbone = AutoModel.from_pretrained(path, **kw)
        vm = cls(backbone, backbone.config.hidden_size)
        head = os.path.join(path, "value_head.pt")
        if os.path.isfile(head):
            vm.value_head.load_state_dict(torch.load(head, map_location="cpu"))
        return vm.to(next(backbone.parameters()).dtype)

    @classmethod
    def from_config(cls, config) -> "ValueModel":
        from transformers import AutoModel
        return cls(AutoModel.from_config(config), config.hidden_size)

    def save_pretrained(self, path: str, **kw):
        self.backbone.save_pretrained(path, **kw)
        torch.save(self.value_head.state_dict(), os.path.join(path, "value_head.pt"))

    def forward(self, input_ids, attention_mask):
        # The critic reads the final (normed) hidden states directly, like logprobs.token_logprobs,
        # but has no LM head at all (AutoModel): no vocab-sized tensor ever exists here. Called as
        # the top-level module, so FSDP2/DDP hooks on this ValueModel gather the backbone's root.
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        v = self.value_head(h).squeeze(-1).float()
        # Shift right: values[t] = V(x_<t), read off the hidden state of x_{t-1}.
        return torch.nn.functional.pad(v[:, :-1], (1, 0)) * attention_mask


@torch.no_grad()
def critic_values(critic, batch, micro_batch_size=8):
    """The critic's values at rollout time: Batch -> [N, T] float32 on the CPU (values[t] =
    V(x_<t), see the alignment convention above), computed micro_batch_size rows at a time,
    grouped by length and each group cut to its longest row (logprobs.micro_batches)."""
    dev = next(critic.parameters()).device
    out = torch.zeros_like(batch.input_ids, dtype=torch.float32)
    for idx, width in micro_batches(batch.attention_mask, micro_batch_size):
        out[idx, :width] = critic(batch.input_ids[idx, :width].to(dev), batch.attention_mask[idx, :width].to(dev)).cpu()
    return out


# --------------------------------------------------------------------------------------------
# 2. Per-token rewards (the KL estimators are update.kl_penalty).
# --------------------------------------------------------------------------------------------
def token_rewards(rewards, mask, kl=None, kl_coef=0.0):
    """Dialogue rewards -> per-token rewards: the reward sits on the last policy-sampled token of
    each row; an optional KL penalty is charged on every policy token (InstructGPT style,
    Ouyang et al. 2022, https://arxiv.org/abs/2203.02155):

        r[i, t] = R_i * [t == last policy token of row i] - kl_coef * kl[i, t] * mask[i, t]

    rewards: [N] one scalar per row.  mask: [N, T] loss mask (1 = sampled by the policy).
    kl: [N, T] per-token KL estimate (kl_penalty) or None.
    Returns [N, T] float32. A row with no policy token gets no reward."""
    N, T = mask.shape
    pos = torch.arange(T, device=mask.device).expand(N, T)
    last = torch.where(mask.bool(), pos, -1).max(1).values  # -1 for an empty row
    r = torch.zeros(N, T, dtype=torch.float32, device=mask.device)
    ok = last >= 0
    r[ok, last[ok]] = rewards[ok].float()
    if kl is not None and kl_coef:
        r = r - kl_coef * kl * mask
    return r


# --------------------------------------------------------------------------------------------
# 3. GAE over the policy's tokens (Schulman et al. 2016, eq. 16), skipping masked positions:
# user text between agent turns is the environment's move, not a step of the agent, so the
# "next state" of an agent's last token in a turn is the first token of its next turn.
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def compute_gae(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """Generalized Advantage Estimation (https://arxiv.org/abs/1506.02438), backwards in time over
    the policy tokens only (t' = the next policy token after t; V = 0 after the last one):

        delta_t = r_t + gamma * V(s_t') - V(s_t)
        A_t     = delta_t + gamma * lam * A_t'
        R_t     = A_t + V(s_t)      (the critic's regression target)

    rewards: [N, T] per-token rewards (token_rewards).  values: [N, T] V(s_t) at rollout time.
    mask: [N, T] loss mask.  Returns (advantages [N, T], returns [N, T]), 0 where mask is 0.
    With gamma = lam = 1 (the paper's setting) and no KL penalty, A_t = R - V(s_t) for every
    policy token."""
    N, T = mask.shape
    m = mask.bool()
    adv = torch.zeros_like(values, dtype=torch.float32)
    last_gae = torch.zeros(N, device=values.device)
    next_v = torch.zeros(N, device=values.device)   # V after the final token = 0 (episode ends)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        gae = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(m[:, t], gae, 0.0)
        last_gae = torch.where(m[:, t], gae, last_gae)   # masked steps pass the carry through
        next_v = torch.where(m[:, t], values[:, t].float(), next_v)
    returns = (adv + values) * mask
    return adv, returns


# --------------------------------------------------------------------------------------------
# 4. Advantage whitening.
# --------------------------------------------------------------------------------------------
def masked_whiten(x, mask, eps=1e-8, accelerator=None):
    """(x - mean) / std over the masked tokens of the whole step (all processes: PPO whitens
    the batch's advantages as one set, as verl does on its driver).

    x: [N, T] advantages.  mask: [N, T] loss mask.  Returns [N, T], 0 where mask is 0.
    The variance is the biased (divide by n) one."""
    m = mask.to(x.dtype)
    n = all_sum(m.sum(), accelerator).clamp(min=1)
    mean = all_sum(masked_sum(x, m), accelerator) / n
    var = all_sum(masked_sum((x - mean) ** 2, m), accelerator) / n
    out = (x - mean) * torch.rsqrt(var + eps)
    return out * m


# --------------------------------------------------------------------------------------------
# 5./6. Losses (the per-token clipped surrogate is update.clipped_surrogate, shared with GRPO).
# --------------------------------------------------------------------------------------------
def policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2, denom=None, is_weights=None):
    """The clipped surrogate (clipped_surrogate) averaged over the policy tokens.

    logprobs: [N, T] log pi(x_t | x_<t) under the current policy (with gradient).
    old_logprobs: [N, T] the same at sampling time.  advantages: [N, T].  mask: [N, T] loss mask.
    denom: the token count to divide by (the whole minibatch's, when this is one micro-batch of
    it; default: mask.sum()). is_weights: [N, T] truncated importance weights or None.
    Returns (scalar loss, stats): clipfrac = fraction of tokens where the clip was active,
    approx_kl = mean of (log r)^2 / 2 (the k2 estimator), ratio = mean pi/pi_old."""
    per_tok, clipped, ratio = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps, is_weights)
    loss = masked_mean(per_tok, mask, denom)
    with torch.no_grad():
        log_r = logprobs - old_logprobs
        stats = {"clipfrac": masked_mean(clipped, mask).item(),
                 "approx_kl": masked_mean(0.5 * log_r ** 2, mask).item(),
                 "ratio": masked_mean(ratio, mask).item()}
    return loss, stats


def value_loss(values, old_values, returns, mask, clip=0.5, denom=None):
    """Clipped value loss (PPO2 / OpenAI baselines): the new value may not move more than
    `clip` from the value at rollout time without the loss noticing:

        loss = 0.5 * mean over policy tokens of max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

    values: [N, T] current critic values (with gradient).  old_values: [N, T] at rollout time.
    returns: [N, T] GAE returns (the targets).  mask: [N, T] loss mask.  denom: as policy_loss.
    Returns (scalar loss, stats): vf_clipfrac = fraction of tokens where the clipped term won,
    value_mean = mean current value."""
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    per_tok = torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    loss = 0.5 * masked_mean(per_tok, mask, denom)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean(((values - returns) ** 2 < (v_clip - returns) ** 2).float(), mask).item(),
                 "value_mean": masked_mean(values, mask).item()}
    return loss, stats


# --------------------------------------------------------------------------------------------
# 7. The update.
# --------------------------------------------------------------------------------------------
def ppo_update(policy, critic, optimizers, batch, cfg: PPOConfig, accelerator=None, generator=None) -> dict:
    """One PPO update on a rollout Batch. `optimizers` = (actor, critic). old_logprobs may be
    None only when the update is one optimizer step (one epoch, one minibatch): then pi_old = pi
    (update.check_old_logprobs refuses it otherwise).
    With `accelerator`, backward and gradient clipping go through it (FSDP, mixed precision)."""
    actor_opt, critic_opt = optimizers
    if len(batch) == 0:
        return {}
    mask = batch.loss_mask.float()
    # 1-4: values at rollout time, rewards, GAE, whitening -- all fixed for the whole update.
    old_values = critic_values(critic, batch, cfg.micro_batch_size) * mask
    if batch.ref_logprobs is not None and batch.old_logprobs is None:
        raise ValueError("a KL penalty in the reward needs the rollout's old_logprobs")
    kl = None
    if batch.ref_logprobs is not None:
        kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1") * mask
    rewards = token_rewards(batch.rewards, batch.loss_mask, kl, cfg.kl_coef)
    adv, returns = compute_gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
    adv = masked_whiten(adv, mask, accelerator=accelerator)

    def micro_loss(mb, idx, lp, old_lp, ent, n_tok, n_seq, is_weights):
        # 5-6: PPO's loss on one micro-batch: the clipped surrogate, the entropy bonus, and the
        # critic's clipped value loss (the critic has its own optimizer, so one sum serves both).
        T = mb.input_ids.shape[1]
        m = mb.loss_mask.float()
        pl, ps = policy_loss(lp, old_lp, adv[idx, :T].to(lp.device), m, cfg.clip_eps, n_tok, is_weights)
        ent_loss = -cfg.entropy_coef * masked_mean(ent, m, n_tok)
        values = critic(mb.input_ids, mb.attention_mask)
        vl, vs = value_loss(values, old_values[idx, :T].to(lp.device), returns[idx, :T].to(lp.device), m,
                            cfg.value_clip, n_tok)
        return pl + ent_loss + vl, {"policy_loss": pl.item(), "value_loss": vl.item(), **ps, **vs}

    models = {"grad_norm": (policy, actor_opt), "critic_grad_norm": (critic, critic_opt)}
    out = update_loop(batch, cfg, policy, models, micro_loss, accelerator, generator)
    out["advantage_mean"] = masked_mean(adv, mask).item()
    out["return_mean"] = masked_mean(returns, mask).item()
    if kl is not None:
        out["kl"] = masked_mean(kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k3"), mask).item()
    return out
