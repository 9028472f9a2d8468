"""ppo.py - PPO with a learned critic and GAE, for token sequences, in plain PyTorch.

RLVER (arXiv 2507.03112, Sec. 2.4/4.1) trains with PPO and with GRPO. PPO here is the standard
RLHF recipe: a policy (the LLM), a separate critic (another LLM with a scalar head, the paper
initialises it from the same checkpoint), and the dialogue reward placed on the last token the
policy sampled. Read top to bottom, this file is the algorithm:

  0. masked statistics: every sum and mean over tokens goes through the loss mask
                                                     (masked_sum, masked_mean)
  1. critic values V(s_t) for every policy token     (ValueModel, critic_values)
  2. per-token rewards: 0 everywhere, R on the last agent token, optional KL penalty
                                                     (kl_penalty, token_rewards)
  3. GAE advantages over the agent's tokens, skipping user text   (compute_gae; Schulman 2016)
  4. advantage whitening over valid tokens           (masked_whiten)
  5. clipped surrogate policy loss                   (clipped_surrogate, policy_loss; Schulman 2017)
     (+ the entropy bonus, added in ppo_update)
  6. clipped value loss                              (value_loss)
  7. epochs x minibatches x micro-batches, gradient clipping, one optimizer step per
     minibatch                                       (ppo_update)

What several processes need (every count and statistic summed over all of them) is fenced off
at the end of the file, under "plumbing, not the algorithm": all_sum, global_counts, backward.
With one process the sums are the identity, so the counts are the local ones and backward is
the plain one (through accelerate when given: mixed precision).

Alignment convention (shared with rollout.py): position t of every [N, T] tensor is the token
x_t; logprobs[t] = log pi(x_t | x_<t); values[t] = V(x_<t), the value of the state in which
x_t was chosen; loss_mask[t] = 1 when x_t was sampled by the policy.

Paper defaults: actor lr 1e-6, critic lr 5e-6, clip 0.2, value clip 0.5, entropy 1e-3, grad
clip 1.0, batch 32, 1 epoch, KL 0, gamma = lambda = 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from rollout import token_logprobs


@dataclass
class PPOConfig:
    clip_eps: float = 0.2
    value_clip: float = 0.5
    entropy_coef: float = 1e-3
    kl_coef: float = 0.0          # paper: 0 (no reference model)
    kl_kind: str = "k1"           # estimator for the in-reward KL penalty
    gamma: float = 1.0
    lam: float = 1.0
    epochs: int = 1
    minibatch_size: int = 32      # rows per optimizer step
    micro_batch_size: int = 4     # rows per forward/backward (gradient accumulation)
    max_grad_norm: float = 1.0
    vf_coef: float = 1.0
    temperature: float = 1.0      # must match the rollout's sampling temperature
    whiten_advantages: bool = True


# --------------------------------------------------------------------------------------------
# 0. Masked statistics, the vocabulary of everything below. Every reduction over tokens goes
# through a mask: user/system tokens and padding never count. An all-zero mask gives 0, not NaN.
# --------------------------------------------------------------------------------------------
def masked_sum(x, mask):
    return (x * mask).sum()


def masked_mean(x, mask, denom=None):
    """Mean of x over mask; `denom` overrides the count (micro-batches of one minibatch divide
    by the minibatch's token count, so accumulated gradients equal the full-batch gradient)."""
    d = mask.sum() if denom is None else torch.as_tensor(denom, dtype=x.dtype, device=x.device)
    return masked_sum(x, mask) / d.clamp(min=1)


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
        import os
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
        import os
        self.backbone.save_pretrained(path, **kw)
        torch.save(self.value_head.state_dict(), os.path.join(path, "value_head.pt"))

    def forward(self, input_ids, attention_mask):
        # The critic reads the final (normed) hidden states directly, like rollout.token_logprobs,
        # but has no LM head at all (AutoModel): no vocab-sized tensor ever exists here. Called as
        # the top-level module, so FSDP2/DDP hooks on this ValueModel gather the backbone's root.
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        v = self.value_head(h).squeeze(-1).float()
        # Shift right: values[t] = V(x_<t), read off the hidden state of x_{t-1}.
        return torch.nn.functional.pad(v[:, :-1], (1, 0)) * attention_mask


@torch.no_grad()
def critic_values(critic, batch, micro_batch_size=8):
    """The critic's values at rollout time: Batch -> [N, T] float32 on the CPU (values[t] =
    V(x_<t), see the alignment convention above), computed micro_batch_size rows at a time."""
    dev = next(critic.parameters()).device
    out = [critic(batch.input_ids[s:s + micro_batch_size].to(dev), batch.attention_mask[s:s + micro_batch_size].to(dev)).cpu()
           for s in range(0, len(batch), micro_batch_size)]
    return torch.cat(out) if out else torch.zeros_like(batch.input_ids, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# 2. Per-token rewards and the KL estimators.
# --------------------------------------------------------------------------------------------
def kl_penalty(logprobs, ref_logprobs, kind: str = "k1"):
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020): k1 = log r (unbiased, noisy, can be negative), k2 = (log r)^2 / 2,
    k3 = (r' - 1) - log r' with r' = ref/pi (unbiased, always >= 0; GRPO uses it)."""
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d ** 2
    if kind == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"unknown KL estimator {kind!r} (k1 | k2 | k3)")


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
# 5./6. Losses.
# --------------------------------------------------------------------------------------------
def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps):
    """Per-token PPO objective as a loss: max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi/pi_old
    (Schulman et al. 2017, eq. 7, https://arxiv.org/abs/1707.06347).
    Taking the max of the two losses (min of the objectives) removes the incentive to move the
    ratio outside [1-eps, 1+eps]: there the gradient is exactly 0.

    logprobs, old_logprobs: [N, T].  advantages: [N, T], or [N, 1] (one per row, broadcast).
    Returns (per-token loss [N, T], clipped [N, T] 1.0 where the clipped term won, ratio [N, T])."""
    ratio = torch.exp(logprobs - old_logprobs)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    return torch.maximum(l1, l2), (l2 > l1).float(), ratio


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2, denom=None):
    """The clipped surrogate (clipped_surrogate) averaged over the policy tokens.

    logprobs: [N, T] log pi(x_t | x_<t) under the current policy (with gradient).
    old_logprobs: [N, T] the same at sampling time.  advantages: [N, T].  mask: [N, T] loss mask.
    denom: the token count to divide by (the whole minibatch's, when this is one micro-batch of
    it; default: mask.sum()).
    Returns (scalar loss, stats): clipfrac = fraction of tokens where the clip was active,
    approx_kl = mean of (log r)^2 / 2 (the k2 estimator), ratio = mean pi/pi_old."""
    per_tok, clipped, ratio = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps)
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
def minibatches(n_rows, minibatch_size, micro_batch_size, generator=None):
    """Shuffled rows -> [[micro-batch row indices, ...] per minibatch]."""
    perm = torch.randperm(n_rows, generator=generator)
    for s in range(0, n_rows, minibatch_size):
        mb = perm[s:s + minibatch_size]
        yield [mb[k:k + micro_batch_size] for k in range(0, len(mb), micro_batch_size)]


