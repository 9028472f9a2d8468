import json

import pytest
import torch

from logprobs import add_logprobs, token_logprobs
from plumbing.logs import rollout_stats
from plumbing.models import make_tiny_policy, make_tiny_tokenizer
from reward import split_think
from rollout import RolloutConfig as GenConfig
from rollout import build_system_prompt, rollout, user_turn_ids
from rule_user import RuleBackend
from simulator import Scenario, Simulator

SC = [Scenario(id=f"s{i}", persona="p", background="Lost a job.", hidden_goal="g", goal_type="empathy",
               first_message=f"I feel awful {i}.", personality_type="passive") for i in range(3)]

# Qwen2.5-Instruct's chat template (tool branches omitted), with {% generation %} markers added
# around what the assistant produces, so transformers can return the assistant-token mask.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}"
    "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_policy(seed=0)


class ScriptedPolicy:
    """Stands in for a model: `generate` emits fixed texts (as ids) per call, so a test knows
    exactly what was 'sampled'. Records what it returned."""
    device = torch.device("cpu")

    def __init__(self, tok, texts, truncate_at=None):
        self.tok, self.texts, self.returned, self.truncate_at = tok, texts, [], truncate_at

    def generate(self, input_ids, attention_mask, generation_config):
        eos, pad = generation_config.eos_token_id, generation_config.pad_token_id
        rows = []
        for b in range(input_ids.shape[0]):
            text = self.texts[len(self.returned) % len(self.texts)]
            ids = self.tok.encode(text, add_special_tokens=False) + [eos]
            ids = ids[:generation_config.max_new_tokens]
            self.returned.append(ids)
            rows.append(ids)
        W = max(map(len, rows))
        new = torch.tensor([r + [pad] * (W - len(r)) for r in rows])
        return torch.cat([input_ids, new], 1)


def sim(max_turns=3, **kw):
    return Simulator(RuleBackend(seed=1), initial_emotion=40, max_turns=max_turns, **kw)


def spans(mask_row):
    """[(start, end)] of runs of 1s."""
    out, start = [], None
    for k, m in enumerate(mask_row + [0]):
        if m and start is None:
            start = k
        if not m and start is not None:
            out.append((start, k))
            start = None
    return out


def test_stored_policy_ids_equal_generated_ids(tiny):
    model, tok = tiny
    returned = []
    orig = model.generate
    def rec(**kw):
        out = orig(**kw)
        L = kw["input_ids"].shape[1]
        for row in out[:, L:].tolist():
            returned.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
        return out
    model.generate = rec
    try:
        torch.manual_seed(0)
        b = rollout(model, tok, sim(), SC, group_size=2, think=False,
                    gen_cfg=GenConfig(max_new_tokens=24))
    finally:
        del model.generate
    assert len(b) == 6
    # Turn k of dialogue d was row d of the k-th generate call among still-active dialogues;
    # all dialogues run the full 3 turns here (no success/failure with the rule user).
    per_dialogue = [[] for _ in range(6)]
    for k, ids in enumerate(returned):
        per_dialogue[k % 6].append(ids)
    for d in range(6):
        row = b.input_ids[d].tolist()
        got = []
        for s, e in spans(b.loss_mask[d].tolist()):
            got.append(row[s:e])
        want = per_dialogue[d]
        # A turn cut at max_new_tokens has no sampled end token; the stored span is the same ids.
        assert got == want


@pytest.mark.parametrize("template", ["tiny", "qwen2.5"])
def test_loss_mask_matches_chat_template_assistant_mask(tiny, template):
    _, tok = tiny
    if template == "qwen2.5":
        tok = make_tiny_tokenizer()  # a fresh one: keep the fixture's tokenizer intact
        tok.chat_template = QWEN25_TEMPLATE
    policy = ScriptedPolicy(tok, ["That sounds hard.", "I hear you. What happened?", "You did well, honestly."])
    b = rollout(policy, tok, sim(), SC[:2], group_size=2, think=False,
                gen_cfg=GenConfig(max_new_tokens=64))
    for d, m in enumerate(b.metrics):
        msgs = [{"role": "system", "content": build_system_prompt(False)}] + m["history"]
        while msgs[-1]["role"] != "assistant":
            msgs.pop()  # the user's last line is not part of the trained sequence
        enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        n = int(b.attention_mask[d].sum())
        ids = enc["input_ids"]
        # The template renders "\n" after the final <|im_end|>; our row ends at the sampled token.
        assert b.input_ids[d, :n].tolist() == ids[:n] and ids[n:] == tok.encode("\n")
        assert b.loss_mask[d, :n].tolist() == enc["assistant_masks"][:n]


