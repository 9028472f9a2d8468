"""update.py - what the PPO and GRPO updates share: the clipped surrogate and its loop.

PPO (ppo.py) and GRPO (grpo.py) differ in two places only: how each token's advantage is
computed (a learned critic and GAE, or the group's rewards) and the loss built on it. Everything
else is this file, in the order an update runs:

  0. the settings both take                          (UpdateConfig)
  1. masked statistics: every sum and mean over tokens goes through the loss mask
                                                     (masked_sum, masked_mean)
  2. the clipped surrogate, and the KL estimators    (clipped_surrogate; kl_penalty)
  3. how many optimizer steps a rollout makes        (minibatch_count, needs_old_logprobs).
     With one (one epoch, one minibatch: both CPU presets), pi_old is the policy itself, the
     ratio is exactly 1 and the clip never acts; it acts from a rollout's second step on
     (--minibatch-size below the step's scenarios, --epochs > 1, per-turn rows past a minibatch)
  4. epochs x shuffled minibatches x micro-batches with exact gradient accumulation, one
     optimizer step per minibatch; the algorithm supplies the loss (update_loop)

What several processes need (every count summed over all of them) is fenced off at the end:
all_sum, global_counts, backward. With one process the sums are the identity.

The batch is any object with the rollout Batch's fields (rollout.py): input_ids, attention_mask,
loss_mask [N, T], rewards, group_ids, dialogue_ids [N], old_logprobs / ref_logprobs [N, T] or
None, temperature, and select(rows) / to(device). Position t of every [N, T] tensor is token x_t
(logprobs.py's convention); loss_mask[t] = 1 when the policy sampled x_t.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from logprobs import token_logprobs


# --------------------------------------------------------------------------------------------
# 0. Settings. train.Config inherits every field (through PPOConfig and GRPOConfig): each is
# declared once, and each is one flag of train.py (underscores -> dashes).
# --------------------------------------------------------------------------------------------
@dataclass
class UpdateConfig:
    clip_eps: float = field(default=0.2, metadata={"help": "PPO/GRPO ratio clip: r in [1 - eps, 1 + eps]"})
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus (paper preset: 1e-3, for PPO and GRPO)"})
    kl_coef: float = field(default=0.0, metadata={"help": "KL to the initial policy (paper: 0, no reference model "
                                                          "loaded)"})
    epochs: int = field(default=1, metadata={"help": "passes over each step's rollout"})
    group_size: int = field(default=1, metadata={"help": "dialogues per scenario (train.py sets it by --algo: "
                                                         "ALGO_DEFAULTS)"})
    minibatch_size: int = field(default=32, metadata={
        "help": "scenarios per optimizer step, all processes together: a minibatch is minibatch_size x "
                "group_size rows (the official ppo_mini_batch_size: 32 prompts x n samples); a row is a "
                "dialogue, or one agent turn with --per-turn-samples"})
    micro_batch_size: int = field(default=8, metadata={"help": "rows per forward/backward (gradient accumulation)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    rollout_is_cap: float = field(default=0.0, metadata={
        "help": "truncated importance sampling (verl, TRL): each token's policy loss weighted by "
                "min(pi_old / pi_sampler, C), C this cap, where a generation engine (vLLM) sampled the tokens; "
                "0: off"})


# --------------------------------------------------------------------------------------------
# 1. Masked statistics. User/system tokens and padding never count. An all-zero mask gives 0.
# --------------------------------------------------------------------------------------------
def masked_sum(x, mask):
    return (x * mask).sum()


def masked_mean(x, mask, denom=None):
    """Mean of x over mask; `denom` overrides the count (micro-batches of one minibatch divide
    by the minibatch's token count, so accumulated gradients equal the full-batch gradient)."""
    d = mask.sum() if denom is None else torch.as_tensor(denom, dtype=x.dtype, device=x.device)
    return masked_sum(x, mask) / d.clamp(min=1)


# --------------------------------------------------------------------------------------------
# 2. The clipped surrogate (Schulman et al. 2017) and the KL estimators (Schulman 2020).
# --------------------------------------------------------------------------------------------
def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps, is_weights=None):
    """Per-token PPO objective as a loss: max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi/pi_old
    (Schulman et al. 2017, eq. 7, https://arxiv.org/abs/1707.06347).
    Taking the max of the two losses (min of the objectives) removes the incentive to move the
    ratio outside [1-eps, 1+eps]: there the gradient is exactly 0.

    logprobs, old_logprobs: [N, T].  advantages: [N, T], or [N, 1] (one per row, broadcast).
    is_weights: [N, T] or None, truncated importance weights that multiply each token's loss
    (truncated_is_weights). Returns (per-token loss [N, T], clipped [N, T] 1.0 where the clipped
    term won, ratio [N, T])."""
    ratio = torch.exp(logprobs - old_logprobs)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_tok = torch.maximum(l1, l2)
    if is_weights is not None:
        per_tok = per_tok * is_weights
    return per_tok, (l2 > l1).float(), ratio


