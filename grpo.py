"""grpo.py - GRPO (Shao et al. 2024, DeepSeekMath Sec. 4), critic-free, in plain PyTorch.

RLVER (arXiv 2507.03112, Sec. 2.4) samples G = 4 dialogues per scenario. Instead of a learned
critic, GRPO uses the other members of the group as the baseline:

  1. group advantages  A_i = (R_i - mean(R_group)) / (std(R_group) + eps)    (group_advantages)
     (Dr. GRPO, Liu et al. 2025, drops the std scaling: scale="none")
  2. every policy token of sample i gets A_i
  3. the PPO clipped surrogate on the token ratios, optional KL to a reference model with the
     k3 estimator (the paper uses no KL), aggregated over tokens     (grpo_loss, aggregate)
     (+ the entropy bonus, as in PPO                                 (grpo_update))
  4. the update: update.update_loop (epochs x minibatches x micro-batches with exact
     gradient accumulation, one optimizer step per minibatch) with GRPO's loss  (grpo_update)

GRPO is PPO with another advantage, so the pieces both use (the clipped surrogate, the KL
estimators, the masked mean, the minibatch loop, the counts over several processes) are in
update.py, and log-probs in logprobs.py. To copy GRPO into other code, take grpo.py, update.py
and logprobs.py (they import only torch).

How this GRPO differs from others (verl's compute_grpo_outcome_advantage and dp_actor, TRL's
GRPOTrainer), each as the code below does it:

  1. A group of one gets advantage 0: with no other sample there is no baseline, so no signal.
     verl gives a one-sample group mean 0 and std 1, so that sample trains on its raw reward
     (R / (1 + eps)).
  2. The std is torch.std's unbiased (n - 1) estimate, as in verl (torch.std) and TRL (nanstd,
     with Bessel's correction).
  3. eps = 1e-6 in the denominator std + eps, as verl's default; TRL adds 1e-4.
  4. All-equal rewards give exactly 0: the rewards are compared, not the std (in float32 the
     mean of equal values can differ from them by ~1e-8, and (R - mean) / (std + eps) would
     then be noise). verl and TRL divide whatever R - mean comes out.
  5. Per-turn samples (several rows per dialogue, all carrying the dialogue's reward) use a
     dialogue-level baseline: the group's mean and std are taken over dialogues, not rows, so
     a long dialogue does not weigh more in its group's baseline.
  6. The entropy bonus is applied as verl's actor applies it, whatever the advantage
     estimator: loss -= entropy_coef * (the entropy aggregated like the policy loss: same agg,
     same counts). The original GRPO has none; the default here is 0.
  7. Loss aggregation: token-mean by default (verl's default loss_agg_mode; DAPO's, TRL's
     default loss_type "dapo"), with the original GRPO's seq-mean-token-mean and
     seq-mean-token-sum available (GRPOConfig.loss_agg). Dr. GRPO's constant normaliser (TRL's
     "dr_grpo") is not offered.
  8. The token and sequence counts that normalise the loss are the whole minibatch's over all
     processes (update.global_counts), so N processes take exactly the one-process step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from update import UpdateConfig, clipped_surrogate, kl_penalty, masked_mean, update_loop


@dataclass
class GRPOConfig(UpdateConfig):
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = field(
        default="token-mean", metadata={"help": "GRPO loss aggregation (grpo.aggregate)"})
    adv_scale: Literal["std", "none"] = field(default="std", metadata={
        "help": "GRPO advantage scaling: std (GRPO) | none (Dr. GRPO)"})


ADV_EPS = 1e-6  # (R - mean) / (std + eps), as verl's default


def group_advantages(rewards, group_ids, scale: str = "std", eps: float = 1e-6, dialogue_ids=None):
    """Rewards -> advantages, normalised within each group of the same scenario (DeepSeekMath's
    outcome supervision, https://arxiv.org/abs/2402.03300):

        A_i = (R_i - mean(R_g)) / (std(R_g) + eps)     scale="std"  (GRPO)
        A_i =  R_i - mean(R_g)                         scale="none" (Dr. GRPO,
                                                                     https://arxiv.org/abs/2503.20783)

    rewards: [N] one reward per row.  group_ids: [N] the group (scenario) of each row.
    dialogue_ids: [N] or None, the dialogue of each row (per-turn samples: several rows per
    dialogue, all carrying its reward); then the statistics are taken over dialogues, not rows,
    so long dialogues do not weigh more in the baseline.
    Returns [N] float32. A group of one has no baseline and gets 0; a group whose rewards are
    all equal gets exactly 0; std is the unbiased (n - 1) one."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    rewards = rewards.float()
    if dialogue_ids is not None:
        # One reward and group per dialogue (every row of a dialogue carries the same ones),
        # advantages over those, then each row gets its dialogue's advantage.
        # row_dialogue[i] = the index of row i's dialogue in `dialogues` (sorted ids).
        dialogues, row_dialogue = torch.unique(dialogue_ids, return_inverse=True)
        reward_of = rewards.new_zeros(len(dialogues)).scatter_(0, row_dialogue, rewards)
        group_of = group_ids.new_zeros(len(dialogues)).scatter_(0, row_dialogue, group_ids)
        per_dialogue = group_advantages(reward_of, group_of, scale, eps)
        return per_dialogue[row_dialogue]
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
        if scale == "std":
            a = a / (r.std() + eps)
        adv[idx] = a
    return adv


def aggregate(per_tok, mask, agg: str = "token-mean", token_denom=None, seq_denom=None):
    """Per-token values -> one scalar, by one of the three aggregations (see grpo_loss; verl's
    agg_loss offers these three, and one more).

    per_tok: [N, T].  mask: [N, T] loss mask.  token_denom / seq_denom: the token / sequence
    count to divide by instead of this call's own (see grpo_loss). Sequences with no policy
    token do not count. Returns a scalar tensor."""
    mask = mask.float()
    if agg == "token-mean":
        return masked_mean(per_tok, mask, token_denom)
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        seq = (per_tok * mask).sum(1)
        if agg == "seq-mean-token-mean":
            seq = seq / mask.sum(1).clamp(min=1)
        n = seq_denom
        if n is None:
            n = (mask.sum(1) > 0).sum()   # sequences with at least one policy token
        return seq.sum() / torch.as_tensor(n, dtype=seq.dtype).clamp(min=1)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, kl_coef=0.0,
              agg: str = "token-mean", token_denom=None, seq_denom=None, is_weights=None):
    """Clipped surrogate (+ kl_coef * k3 KL to the reference) -> one scalar:

        loss_t = max(-A r_t, -A clip(r_t, 1 - eps, 1 + eps)) + kl_coef * k3_t,  r_t = pi / pi_old

    (the GRPO objective of DeepSeekMath, with the KL in the loss as there, not in the reward;
    update.clipped_surrogate, update.kl_penalty.)
    logprobs: [N, T] current log-probs (with gradient).  old_logprobs: [N, T] at sampling time.
    ref_logprobs: [N, T] under the reference model, or None (no KL term).
    advantages: [N] one per row (broadcast to its tokens), or [N, T].  mask: [N, T] loss mask.
    Returns (scalar loss, stats): clipfrac, approx_kl = mean (log r)^2 / 2, and kl (the k3
    mean) when the KL term is on.

    agg: token-mean          sum over all tokens / number of tokens (DAPO; long answers are
                             not down-weighted)
         seq-mean-token-mean mean over sequences of each sequence's token mean (the original
                             GRPO formula)
         seq-mean-token-sum  mean over sequences of each sequence's token sum
    token_denom / seq_denom: the minibatch's token / sequence counts when this call sees one
    micro-batch of it, so accumulated gradients equal the full-minibatch gradient.
    is_weights: [N, T] truncated importance weights of the surrogate (update.truncated_is_weights)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    mask = mask.float()
    per_tok, clipped, _ = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps, is_weights)
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
    # 1-2: one advantage per dialogue, from its group's rewards (taken over dialogues, so with
    # per-turn samples a long dialogue does not weigh more in its group's baseline).
    adv = group_advantages(batch.rewards, batch.group_ids, cfg.adv_scale, ADV_EPS, batch.dialogue_ids)

    def micro_loss(mb, idx, lp, old_lp, ent, n_tok, n_seq, is_weights):
        # 3: the clipped surrogate (+ k3 KL), aggregated over the minibatch, and the entropy
        # bonus aggregated the same way (as verl's actor applies it).
        loss, s = grpo_loss(lp, old_lp, mb.ref_logprobs, adv[idx].to(lp.device), mb.loss_mask, cfg.clip_eps,
                            cfg.kl_coef, cfg.loss_agg, n_tok, n_seq, is_weights)
        total = loss
        if cfg.entropy_coef:
            total = loss - cfg.entropy_coef * aggregate(ent, mb.loss_mask, cfg.loss_agg, n_tok, n_seq)
        return total, {"policy_loss": loss.item(), **s}

    out = update_loop(batch, cfg, policy, {"grad_norm": (policy, optimizer)}, micro_loss, accelerator, generator)
    real = adv[batch.loss_mask.sum(1) > 0]  # not the padding rows (they have no token)
    out["advantage_abs_mean"] = real.abs().mean().item() if len(real) else 0.0
    out["zero_adv_frac"] = (real == 0).float().mean().item() if len(real) else 0.0
    return out