def test_truncated_turn_gets_forced_end_token_with_mask_zero(tiny):
    _, tok = tiny
    policy = ScriptedPolicy(tok, ["a very long answer that will be cut"])
    b = rollout(policy, tok, sim(max_turns=2), SC[:1], think=False,
                gen_cfg=GenConfig(max_new_tokens=5))
    row, lm = b.input_ids[0].tolist(), b.loss_mask[0].tolist()
    (s1, e1), (s2, e2) = spans(lm)
    assert e1 - s1 == 5 and row[e1] == tok.eos_token_id and lm[e1] == 0
    assert row[e2] == tok.eos_token_id and e2 + 1 == int(b.attention_mask[0].sum())


def test_logprobs_match_generation_scores(tiny):
    model, tok = tiny
    model.float()
    p2 = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    p1 = tok.encode("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n")
    L = len(p1)
    ids = torch.tensor([p1, [tok.pad_token_id] * (L - len(p2)) + p2])
    am = torch.tensor([[1] * L, [0] * (L - len(p2)) + [1] * len(p2)])
    torch.manual_seed(3)
    out = model.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                         max_new_tokens=12, min_new_tokens=12, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=None)
    new = out.sequences[:, L:]
    gen_lp = torch.stack([torch.log_softmax(lg.float() / 0.7, -1) for lg in out.logits], 1)
    gen_lp = gen_lp.gather(-1, new[..., None]).squeeze(-1)
    # Re-score as a training row: right-padded, no left padding.
    rows = [p1 + new[0].tolist(), p2 + new[1].tolist()]
    T = max(map(len, rows))
    x = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    xm = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    lp = token_logprobs(model, x, xm, temperature=0.7, micro_batch=1)
    assert torch.allclose(lp[0, len(p1):len(p1) + 12], gen_lp[0], atol=1e-4)
    assert torch.allclose(lp[1, len(p2):len(p2) + 12], gen_lp[1], atol=1e-4)
    assert lp[:, 0].abs().sum() == 0 and lp[1, len(rows[1]):].abs().sum() == 0


def test_group_members_share_scenario_and_opening(tiny):
    _, tok = tiny
    policy = ScriptedPolicy(tok, ["ok then", "sure", "fine", "right", "hm", "yes"])
    b = rollout(policy, tok, sim(max_turns=2), SC[:3], group_size=2, think=False,
                gen_cfg=GenConfig(max_new_tokens=16))
    assert b.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    for m in b.metrics:
        assert m["history"][0]["content"] == SC[m["group"]].first_message
    s = rollout_stats(b)
    assert s["dialogues"] == 6 and s["turns"] == 2 and 0 <= s["reward"] <= 1


def test_think_mode_only_reply_reaches_user_and_violations_zero_reward(tiny):
    _, tok = tiny
    texts = ["<think>SECRET-THOUGHT</think>That sounds hard.", "no think tags here"]
    policy = ScriptedPolicy(tok, texts)
    b = rollout(policy, tok, sim(max_turns=2), SC[:1], group_size=2, think=True,
                gen_cfg=GenConfig(max_new_tokens=64))
    for m in b.metrics:
        users_view = json.dumps([h for h in m["history"]])
        assert "SECRET-THOUGHT" not in users_view  # the simulator never saw the thought
    # dialogue 0 alternates good/bad turns -> a violation -> reward 0
    assert any(m["format_violations"] for m in b.metrics)
    assert all(m["reward"] == 0.0 for m in b.metrics if m["format_violations"])
    assert "SECRET-THOUGHT" in tok.decode(b.input_ids[0])  # the policy's own context keeps it
    assert split_think(texts[0]) == ("SECRET-THOUGHT", "That sounds hard.", True)


def test_per_turn_samples_and_dropped_thoughts(tiny):
    _, tok = tiny
    policy = ScriptedPolicy(tok, ["<think>T-ONE</think>Sounds hard."] * 2 + ["<think>T-TWO</think>I hear you."] * 2)
    b = rollout(policy, tok, sim(max_turns=2), SC[:1], group_size=2, think=True,
                gen_cfg=GenConfig(max_new_tokens=64, per_turn_samples=True, drop_thoughts=True))
    assert len(b) == 4 and b.dialogue_ids.tolist() == [0, 0, 1, 1]
    assert torch.equal(b.rewards[0], b.rewards[1])
    second_turn = tok.decode(b.input_ids[1][b.loss_mask[1] == 0])
    assert "T-ONE" not in second_turn and "Sounds hard." in second_turn  # thought dropped from prompt
    assert tok.decode(b.input_ids[1][b.loss_mask[1] == 1]).startswith("<think>T-TWO")


