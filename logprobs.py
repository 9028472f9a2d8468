"""logprobs.py - log pi(token | earlier tokens) of the sampled tokens, without the full logits.

Every policy-gradient loss here (ppo.py, grpo.py) needs, for each token the policy sampled, its
log-probability under the current policy (and, before the update, under the policy that sampled
it: pi_old; under a reference model when a KL term is on). This file computes them:

  token_logprobs   log-probs (and entropies) of given token ids, aligned to input positions
  add_logprobs     the old-policy (and reference) log-probs of a rollout batch, once per step

Position convention, shared by every [N, T] tensor of the project: position t holds token x_t,
logprobs[t] = log pi(x_t | x_<t), 0 at t = 0, at padding and at positions not asked for.
Logits are divided by the sampling temperature: these are the log-probs of the distribution the
rollout actually sampled from, softmax(logits / T).

Imports only torch: ppo.py and grpo.py depend on this file, not on the rollout.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# Log-probs of given tokens, aligned to input positions, without ever holding the full logits.
#
# The logits tensor is rows x length x vocab (Qwen: 151,936 columns): for one 8k-token row of a
# 7B model that is 1.2 G values, 5 GB in float32, and a plain `model(...).logits` keeps it (and
# a log-softmax of the same size) alive until the backward pass. Log-probs only need two numbers
# per position, logit[token] and logsumexp(logits), so we take them from the final hidden
# states chunk by chunk: a chunk of positions goes through the LM head, gives its two numbers
# (and the entropy), and its logits are dropped at once. The backward pass recomputes each
# chunk's logits (one matmul) instead of storing them.
#
# How the recomputation is done: a small custom autograd.Function (_ChunkedLogprobs), not
# torch.utils.checkpoint per chunk. Both save only the hidden states and recompute, but with
# checkpointing autograd differentiates the chunk's ops one by one, so every chunk produces a
# fresh vocab x hidden gradient for the LM head weight (544 MB at 0.5B, 2 GB at 7B in fp32) and
# a full-size softmax gradient; the gradients are then summed out of place. Written by hand,
# the backward of logp = z[y] - logsumexp(z) is just (onehot(y) - softmax(z)) * grad, so each
# chunk needs one [chunk, vocab] buffer, and the weight gradient is accumulated in place into
# one buffer (`addmm_`). That is what keeps the update's memory and time down (see
# docs/PERFORMANCE.md).
# --------------------------------------------------------------------------------------------
LOGIT_CHUNK_ELEMS = 2 ** 25  # logits per chunk (32 M floats = 128 MB in fp32): ~220 positions of Qwen's vocab


def _compute_dtype(x, weight):
    """The dtype the LM head's matmul runs in: autocast's (accelerate's mixed precision), else the weight's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype


def _chunk_logits(h, w, b, temperature: float):
    """One chunk's logits / temperature in float32 (the matmul in the compute dtype of w)."""
    z = F.linear(h.to(w.dtype), w, b).float()
    if temperature != 1.0:
        z /= temperature
    return z


def _cast_head(weight, bias, dtype):
    """The LM head's weight and bias (None: the head has none) in the compute dtype."""
    if bias is None:
        return weight.to(dtype), None
    return weight.to(dtype), bias.to(dtype)


class _ChunkedLogprobs(torch.autograd.Function):
    """h [M, H] final hidden states, targets [M] -> (logp [M], entropy [M]) of the tokens under
    softmax((h @ W.T + b) / temperature), in float32, chunk positions at a time."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, chunk, want_entropy, entropy_grad):
        cd = _compute_dtype(h, weight)
        w, b = _cast_head(weight, bias, cd)  # cast once, not per chunk
        lps, lses, ents = [], [], []
        for s in range(0, h.shape[0], chunk):
            z = _chunk_logits(h[s:s + chunk], w, b, temperature)
            lse = torch.logsumexp(z, dim=-1)
            lps.append(z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse)
            lses.append(lse)
            if want_entropy:  # H = logsumexp(z) - sum_j p_j z_j
                ents.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
            del z
        empty = h.new_zeros(0, dtype=torch.float32)  # a row with no wanted position (e.g. a padding row)
        lp, lse = torch.cat(lps or [empty]), torch.cat(lses or [empty])
        ent = torch.cat(ents or [empty]) if want_entropy else empty
        ctx.save_for_backward(h, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.cd = temperature, chunk, cd
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, bias, targets, lse, ent = ctx.saved_tensors
        cd, temperature = ctx.cd, ctx.temperature
        w, b = _cast_head(weight, bias, cd)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(h) if need_h else None
        # The head's weight and bias gradients are sums over every chunk: ONE float32 buffer
        # each, accumulated in place and cast to the parameter's dtype once at the end. (In a
        # bf16 buffer every chunk's addition would round: ~37 times per 8k-token micro-batch
        # of a 7B model.)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        rows = h.shape[0] if g_lp is not None or g_ent is not None else 0  # no output in the loss: zeros
        for s in range(0, rows, ctx.chunk):
            e = slice(s, s + ctx.chunk)
            z = _chunk_logits(h[e], w, b, temperature)
            p = (z - lse[e, None]).exp_()  # softmax, from the saved logsumexp
            # d logp / dz = onehot(y) - p
            if g_lp is not None:
                g = p * (-g_lp[e, None])
                g.scatter_add_(-1, targets[e, None], g_lp[e, None])
            else:
                g = torch.zeros_like(p)
            # d H / dz_j = -p_j (z_j - E_p[z]),  E_p[z] = logsumexp - H. Written in place into
            # z (a [chunk, vocab] buffer) so that no second buffer of that size is made.
            if g_ent is not None:
                z -= (lse[e] - ent[e])[:, None]  # z_j - E_p[z]
                z *= p
                z *= g_ent[e, None]
                g -= z
            del z, p
            if temperature != 1.0:  # z = logits / temperature
                g = g / temperature
            if need_w:  # summed in float32 (grad_w); each chunk's product in the compute dtype
                if cd == torch.float32:
                    grad_w.addmm_(g.t(), h[e].float())
                else:  # bf16 in, on the GPU's tensor cores (a float32 matmul of the vocab x hidden
                    grad_w += g.t().to(cd) @ h[e].to(cd)  # head would cost ~25% of a 7B step)
            if need_b:
                grad_b += g.sum(0)
            if need_h:
                grad_h[e] = (g.to(cd) @ w).to(h.dtype)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


class _LogprobHead(torch.nn.Module):
    """Stands in for the model's LM head during one forward call: receives the final hidden
    states [B, T, H] and returns [B, T, 2] = (log-prob, entropy) per position instead of logits."""

    def __init__(self, head, input_ids, positions, temperature, chunk, want_entropy, entropy_grad):
        super().__init__()
        self.head = head
        self.args = (input_ids, positions, temperature, chunk, want_entropy, entropy_grad)

    def forward(self, hidden):
        input_ids, positions, temperature, chunk, want_entropy, entropy_grad = self.args
        sel = positions[:, 1:]  # the hidden state at t-1 predicts the token at t
        h = hidden[:, :-1][sel]
        lp, ent = _ChunkedLogprobs.apply(h, self.head.weight, self.head.bias, input_ids[:, 1:][sel],
                                         temperature, chunk, want_entropy, entropy_grad)
        vals = torch.stack([lp, ent if want_entropy else torch.zeros_like(lp)], -1)
        out = vals.new_zeros(*sel.shape, 2)  # 0 at every position not asked for
        out[sel] = vals
        return F.pad(out, (0, 0, 1, 0))  # position 0 has no log-prob


def micro_batches(attention_mask, micro_batch: int | None = None):
    """How a pass over many rows groups them: [(row indices, width)], at most `micro_batch` rows
    each, the longest rows first and rows of similar length together, each group cut to its own
    longest row (rows are right-padded). A batch of per-turn rows runs from 0.5k to 8k tokens
    in the paper preset: at the batch's full width most of the pass would be padding."""
    lengths = attention_mask.sum(1)
    if not micro_batch or micro_batch >= len(lengths):  # one pass over all rows, in their order
        return [(torch.arange(len(lengths)), max(1, int(lengths.max())))] if len(lengths) else []
    order = torch.argsort(lengths, descending=True, stable=True)
    return [(order[s:s + micro_batch], max(1, int(lengths[order[s]]))) for s in range(0, len(order), micro_batch)]


def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0,
                   micro_batch: int | None = None, return_entropy: bool = False, entropy_grad: bool = False,
                   positions=None, chunk_size: int | None = None, plan=None):
    """Log-probs of the given tokens under the model, aligned to input positions.

    input_ids [N, T] (token ids), attention_mask [N, T] (1 = real token, 0 = padding),
    positions [N, T] or None (1 = compute this position, e.g. the loss mask; None = every real
    token; only these positions go through the LM head). Returns logprobs [N, T] float32 with

        logprobs[n, t] = log pi(input_ids[n, t] | input_ids[n, <t])   for t >= 1,

    i.e. the log-prob of the token AT position t, taken from the logits at position t - 1.
    It is 0 at t = 0 (nothing predicts the first token), at padding and at positions not asked
    for. With return_entropy=True: (logprobs, entropy), entropy [N, T] float32 being the
    entropy of that same next-token distribution (the one that produced token t), 0 at the
    same positions as logprobs.

    Computed from the final hidden states in chunks of `chunk_size` positions (default: about
    LOGIT_CHUNK_ELEMS logits per chunk), in float32, never holding the [rows, length, vocab]
    logits (see above). Logits are divided by the sampling temperature so these are the
    log-probs of the distribution we actually sampled from. Rows go through the model
    `micro_batch` at a time, grouped by length and each group cut to its longest row
    (`micro_batches`; `plan` gives other groups). Differentiable; the same call serves old/ref log-probs (under
    no_grad) and the update. The entropy (return_entropy) carries gradient only with
    entropy_grad (PPO's entropy bonus); as a statistic it builds no graph.

    How we reach the hidden states and the LM head: we call the model's own forward, with its
    LM head swapped for _LogprobHead for the duration of the call. HF causal LMs end their
    forward with `logits = self.lm_head(final_norm(hidden))`, so our head gets exactly the
    normed hidden states and its output comes back as `.logits`. Two alternatives are worse:
    `model(..., output_hidden_states=True)` returns every layer's hidden states (25 x [T, H] at
    0.5B, kept alive together) and leaves the head to be applied outside the forward; and
    calling `model.model(...)` and `model.lm_head.weight` directly skips the top-level module's
    forward, which is where FSDP2 (fully_shard) gathers the root's parameters (embedding, final
    norm, LM head) and hooks its backward: outside it `lm_head.weight` is a shard. Inside the
    swapped-in head the forward is the model's own, so DDP (`model.module`) and FSDP2 hooks run
    as usual. (Assumes the LM head's weight is gathered when our head runs: true when it belongs
    to the root unit, or, as accelerate 1.16 wraps it, to one unit with the final norm, whose
    forward gathers it; an LM head wrapped alone, with no forward of its own, would not be.)"""
    N, T = input_ids.shape
    micro_batch = micro_batch or N
    inner = getattr(model, "module", model)  # DDP wraps the HF model in .module
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or getattr(inner.config, "final_logit_softcapping", None):
        raise TypeError(f"token_logprobs needs a causal LM whose forward ends in a linear lm_head, "
                        f"got {type(inner).__name__}")
    want = attention_mask.bool() if positions is None else attention_mask.bool() & positions.bool()
    chunk = chunk_size or max(1, LOGIT_CHUNK_ELEMS // head.out_features)
    out = torch.zeros(N, T, 2, dtype=torch.float32, device=input_ids.device)
    try:
        for idx, width in plan or micro_batches(attention_mask, micro_batch):
            ids = input_ids[idx, :width]
            inner.set_output_embeddings(_LogprobHead(head, ids, want[idx, :width], temperature, chunk,
                                                     return_entropy, entropy_grad and torch.is_grad_enabled()))
            out[idx, :width] = model(input_ids=ids, attention_mask=attention_mask[idx, :width], use_cache=False).logits
    finally:
        inner.set_output_embeddings(head)
    logprobs = out[..., 0]
    if not return_entropy:
        return logprobs
    entropy = out[..., 1]
    if not entropy_grad:  # a statistic: no graph behind it
        entropy = entropy.detach()
    return logprobs, entropy


@torch.no_grad()
def add_logprobs(batch, policy, ref_model=None, micro_batch: int = 8, old: bool = True):
    """Old-policy (and reference) log-probs of a rollout batch's sampled tokens, computed once
    before the update, only where the loss mask is 1 (0 elsewhere: nothing reads them there),
    at the temperature the batch was sampled at (`batch.temperature`).
    old=False skips the policy pass (an update of one optimizer step needs no stored pi_old).
    Returns the batch with `old_logprobs` / `ref_logprobs` [N, T] on the CPU (None: not computed)."""
    dev = next(policy.parameters()).device
    ids, am, lm = batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.loss_mask.to(dev)
    old_lp = None
    if old:
        old_lp = token_logprobs(policy, ids, am, batch.temperature, micro_batch, positions=lm).cpu()
    ref_lp = None
    if ref_model is not None:
        rdev = next(ref_model.parameters()).device
        ref_lp = token_logprobs(ref_model, ids.to(rdev), am.to(rdev), batch.temperature, micro_batch,
                                positions=lm.to(rdev)).cpu()
    return dataclasses.replace(batch, old_logprobs=old_lp, ref_logprobs=ref_lp)

