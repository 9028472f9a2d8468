"""grpo.py - GRPO (Shao et al. 2024, DeepSeekMath Sec. 4), critic-free, in plain PyTorch.

RLVER (arXiv 2507.03112, Sec. 2.4) samples G = 4 dialogues per scenario. Instead of a learned
critic, GRPO uses the other members of the group as the baseline:

  1. group advantages  A_i = (R_i - mean(R_group)) / (std(R_group) + eps)    (group_advantages)
     (Dr. GRPO, Liu et al. 2025, drops the std scaling: scale="none")
  2. every policy token of sample i gets A_i
  3. the PPO clipped surrogate on the token ratios, optional KL to a reference model with the
     k3 estimator (the paper uses no KL), aggregated over tokens               (grpo_loss)
     (+ the entropy bonus, as in PPO: the official RLVER config sets 1e-3      (grpo_update))
  4. minibatches x micro-batches with exact gradient accumulation             (grpo_update)

The clipped surrogate, KL estimators, masking helpers and minibatch loop are ppo.py's: GRPO
is PPO with a different advantage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo import (_mean, _minibatch_stats, _step, backward, check_old_logprobs, clipped_surrogate, global_counts,
                 kl_penalty, masked_mean, minibatches)
from rollout import token_logprobs


@dataclass
class GRPOConfig:
    clip_eps: float = 0.2
    kl_coef: float = 0.0            # paper: 0 -> no reference model is loaded
    scale: str = "std"              # "std" (GRPO) | "none" (Dr. GRPO)
    agg: str = "token-mean"         # token-mean | seq-mean-token-mean | seq-mean-token-sum
    epochs: int = 1
    minibatch_size: int = 32
    micro_batch_size: int = 4
    max_grad_norm: float = 1.0
    temperature: float = 1.0        # must match the rollout's sampling temperature
    eps: float = 1e-6
    # Entropy bonus, as in PPO. verl (the official RLVER code) applies actor.entropy_coeff
    # (0.001 there) whatever the advantage estimator; aggregated like the policy loss (agg).
    entropy_coef: float = 0.0


def group_advantages(rewards, group_ids, scale: str = "std", eps: float = 1e-6, dialogue_ids=None):
    """[N] rewards -> [N] advantages, normalised within each group of the same scenario.

    A group of one has no baseline and gets 0. With `dialogue_ids` (per-turn samples: several
    rows per dialogue share its reward), the statistics are taken over dialogues, not rows, so
    long dialogues do not weigh more in the baseline."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    rewards = rewards.float()
    if dialogue_ids is not None:
        uniq, inv = torch.unique(dialogue_ids, return_inverse=True)
        first = torch.zeros(len(uniq), dtype=torch.long).scatter_(0, inv.flip(0), torch.arange(len(inv)).flip(0))
        return group_advantages(rewards[first], group_ids[first], scale, eps)[inv]
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        if r.numel() < 2:
            continue
        # All-equal rewards carry no signal: advantage exactly 0. Tested on the values, not on
        # the std: in float32 the mean of n equal values is not always that value (0.85 * 3),
        # so r - mean and std come out ~1e-8, and (r - mean) / std would be O(1) noise.
        if (r == r[0]).all():
            continue
        a = r - r.mean()
        adv[idx] = a / (r.std() + eps) if scale == "std" else a
    return adv