def test_simulator_error_dialogues_are_flagged_and_left_out(tiny):
    _, tok = tiny
    class Flaky(RuleBackend):
        def appraise(self, state, reply):
            if state.scenario.id == "s1":
                from simulator import SimulatorError
                raise SimulatorError("down")
            return super().appraise(state, reply)
    policy = ScriptedPolicy(tok, ["ok"])
    b = rollout(policy, tok, Simulator(Flaky(), max_turns=2), SC[:2], group_size=2, think=False,
                gen_cfg=GenConfig(max_new_tokens=8))
    assert len(b.metrics) == 4 and len(b) == 2 and b.group_ids.tolist() == [0, 0]
    assert [m["valid"] for m in b.metrics] == [True, True, False, False]
    assert rollout_stats(b)["simulator_errors"] == 2
    assert not torch.isnan(b.rewards).any()


def test_token_budget_stops_dialogue(tiny):
    _, tok = tiny
    policy = ScriptedPolicy(tok, ["x" * 30])
    first = len(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": build_system_prompt(False)}, {"role": "user", "content": SC[0].first_message}],
        tokenize=False, add_generation_prompt=True)))
    b = rollout(policy, tok, sim(max_turns=10), SC[:1], think=False,
                gen_cfg=GenConfig(max_new_tokens=40, max_total_tokens=first + 150))
    m = b.metrics[0]
    assert m["outcome"] == "max_tokens" and 1 <= m["turns"] < 10
    assert b.attention_mask.sum() <= first + 150
    assert b.input_ids[0, int(b.attention_mask[0].sum()) - 1] == tok.eos_token_id  # ends on an agent turn


def test_batch_logprobs_and_select(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    b = rollout(model, tok, sim(max_turns=2), SC[:2], group_size=2, think=False,
                gen_cfg=GenConfig(max_new_tokens=8))
    b = add_logprobs(b, model, ref_model=model)
    assert b.old_logprobs.shape == b.input_ids.shape and torch.equal(b.old_logprobs, b.ref_logprobs)
    assert (b.old_logprobs[b.loss_mask == 1] < 0).all()
    sub = b.select([1, 3])
    assert len(sub) == 2 and sub.input_ids.shape[1] == int(b.attention_mask[[1, 3]].sum(1).max())
    assert torch.equal(sub.rewards, b.rewards[[1, 3]])


def test_user_turn_delta_for_both_templates(tiny):
    _, tok = tiny
    d = user_turn_ids(tok, "sys", "hello", tok.eos_token_id)
    assert tok.decode(d) == "\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_entropy_matches_definition_and_its_gradient_is_optional(tiny):
    model, tok = tiny
    ids = torch.randint(0, 256, (2, 9))
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    lp, ent = token_logprobs(model, ids, am, temperature=0.8, return_entropy=True)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=am).logits[:, :-1].float() / 0.8, -1)
    ref = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(ent[:, 1:] * am[:, 1:], ref * am[:, 1:], atol=1e-5)
    assert torch.allclose(lp[:, 1:], logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * am[:, 1:], atol=1e-5)
    assert not ent.requires_grad and lp.requires_grad
    _, ent = token_logprobs(model, ids, am, return_entropy=True, entropy_grad=True)
    assert ent.requires_grad


def test_process_without_work_keeps_joining_generate(tiny):
    """Under FSDP a process whose dialogues ended must keep calling generate while others run."""
    _, tok = tiny
    policy = ScriptedPolicy(tok, ["That sounds hard."])
    others_running = iter([True, True, False])  # consulted once ours are done: 2 more turns elsewhere
    seen = []
    def any_active(local):
        seen.append(local)
        return local or next(others_running)
    b = rollout(policy, tok, sim(max_turns=2), SC[:1], think=False, gen_cfg=GenConfig(max_new_tokens=16),
                any_active=any_active)
    assert seen == [True, True, False, False, False] and len(policy.returned) == 4  # 2 real + 2 dummy
    ref = rollout(ScriptedPolicy(tok, ["That sounds hard."]), tok, sim(max_turns=2), SC[:1], think=False,
                  gen_cfg=GenConfig(max_new_tokens=16))
    assert torch.equal(b.input_ids, ref.input_ids) and torch.equal(b.loss_mask, ref.loss_mask)


