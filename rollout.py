"""rollout.py - multi-turn dialogues between the policy and the simulated user -> a training Batch.

RLVER (arXiv 2507.03112, Sec. 2) optimises a policy over whole conversations: the agent speaks,
the simulated user appraises and answers (simulator.py), turn after turn until the dialogue
ends (success, failure, a goodbye, or the turn limit `--max-turns`: 4 by default, 3 in the
smollm2-cpu preset, 8 in the paper preset), and the final emotion / 100 is the reward of the whole dialogue (reward.py).
This file:

  1. builds the agent's system prompt, with or without the think-then-say scaffold (Sec. 3.2);
  2. plays B scenarios x G samples at once, in one of two ways: lock-step, each turn ONE
     batched `generate` over all active dialogues (left-padded, KV cache on), then ONE
     concurrent `Simulator.step_many` (`rollout`, Hugging Face generate); or each dialogue on its
     own, its next turn sampled as soon as its user has answered (`play_dialogue`, vLLM);
  3. keeps token ids exactly as sampled ("token-in, token-out"): the sequence we train on is the
     sequence we sampled, never a re-tokenisation of decoded text (re-tokenising drifts, e.g. a
     duplicated `<think>` or a missing "\n" after `<|im_end|>`). User turns are appended as the
     chat template renders them (a template "delta" after the sampled end-of-turn token);
  4. marks `loss_mask` = 1 exactly on the tokens the policy sampled (its end-of-turn token too),
     0 on system/user text and template headers, and returns the rows as a `Batch`.

Two ways to cut a dialogue into training samples:
  * default, one sequence per dialogue: the whole conversation is one row; the policy's later
    turns see its own earlier *thoughts* in context (the context is exactly what was sampled).
  * `per_turn_samples=True`, the paper's think-mode variant: every agent turn is its own row
    (prompt = the dialogue so far, response = that turn) and gets the dialogue's final reward.
    Only here can earlier thoughts be dropped from the context (`drop_thoughts`, as the paper
    does), because each row's prompt is rebuilt turn by turn.

The log-probs of the sampled tokens are computed later, by logprobs.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from reward import dialogue_reward, format_ok, spoken_reply

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
class RolloutConfig:
    max_new_tokens: int = field(default=24, metadata={"help": "tokens per agent turn at most"})
    max_total_tokens: int = field(default=4096, metadata={
        "help": "tokens per dialogue at most; a dialogue that would exceed it stops"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature, > 0 (old log-probs are those of softmax(logits / T))"})
    per_turn_samples: bool = field(default=False, metadata={
        "help": "each agent turn its own sample with the dialogue's reward (with --preset paper it follows "
                "--think)"})
    drop_thoughts: bool = field(default=True, metadata={
        "help": "per-turn mode: earlier thoughts dropped from the context"})
    shaping_coef: float = field(default=0.0, metadata={
        "help": "optional per-turn reward shaping (reward.py; not in the paper)"})
    format_rule: Literal["paper", "none"] = field(default="paper", metadata={
        "help": "paper: a turn that breaks the format zeroes the dialogue's reward (paper Sec. 2.3; with --think "
                "not <think>..</think> reply, without an empty reply or think tags: reward.format_ok) | none: no "
                "penalty; with --think the text after the last </think> (all of it when missing) reaches the "
                "user (the official RLVER code)"})


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
    sampler_logprobs: torch.Tensor | None = None  # [N, T] the generation engine's (vLLM), or None
    # The temperature the tokens were sampled at: every log-prob of them is taken at it (verl
    # passes it with the batch the same way). Greedy decoding has none: 1.
    temperature: float = 1.0
    metrics: list[dict] = field(default_factory=list)  # per dialogue (simulator_error ones too)

    def __len__(self):
        return self.input_ids.shape[0]

    def select(self, idx) -> "Batch":
        """Rows `idx` (a LongTensor or list), trimmed to their longest row: for minibatches."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        T = int(self.attention_mask[idx].sum(1).max()) if len(idx) else 0
        rows = {}
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if isinstance(x, torch.Tensor):  # metrics (per dialogue, not per row) are kept whole
                rows[f.name] = _take_rows(x, idx, T)
        return dataclasses.replace(self, **rows)

    def to(self, device) -> "Batch":
        moved = {}
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if isinstance(x, torch.Tensor):  # None (no log-probs yet) and metrics stay as they are
                moved[f.name] = x.to(device)
        return dataclasses.replace(self, **moved)