def truncated_is_weights(old_logprobs, sampler_logprobs, cap: float):
    """Truncated importance sampling (verl's and TRL's TIS): the tokens were sampled by another
    engine (vLLM), whose probabilities differ slightly from the trainer's pi_old (other kernels,
    precision); weighting each token by min(pi_old / pi_sampler, cap) corrects the gradient for
    it, and the cap bounds the variance. No gradient flows through the weights.
    old_logprobs, sampler_logprobs: [N, T]. Returns [N, T]."""
    return torch.exp(old_logprobs - sampler_logprobs).clamp(max=cap).detach()


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


# --------------------------------------------------------------------------------------------
# 3. Optimizer steps per rollout. `minibatch_size` counts scenarios of the whole step, as the
# official ppo_mini_batch_size does (verl multiplies it by n): a minibatch is
# minibatch_size x group_size rows over all processes. A row is a dialogue, or one agent turn
# with per-turn samples (the official think mode), where a rollout then makes about one
# optimizer step per turn, as the official code does. Every process cuts its rows into the
# same number of minibatches, agreed on with one all-reduce of the row count.
# --------------------------------------------------------------------------------------------
def minibatch_count(batch, cfg: UpdateConfig, accelerator=None) -> int:
    """Minibatches (optimizer steps) per epoch: the step's rows over all processes / rows per
    minibatch, rounded up. Every process holds as many rows (plumbing.distributed.pad_rows) and
    cuts them into this many nearly equal minibatches (`minibatches`), so the count is exact
    however the rows fall on the processes; at most one minibatch per row."""
    real_rows = (batch.loss_mask.sum(1) > 0).sum().float()  # padding rows (plumbing.distributed.pad_rows) have no token
    total_rows = all_sum(real_rows, accelerator).item()
    return max(1, min(len(batch), math.ceil(total_rows / (cfg.minibatch_size * cfg.group_size))))


def needs_old_logprobs(batch, cfg: UpdateConfig, accelerator=None) -> bool:
    """Does the update take more than one optimizer step (several epochs or minibatches)? Then
    every step after the first sees a policy that has moved since sampling, and the ratio needs
    the rollout's stored old log-probs. With exactly one step, pi_old is the current policy and
    its detached log-probs serve (ratio 1, one forward pass fewer)."""
    return cfg.epochs > 1 or minibatch_count(batch, cfg, accelerator) > 1


def check_old_logprobs(batch, cfg: UpdateConfig, accelerator=None):
    """The on-policy shortcut (old_logprobs=None) is only right for a single optimizer step;
    anywhere else it would silently train with ratio 1 after the policy moved: refuse."""
    if batch.old_logprobs is None and needs_old_logprobs(batch, cfg, accelerator):
        raise ValueError(f"old_logprobs=None is only valid for one optimizer step per update, but this one "
                         f"takes {cfg.epochs} epoch(s) x {minibatch_count(batch, cfg, accelerator)} minibatch(es) "
                         f"({len(batch)} rows): compute the rollout's old log-probs first (logprobs.add_logprobs)")