# Qwen2.5-7B-Instruct's generation_config.json (plus fields other checkpoints ship): with
# transformers 5, anything the rollout's GenerationConfig leaves unset is filled from these.
QWEN_LIKE_DEFAULTS = dict(do_sample=True, repetition_penalty=1.05, top_k=20, top_p=0.8, temperature=0.7,
                          no_repeat_ngram_size=2, typical_p=0.9, min_p=0.05, suppress_tokens=[5, 6])


def recording_policy(seed=0):
    """A tiny model carrying Qwen-like generation defaults whose generate() also records the
    scores after all logits processors/warpers and the raw logits of every step."""
    from plumbing.models import make_tiny_policy as mk
    model, tok = mk(seed=seed)
    for k, v in QWEN_LIKE_DEFAULTS.items():
        setattr(model.generation_config, k, v)
    calls, orig = [], model.generate

    def generate(**kw):
        out = orig(**kw, output_scores=True, output_logits=True, return_dict_in_generate=True)
        calls.append(out)
        return out.sequences
    model.generate = generate
    return model, tok, calls


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_sampled_distribution_is_exactly_softmax_logits_over_T_despite_model_defaults(T):
    """Whatever the checkpoint's generation_config says, every step samples from
    softmax(logits / T) over the whole vocabulary: the distribution the old log-probs score."""
    from rollout import end_of_turn_id, generate_turn
    model, tok, calls = recording_policy()
    ctx = [tok.encode("<|im_start|>user\nI lost my job today<|im_end|>\n<|im_start|>assistant\n"),
           tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")]
    torch.manual_seed(0)
    generate_turn(model, ctx, GenConfig(max_new_tokens=16, temperature=T), end_of_turn_id(tok), tok.pad_token_id)
    out = calls[0]
    assert len(out.scores) >= 8
    for scores, logits in zip(out.scores, out.logits):
        want = torch.log_softmax(logits.float() / T, -1)
        got = torch.log_softmax(scores.float(), -1)
        assert torch.isfinite(got).all()  # no token was cut away (top-k/top-p/min-p/suppression)
        assert (got - want).abs().max() < 1e-4
    assert model.generation_config.repetition_penalty == 1.05  # the model's own config is left as it was


def test_greedy_turn_is_argmax_of_raw_logits_despite_model_defaults():
    """evaluate.py's greedy decoding: no repetition penalty or n-gram ban from the checkpoint."""
    from rollout import end_of_turn_id, generate_turn
    model, tok, calls = recording_policy(seed=1)
    ctx = [tok.encode("<|im_start|>user\nhello hello hello<|im_end|>\n<|im_start|>assistant\n")]
    generate_turn(model, ctx, GenConfig(max_new_tokens=24, temperature=0.0), end_of_turn_id(tok), tok.pad_token_id)
    out = calls[0]
    new = out.sequences[0, len(ctx[0]):]
    for k, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        assert torch.equal(scores, logits)
        assert new[k] == logits[0].argmax()


def test_never_appraised_dialogues_are_not_scored(tiny):
    """Issue 14 item 5: a token budget too small for one turn stops every dialogue before its
    first appraisal. Its 'final emotion' is only the initial one: it used to be logged as
    reward 0.40 here. Now it has no score: not valid, counted apart, out of the means."""
    _, tok = tiny
    b = rollout(ScriptedPolicy(tok, ["ok"]), tok, sim(), SC[:2], group_size=2, think=False,
                gen_cfg=GenConfig(max_new_tokens=8, max_total_tokens=20))
    assert len(b) == 0 and [(m["valid"], m["turns"], m["outcome"]) for m in b.metrics] == [(False, 0, "max_tokens")] * 4
    s = rollout_stats(b)
    assert (s["reward"], s["emotion"], s["unappraised"], s["simulator_errors"], s["dialogues"]) == (None, None, 4, 0, 4)


def test_word_tokenizer_makes_the_cpu_demo_readable():
    """The CPU demo's tokenizer (train.py / evaluate.py --model tiny): every phrase the rule
    user reacts to or says is in its vocabulary, and a RANDOM tiny model already speaks words,
    so what RL changes is which words (the byte tokenizer's random model writes byte noise)."""
    from plumbing.models import make_tiny_word_tokenizer, rule_user_phrases
    from rollout import end_of_turn_id, generate_turn
    tok = make_tiny_word_tokenizer()
    phrases = rule_user_phrases("en")
    assert len(phrases) > 80 and "sounds" in phrases and "get over it" in phrases
    for p in phrases:
        ids = tok.encode(p, add_special_tokens=False)
        assert tok.unk_token_id not in ids and tok.decode(ids) == p.strip(), p
    rule = RuleBackend()
    for words, want in ((True, 0.95), (False, 0.6)):
        model, tk = make_tiny_policy(seed=0, words=words)
        ctx = [tk.encode("<|im_start|>user\nI lost my job.<|im_end|>\n<|im_start|>assistant\n")] * 4
        torch.manual_seed(0)
        turns = generate_turn(model, ctx, GenConfig(max_new_tokens=24), end_of_turn_id(tk), tk.pad_token_id)
        texts = [tk.decode(t, skip_special_tokens=True) for t in turns]
        readable = sum(rule.features(x, "", "empathy")["readable"] for x in texts) / len(texts)
        assert (readable >= want) if words else (readable < want), (words, readable, texts)


def test_each_user_answer_reaches_its_own_dialogue_after_others_ended():
    """Issue 29: the official rollout picks the simulated user by position once a dialogue of the
    batch has ended (answers go to the wrong user). Ours routes by dialogue: every user line
    names its own scenario, while dialogues end at turns 1, 2 and 3."""
    class Named:
        def appraise(self, state, reply):
            return (-10 if state.turn >= int(state.scenario.id[1:]) else 1), "x"  # s_k fails at turn k + 1

        def respond(self, state, final):
            return f"I am {state.scenario.id}, turn {state.turn}."

        def opening(self, sc):
            return f"I am {sc.id}."
    scenarios = [Scenario(id=f"s{i}", persona="p", background="b", hidden_goal="g") for i in range(3)]
    tok = make_tiny_tokenizer()
    policy = ScriptedPolicy(tok, ["hello there"])
    b = rollout(policy, tok, Simulator(Named(), initial_emotion=15, max_turns=5), scenarios, group_size=2,
                think=False, gen_cfg=GenConfig(max_new_tokens=8))
    ends = {}
    for m in b.metrics:
        users = [x["content"] for x in m["history"] if x["role"] == "user"]
        assert all(u.startswith(f"I am {m['scenario_id']}") for u in users), (m["scenario_id"], users)
        ends[m["scenario_id"]] = m["turns"]
    assert ends == {"s0": 1, "s1": 2, "s2": 3}


class EngineStandIn:
    """Plays like plumbing.engines.VLLMEngine.play (each dialogue on its own, through
    rollout.play_dialogue) without vLLM: every turn is the same ids with the log-probs given."""

    def __init__(self, tok, logprob):
        self.ids, self.logprob = tok.encode("hello there", add_special_tokens=False), logprob

    def play(self, dialogues, play_one, simulator, cfg, seed, progress=None):
        def generate(ids, request_seed):
            toks = (self.ids + [dialogues[0].end_id])[:cfg.max_new_tokens]
            return toks, [self.logprob] * len(toks)
        for d in dialogues:
            play_one(d, generate, simulator)


@pytest.mark.parametrize("per_turn", [False, True])
def test_engine_logprobs_are_kept_even_when_all_zero(per_turn):
    """A near-deterministic policy's engine log-probs can all be 0.0: they are still the
    sampler's (TIS and the mismatch metric need them). They were dropped as 'absent'."""
    tok = make_tiny_tokenizer()
    cfg = GenConfig(max_new_tokens=8, per_turn_samples=per_turn)
    for lp in (0.0, -0.5):
        b = rollout(None, tok, sim(max_turns=2), SC[:2], group_size=2, think=False, gen_cfg=cfg,
                    engine=EngineStandIn(tok, lp))
        assert b.sampler_logprobs is not None
        assert torch.all(b.sampler_logprobs[b.loss_mask.bool()] == lp)
    # the Hugging Face path keeps none
    b = rollout(ScriptedPolicy(tok, ["hello there"]), tok, sim(max_turns=2), SC[:2], group_size=2, think=False,
                gen_cfg=cfg)
    assert b.sampler_logprobs is None