def needs_old_logprobs(n_rows: int, cfg) -> bool:
    """Does an update of `n_rows` rows take more than one optimizer step (several epochs or
    minibatches)? Then every step after the first sees a policy that has moved since sampling,
    and the ratio needs the rollout's stored old log-probs. With exactly one step, pi_old is the
    current policy and its detached log-probs serve (ratio 1, one forward pass fewer)."""
    return cfg.epochs > 1 or n_rows > cfg.minibatch_size


def check_old_logprobs(batch, cfg):
    """The on-policy shortcut (old_logprobs=None) is only right for a single optimizer step;
    anywhere else it would silently train with ratio 1 after the policy moved: refuse."""
    if batch.old_logprobs is None and needs_old_logprobs(len(batch), cfg):
        raise ValueError(f"old_logprobs=None is only valid for one optimizer step per update, but this one "
                         f"takes {cfg.epochs} epoch(s) x {math.ceil(len(batch) / cfg.minibatch_size)} minibatch(es) "
                         f"({len(batch)} rows, minibatch_size {cfg.minibatch_size}): compute the rollout's "
                         f"old log-probs first (rollout.add_logprobs)")


def optimizer_step(model, optimizer, max_grad_norm, accelerator=None) -> float:
    """Clip the gradient norm, take one optimizer step, clear the gradients. Returns the
    gradient norm before clipping. Through accelerate when given (it knows about mixed
    precision and sharded parameters)."""
    if accelerator is not None:
        gn = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    else:
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(gn)


def mean_stats(rows):
    """[{name: float}, ...] -> {name: mean over the rows}; {} for no rows."""
    if not rows:
        return {}
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def minibatch_stats(micro, **extra):
    """Micro-batch stats -> one minibatch's: losses add up (each micro-batch already divides by
    the minibatch's count), everything else is averaged. `extra` (e.g. grad_norm) is added."""
    out = mean_stats(micro)
    for k in out:
        if k.endswith("_loss"):
            out[k] *= len(micro)
    return {**out, **extra}