# --------------------------------------------------------------------------------------------
# 4. The loop.
# --------------------------------------------------------------------------------------------
def update_loop(batch, cfg: UpdateConfig, policy, models, micro_loss, accelerator=None, generator=None) -> dict:
    """epochs x shuffled minibatches x micro-batches; one optimizer step per minibatch for each
    (model, optimizer) in `models` (the policy's first; PPO adds its critic's).

    For each micro-batch `mb` (rows `idx` of the batch) the policy's log-probs and entropies of
    the sampled tokens are computed here, and the algorithm's loss is
        micro_loss(mb, idx, logprobs, old_logprobs, entropy, n_tok, n_seq, is_weights) -> (loss, stats)
    where n_tok / n_seq are the minibatch's token / sequence counts over all processes: dividing
    by them makes the accumulated gradient exactly the whole minibatch's gradient; is_weights
    the truncated importance weights (cfg.rollout_is_cap > 0 and an engine's log-probs), or None.
    Returns the mean of the minibatches' stats, with `optimizer_steps`.

    With no stored old log-probs (one optimizer step), `out["pi_old"]` holds the detached
    log-probs this update took as pi_old ([N, T], on the CPU; the batch is not changed): what
    reads pi_old after the update (train.py's sampler mismatch) needs no forward pass of its own."""
    check_old_logprobs(batch, cfg, accelerator)
    dev = next(policy.parameters()).device
    seen = torch.zeros(batch.loss_mask.shape) if batch.old_logprobs is None else None  # pi_old, as taken
    entropy_grad = cfg.entropy_coef > 0
    stats = []
    for _ in range(cfg.epochs):
        for micro_list in minibatches(len(batch), minibatch_count(batch, cfg, accelerator), cfg.micro_batch_size,
                                      generator):
            mask = batch.loss_mask[torch.cat(micro_list)].float()
            n_tok, n_seq = global_counts(accelerator, mask.sum(), (mask.sum(1) > 0).sum())
            micro = []
            for idx in micro_list:
                mb = batch.select(idx).to(dev)
                lp, ent = token_logprobs(policy, mb.input_ids, mb.attention_mask, mb.temperature, return_entropy=True,
                                         entropy_grad=entropy_grad, positions=mb.loss_mask)  # only where the loss reads
                # No stored old log-probs: the update is one optimizer step, so pi_old = pi at
                # this moment, i.e. the detached current log-probs (ratio 1).
                old_lp = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()
                if seen is not None:
                    seen[idx, :old_lp.shape[1]] = old_lp.float().cpu()
                is_weights = None
                if cfg.rollout_is_cap and mb.sampler_logprobs is not None:
                    is_weights = truncated_is_weights(old_lp, mb.sampler_logprobs, cfg.rollout_is_cap)
                loss, s = micro_loss(mb, idx, lp, old_lp, ent, n_tok, n_seq, is_weights)
                backward(loss, accelerator)
                micro.append({**s, "entropy": masked_mean(ent.detach(), mb.loss_mask.float()).item(),
                              "tokens": mb.loss_mask.sum().item()})
            grad_norms = {}
            for name, (model, optimizer) in models.items():
                grad_norms[name] = optimizer_step(model, optimizer, cfg.max_grad_norm, accelerator)
            stats.append(minibatch_stats(micro, **grad_norms))
    out = mean_stats(stats)
    out["optimizer_steps"] = len(stats)
    if seen is not None:
        out["pi_old"] = seen
    return out


def minibatches(n_rows, n_minibatches, micro_batch_size, generator=None):
    """Shuffled rows -> [[micro-batch row indices, ...] per minibatch]: `n_minibatches` of
    nearly equal size (sizes differ by at most one row)."""
    perm = torch.randperm(n_rows, generator=generator)
    for mb in torch.tensor_split(perm, n_minibatches):
        yield [mb[k:k + micro_batch_size] for k in range(0, len(mb), micro_batch_size)]


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
    the minibatch's count); the rest (entropy, clip fraction, KL) are means over the policy's
    tokens, so a micro-batch of padding rows (no token) counts for nothing. `extra` (e.g.
    grad_norm) is added."""
    weights = [m["tokens"] for m in micro]
    out = {}
    for k in micro[0]:
        if k == "tokens":
            continue
        if k.endswith("_loss"):
            out[k] = sum(m[k] for m in micro)
        else:
            out[k] = sum(m[k] * w for m, w in zip(micro, weights)) / max(sum(weights), 1)
    return {**out, **extra}


# ============================================================================================
# Plumbing, not the algorithm: several processes. Each process holds a slice of the step's
# batch; these make every count above the whole step's, so N processes compute the
# one-process update. With one process (or no accelerator) every sum is the identity.
# ============================================================================================
def all_sum(x, accelerator=None):
    """Sum of a tensor over all processes (identity with one process)."""
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