def _take_rows(x, idx, T: int):
    """Rows `idx` of a [N] or [N, T'] tensor, a 2-D one cut to its first T columns."""
    if x.dim() == 2:
        return x[idx][:, :T]
    return x[idx]


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


def sampling_settings(cfg: RolloutConfig) -> dict:
    """The complete sampling recipe of a turn: softmax(logits / T) when T > 0, argmax when T = 0.
    Every field that shapes the next-token distribution is set, to its neutral value: the old
    log-probs (and PPO/GRPO ratios) assume exactly this distribution. evaluate.py records it."""
    sample = cfg.temperature > 0
    return dict(do_sample=sample, temperature=cfg.temperature if sample else 1.0,
                top_k=0 if sample else None, top_p=1.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1)


def sampling_config(cfg: RolloutConfig, end_id: int, pad_id: int):
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
def generate_turn(policy, contexts: list[list[int]], cfg: RolloutConfig, end_id: int, pad_id: int, **generate_kwargs):
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
# One dialogue's tokens.
# --------------------------------------------------------------------------------------------
class Dialogue:
    """One dialogue as it grows, turn by turn (token-in, token-out): the context the policy
    sees (`ctx`, ids exactly as sampled), its loss mask, and what the reward and the training
    rows need. Both ways of playing (lock-step, `rollout`; each dialogue on its own,
    `play_dialogue`) grow it with the same two calls."""

    def __init__(self, index, group, state, system, tokenizer, think, cfg, end_id, user_turn):
        self.index, self.group, self.state, self.system = index, group, state, system
        self.tokenizer, self.think, self.cfg, self.end_id = tokenizer, think, cfg, end_id
        self.user_turn = user_turn  # shared cache: system prompt -> the user-turn template pieces
        self.ctx = prompt_ids(tokenizer, system, state.history[0]["content"]) if state.history else []
        self.mask = [0] * len(self.ctx)        # loss mask of ctx (one-sequence mode)
        self.sampler_lp = [0.0] * len(self.ctx)  # the engine's log-probs of what it sampled (vLLM), 0 elsewhere
        self.samples = []    # per-turn mode: (prompt ids, response ids, response sampler log-probs) per turn
        self.sampled_by_engine = False  # add_agent_turn got the engine's log-probs (vLLM)
        self.texts = []      # decoded agent turns, for the format check
        self.resp_lens = []
        self.stopped = None  # rollout-side stop reason ("max_tokens")

    def out_of_tokens(self) -> bool:
        """The token budget: a dialogue that cannot fit another full turn stops here."""
        if len(self.ctx) + self.cfg.max_new_tokens > self.cfg.max_total_tokens:
            self.stopped = "max_tokens"
        return self.stopped is not None

    def add_agent_turn(self, toks: list[int], logprobs: list[float] | None = None) -> str:
        """This turn's sampled ids (cut after the end-of-turn token) -> the reply the user sees."""
        self.sampled_by_engine |= logprobs is not None
        logprobs = logprobs or [0.0] * len(toks)
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        self.texts.append(text)
        self.resp_lens.append(len(toks))
        reply = spoken_reply(text, self.think, self.cfg.format_rule)
        if self.cfg.per_turn_samples:  # (one-sequence mode trains on ctx itself: no copy per turn)
            self.samples.append((list(self.ctx), list(toks), list(logprobs)))
        if self.cfg.per_turn_samples and self.cfg.drop_thoughts and self.think:
            # Later turns' prompts keep only the spoken reply (re-tokenised: it is context,
            # never trained on; this turn's sampled ids are already in `samples`).
            hist = self.tokenizer.encode(reply, add_special_tokens=False) + [self.end_id]
            self._extend(hist, 0)
        else:
            # The sampled ids, as sampled; a turn cut by max_new_tokens gets a forced
            # end-of-turn token that the policy did not sample (mask 0).
            self._extend(toks, 1, logprobs)
            if toks[-1] != self.end_id:
                self._extend([self.end_id], 0)
        # Only the spoken reply reaches the user; an empty one (the format check scores it 0)
        # still has to be answered, so the user sees "...".
        return reply or "..."

    def add_user_turn(self, state):
        """The simulator's new state; its answer, as the chat template renders it (a "delta")."""
        self.state = state
        if not state.done:
            if self.system not in self.user_turn:  # rendered once per system prompt, then reused
                self.user_turn[self.system] = _user_turn_template(self.tokenizer, self.system, self.end_id)
            delta = user_turn_ids(self.tokenizer, self.system, state.history[-1]["content"], self.end_id,
                                  template=self.user_turn[self.system])
            self._extend(delta, 0)

    def _extend(self, ids, mask_value, logprobs=None):
        self.ctx += ids
        self.mask += [mask_value] * len(ids)
        self.sampler_lp += logprobs if logprobs is not None else [0.0] * len(ids)