def ppo_update(policy, critic, optimizers, batch, cfg: PPOConfig, accelerator=None, generator=None) -> dict:
    """One PPO update on a rollout Batch. `optimizers` = (actor, critic). old_logprobs may be
    None only when the update is one optimizer step (one epoch, one minibatch): then pi_old = pi
    (check_old_logprobs refuses it otherwise).
    With `accelerator`, backward and gradient clipping go through it (FSDP, mixed precision)."""
    actor_opt, critic_opt = optimizers
    if len(batch) == 0:
        return {}
    check_old_logprobs(batch, cfg)
    dev = next(policy.parameters()).device
    mask = batch.loss_mask.float()
    # 1-4: values at rollout time, rewards, GAE, whitening -- all fixed for the whole update.
    old_values = critic_values(critic, batch, cfg.micro_batch_size) * mask
    if batch.ref_logprobs is not None and batch.old_logprobs is None:
        raise ValueError("a KL penalty in the reward needs the rollout's old_logprobs")
    kl = None
    if batch.ref_logprobs is not None:
        kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, cfg.kl_kind) * mask
    rew = token_rewards(batch.rewards, batch.loss_mask, kl, cfg.kl_coef)
    adv, returns = compute_gae(rew, old_values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, mask, accelerator=accelerator)

    stats = []
    for _ in range(cfg.epochs):
        for micro_list in minibatches(len(batch), cfg.minibatch_size, cfg.micro_batch_size, generator):
            n_tok = global_counts(accelerator, mask[torch.cat(micro_list)].sum())[0]  # all processes
            micro = []
            for idx in micro_list:
                mb = batch.select(idx).to(dev)
                T = mb.input_ids.shape[1]
                m = mb.loss_mask.float()
                lp, ent = token_logprobs(policy, mb.input_ids, mb.attention_mask, cfg.temperature,
                                         return_entropy=True, entropy_grad=cfg.entropy_coef > 0, positions=mb.loss_mask)
                old_lp = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()  # on-policy: ratio 1
                pl, ps = policy_loss(lp, old_lp, adv[idx, :T].to(dev), m, cfg.clip_eps, n_tok)
                ent_loss = -cfg.entropy_coef * masked_mean(ent, m, n_tok)
                values = critic(mb.input_ids, mb.attention_mask)
                vl, vs = value_loss(values, old_values[idx, :T].to(dev), returns[idx, :T].to(dev), m, cfg.value_clip, n_tok)
                loss = pl + ent_loss + cfg.vf_coef * vl
                backward(loss, accelerator)
                micro.append({"policy_loss": pl.item(), "value_loss": vl.item(),
                              "entropy": masked_mean(ent.detach(), m).item(), **ps, **vs})
            # One optimizer step per minibatch, for the actor and for the critic.
            grad_norm = optimizer_step(policy, actor_opt, cfg.max_grad_norm, accelerator)
            critic_grad_norm = optimizer_step(critic, critic_opt, cfg.max_grad_norm, accelerator)
            stats.append(minibatch_stats(micro, grad_norm=grad_norm, critic_grad_norm=critic_grad_norm))
    out = mean_stats(stats)
    out["optimizer_steps"] = len(stats)
    out["advantage_mean"] = masked_mean(adv, mask).item()
    out["return_mean"] = masked_mean(returns, mask).item()
    if kl is not None:
        out["kl"] = masked_mean(kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k3"), mask).item()
    return out


# ============================================================================================
# Plumbing, not the algorithm: several processes. Each process holds a slice of the step's
# batch; these make every count and statistic above the whole step's, so N processes compute
# the one-process update. With one process (or no accelerator) every sum is the identity.
# ============================================================================================
def all_sum(x, accelerator=None):
    """Sum of a tensor over all processes (identity with one process). The RL math above is
    written for ONE batch; with several processes each holds a slice of it, and every
    normalising count or statistic must be taken over the whole step, not the slice."""
    if accelerator is None or accelerator.num_processes == 1:
        return x
    return accelerator.reduce(x.to(accelerator.device), reduction="sum").to(x.device)


def global_counts(accelerator, *counts):
    """A minibatch's token (and sequence) counts summed over all processes -> float tensors.

    Why: each process computes the loss of its own rows, and DDP/FSDP then AVERAGE the
    gradients over the processes. Dividing by the local count would give a mean of per-process
    means: a process with 7 tokens would weigh as much as one with 44, and a process holding
    only padding rows would halve the gradient. Instead every process divides its loss SUM by
    the GLOBAL count (one all-reduce) and multiplies by the process count to undo the
    averaging (see `backward`), so the update is the token-mean of the whole step's batch,
    exactly the one-process gradient (verl's agg_loss uses global counts the same way)."""
    c = torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in counts])
    return tuple(all_sum(c, accelerator))


def backward(loss, accelerator=None):
    """loss.backward(), through accelerate when given (mixed precision, DDP/FSDP gradient
    hooks). The loss is multiplied by the process count first: DDP and FSDP average gradients
    over processes, and the loss was already divided by the GLOBAL count (global_counts)."""
    if accelerator is None:
        loss.backward()
    else:
        accelerator.backward(loss * accelerator.num_processes)