def aggregate(per_tok, mask, agg: str = "token-mean", token_denom=None, seq_denom=None):
    """[N, T] per-token values -> one scalar, by one of the three aggregations (see grpo_loss)."""
    mask = mask.float()
    if agg == "token-mean":
        return masked_mean(per_tok, mask, token_denom)
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        seq = (per_tok * mask).sum(1)
        if agg == "seq-mean-token-mean":
            seq = seq / mask.sum(1).clamp(min=1)
        n = seq_denom if seq_denom is not None else (mask.sum(1) > 0).sum()
        return seq.sum() / torch.as_tensor(n, dtype=seq.dtype).clamp(min=1)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, kl_coef=0.0,
              agg: str = "token-mean", token_denom=None, seq_denom=None):
    """Clipped surrogate (+ kl_coef * k3 KL to the reference) -> one scalar.

    agg: token-mean          sum over all tokens / number of tokens (DAPO, Dr. GRPO; long
                             answers are not down-weighted)
         seq-mean-token-mean mean over sequences of each sequence's token mean (the original
                             GRPO formula)
         seq-mean-token-sum  mean over sequences of each sequence's token sum
    token_denom / seq_denom: the minibatch's token / sequence counts when this call sees one
    micro-batch of it, so accumulated gradients equal the full-minibatch gradient."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    mask = mask.float()
    per_tok, clipped, _ = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps)
    kl = None
    if kl_coef and ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, "k3")
        per_tok = per_tok + kl_coef * kl
    loss = aggregate(per_tok, mask, agg, token_denom, seq_denom)
    with torch.no_grad():
        log_r = logprobs - old_logprobs
        stats = {"clipfrac": masked_mean(clipped, mask).item(), "approx_kl": masked_mean(0.5 * log_r ** 2, mask).item()}
        if kl is not None:
            stats["kl"] = masked_mean(kl, mask).item()
    return loss, stats


def grpo_update(policy, optimizer, batch, cfg: GRPOConfig, accelerator=None, generator=None) -> dict:
    """One GRPO update on a rollout Batch (old_logprobs may be None only when the update is one
    optimizer step: one epoch and one minibatch; ref_logprobs are needed when KL > 0)."""
    if len(batch) == 0:
        return {}
    check_old_logprobs(batch, cfg)
    dev = next(policy.parameters()).device
    per_turn = len(torch.unique(batch.dialogue_ids)) < len(batch)
    adv = group_advantages(batch.rewards, batch.group_ids, cfg.scale, cfg.eps,
                           batch.dialogue_ids if per_turn else None)
    mask = batch.loss_mask.float()
    stats = []
    for _ in range(cfg.epochs):
        for micro_list in minibatches(len(batch), cfg.minibatch_size, cfg.micro_batch_size, generator):
            rows = torch.cat(micro_list)
            # Token and sequence counts of the minibatch over ALL processes (ppo.global_counts).
            n_tok, n_seq = global_counts(accelerator, mask[rows].sum(), (mask[rows].sum(1) > 0).sum())
            micro = []
            for idx in micro_list:
                mb = batch.select(idx).to(dev)
                lp, ent = token_logprobs(policy, mb.input_ids, mb.attention_mask, cfg.temperature, return_entropy=True,
                                         entropy_grad=cfg.entropy_coef > 0,
                                         positions=mb.loss_mask)  # only the tokens the loss reads
                # No stored old log-probs: the update is on-policy (one epoch, one minibatch), so
                # pi_old = pi at this moment, i.e. the detached current log-probs (ratio = 1).
                old = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()
                loss, s = grpo_loss(lp, old, mb.ref_logprobs, adv[idx].to(dev), mb.loss_mask,
                                    cfg.clip_eps, cfg.kl_coef, cfg.agg, n_tok, n_seq)
                total = loss
                if cfg.entropy_coef:
                    total = loss - cfg.entropy_coef * aggregate(ent, mb.loss_mask, cfg.agg, n_tok, n_seq)
                backward(total, accelerator)
                micro.append({"policy_loss": loss.item(), "entropy": masked_mean(ent.detach(), mb.loss_mask.float()).item(), **s})
            stats.append(_minibatch_stats(micro, grad_norm=_step(policy, optimizer, cfg.max_grad_norm, accelerator)))
    out = _mean(stats)
    out["optimizer_steps"] = len(stats)
    out["advantage_abs_mean"] = adv.abs().mean().item()
    out["zero_adv_frac"] = (adv == 0).float().mean().item()
    return out