def start_dialogues(tokenizer, simulator, scenarios, group_size, think, cfg, system_prompt=None):
    """One simulator reset per scenario (the G samples of a group share the opening line), then
    group_size dialogues of each -> (dialogues, the start states)."""
    end_id = end_of_turn_id(tokenizer)  # ends an agent turn (Qwen: <|im_end|>)
    starts = simulator.reset_many(list(scenarios))
    dialogues, user_turn = [], {}
    for g, st in enumerate(starts):
        for _ in range(group_size):
            system = system_prompt(st.scenario.language) if system_prompt else build_system_prompt(
                think, st.scenario.language)
            state = dataclasses.replace(st, history=list(st.history), trace=list(st.trace))
            dialogues.append(Dialogue(len(dialogues), g, state, system, tokenizer, think, cfg, end_id, user_turn))
    return dialogues, starts


# --------------------------------------------------------------------------------------------
# Playing them: all together turn by turn (Hugging Face generate), or each on its own (vLLM).
# --------------------------------------------------------------------------------------------
def rollout(policy, tokenizer, simulator, scenarios, group_size: int = 1, think: bool = True,
            gen_cfg: RolloutConfig | None = None, progress=None, generate_kwargs: dict | None = None,
            any_active=None, system_prompt=None, engine=None, seed: int = 0) -> Batch:
    """Play len(scenarios) x group_size dialogues to the end and return a right-padded Batch.

    With `engine` (plumbing.engines.VLLMEngine) every dialogue plays on its own
    (`play_dialogue`): a dialogue's next turn is sampled as soon as its user has answered,
    while others are still generating or waiting for theirs; `seed` seeds each request.
    Without it, `policy.generate` plays all active dialogues together, one batched turn at a
    time (lock-step): each turn waits for the slowest generation and the slowest simulator call.

    Dialogues that end in `simulator_error` are reported in `metrics` (valid=False) and left out
    of the Batch rows: they carry no reward signal (never a reward of 0). `generate_kwargs` go
    to `generate` (train.py passes synced_gpus when it generates from the sharded FSDP model,
    --no-gather-for-generation). `any_active(has_work: bool) -> bool` (only for that sharded
    generation on several processes) says whether any process still has dialogues running: a
    process whose dialogues all ended keeps joining each turn's generate with a dummy prompt,
    since every sharded generate is a collective and a missing process would deadlock the
    others. `system_prompt(language) -> str` replaces the training prompt (evaluate.py
    --eval-prompt)."""
    cfg = gen_cfg or RolloutConfig()
    end_id = end_of_turn_id(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
    dialogues, starts = start_dialogues(tokenizer, simulator, scenarios, group_size, think, cfg, system_prompt)
    if engine is not None:
        engine.play(dialogues, play_dialogue, simulator, cfg, seed, progress)
        return to_batch(dialogues, starts, think, cfg, pad_id)

    active = [d for d in dialogues if not d.state.done]
    while True:
        active = [d for d in active if not d.out_of_tokens()]
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
        outs = generate_turn(policy, [d.ctx for d in active], cfg, end_id, pad_id, **(generate_kwargs or {}))
        replies = [d.add_agent_turn(toks) for d, toks in zip(active, outs)]
        for d, st in zip(active, simulator.step_many([d.state for d in active], replies)):
            d.add_user_turn(st)
        active = [d for d in active if not d.state.done]
        if progress is not None:
            progress(sum(d.state.done or d.stopped is not None for d in dialogues), len(dialogues))
    return to_batch(dialogues, starts, think, cfg, pad_id)


def play_dialogue(d: Dialogue, generate, simulator) -> Dialogue:
    """One dialogue's life, on its own: the agent samples a turn, the user appraises it and
    answers, until the dialogue ends. Nothing here waits for another dialogue: the engine
    batches the turns of all dialogues in flight (vLLM's continuous batching), and the
    simulator's calls of different dialogues overlap. `generate(ids, seed)` blocks until this
    turn is sampled -> (token ids, their log-probs)."""
    while not d.state.done and not d.out_of_tokens():
        toks, logprobs = generate(d.ctx, d.index * 1009 + len(d.texts))  # a seed per dialogue and turn
        reply = d.add_agent_turn(toks, logprobs)
        d.add_user_turn(simulator.step(d.state, reply))
    return d


def to_batch(dialogues, starts, think, cfg, pad_id) -> Batch:
    """Rewards, per-dialogue metrics and training rows -> a Batch."""
    rows, metrics = [], []
    for d in dialogues:
        st, i = d.state, d.index
        # A dialogue with no appraised turn (e.g. the token budget stopped it before the first
        # reply) has no score: its "final" emotion is only the initial one. Like a
        # simulator_error it is reported (valid=False) and left out of the loss and the means.
        valid = st.outcome != "simulator_error" and st.turn > 0
        r = dialogue_reward(st, d.texts, think, cfg.shaping_coef, cfg.format_rule) if valid else float("nan")
        violations = sum(not format_ok(t, think) for t in d.texts)
        metrics.append({"scenario_id": st.scenario.id, "group": d.group, "dialogue": i,
                        "outcome": st.outcome or d.stopped, "turns": st.turn, "emotion": st.emotion,
                        "emotion_trace": [starts[d.group].emotion] + [t["emotion_after"] for t in st.trace
                                                                      if "emotion_after" in t],
                        "format_violations": violations, "response_lengths": d.resp_lens,
                        "reward": r, "valid": valid, "agent_texts": d.texts, "history": st.history,
                        "goal_type": st.scenario.goal_type,
                        "error": st.trace[-1].get("error") if st.outcome == "simulator_error" else None})
        if not valid or not d.texts:
            continue
        if cfg.per_turn_samples:
            for p, resp, lps in d.samples:
                rows.append((p + resp, [0] * len(p) + [1] * len(resp), r, d.group, i, [0.0] * len(p) + lps))
        else:
            # End after the last agent turn: a dangling user turn (token-budget stop) is not
            # trained on; a forced end-of-turn token right after it is kept (mask 0).
            end = max(k for k, m in enumerate(d.mask) if m) + 1
            if end < len(d.ctx) and d.ctx[end] == d.end_id:
                end += 1
            rows.append((d.ctx[:end], d.mask[:end], r, d.group, i, d.sampler_lp[:end]))
    # Greedy decoding (temperature 0, evaluation) has no distribution to divide by: log-probs of
    # its tokens are plain ones (T = 1).
    return collate(rows, pad_id, metrics, temperature=cfg.temperature or 1.0,
                   sampled_by_engine=any(d.sampled_by_engine for d in dialogues))


def collate(rows, pad_id, metrics=None, temperature: float = 1.0, sampled_by_engine: bool = False) -> Batch:
    """[(ids, loss_mask, reward, group, dialogue[, sampler log-probs])] -> a right-padded Batch.
    With `sampled_by_engine` the sampler's log-probs (the generation engine's, vLLM) become
    `sampler_logprobs`; the Hugging Face path samples without keeping them (None)."""
    N, T = len(rows), max((len(r[0]) for r in rows), default=0)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    am, lm = torch.zeros((N, T), dtype=torch.long), torch.zeros((N, T), dtype=torch.long)
    slp = torch.zeros((N, T), dtype=torch.float32)
    for n, (x, m, _reward, _group, _dialogue, *sampler_lp) in enumerate(rows):
        ids[n, :len(x)] = torch.tensor(x)
        am[n, :len(x)] = 1
        lm[n, :len(m)] = torch.tensor(m)
        if sampled_by_engine and sampler_lp:
            slp[n, :len(sampler_lp[0])] = torch.tensor(sampler_lp[0], dtype=torch.float32)
    return Batch(input_ids=ids, attention_mask=am, loss_mask=lm,
                 rewards=torch.tensor([r[2] for r in rows], dtype=torch.float32),
                 group_ids=torch.tensor([r[3] for r in rows], dtype=torch.long),
                 dialogue_ids=torch.tensor([r[4] for r in rows], dtype=torch.long), temperature=temperature,
                 sampler_logprobs=slp if sampled_by_engine else None, metrics=metrics or [])
