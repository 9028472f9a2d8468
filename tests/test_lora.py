"""LoRA (--lora-rank R, plumbing/lora.py), issue 49: the adapter starts as the base, the KL
reference is the base, the engine gets W + (alpha / R) B A computed out of place (the trainer's
base never changes), checkpoints hold the trainable tensors only and resume exactly, final/ is
the merged model and final/adapter loads with its base."""
import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from logprobs import token_logprobs
from plumbing.lora import ReferencePolicy, add_adapter, engine_weights, save_adapter
from plumbing.models import load_policy, make_tiny_policy
from train import main

ARGS = SimpleNamespace(lora_rank=4, lora_alpha=0.0, lora_target_modules="")
RUN = ["--batch-size", "4", "--max-new-tokens", "8", "--report-to", "none", "--save-every", "2", "--actor-lr", "1e-2"]


def adapted(seed=0, std=0.05):
    """The tiny policy with a rank-4 adapter whose B is random (as after some training)."""
    policy, tok = make_tiny_policy(seed=seed, words=True)
    torch.manual_seed(1)
    policy = add_adapter(policy, ARGS, "tiny")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std)
    return policy, tok


def ids_and_mask(tok, n=3, T=24):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, len(tok) - 1, (n, T), generator=g)
    return ids, torch.ones_like(ids)


def test_the_adapter_starts_at_the_base_and_only_it_trains():
    base, tok = make_tiny_policy(seed=0, words=True)
    policy = add_adapter(copy.deepcopy(base), ARGS, "tiny")
    ids, am = ids_and_mask(tok)
    with torch.no_grad():
        assert torch.equal(policy(input_ids=ids, attention_mask=am).logits,
                           base(input_ids=ids, attention_mask=am).logits)
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_A" in n or "lora_B" in n for n in trained)
    # every linear projection of attention and MLP, never the embeddings or the (tied) head
    assert sorted(policy.peft_config["default"].target_modules) == \
        ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert policy.peft_config["default"].lora_alpha == 8 and policy.peft_config["default"].lora_dropout == 0.0


def test_the_reference_is_the_base_with_the_adapter_off():
    """ReferencePolicy's log-probs equal those of a separately loaded base model, exactly; the
    adapted policy's differ."""
    policy, tok = adapted()
    base, _ = make_tiny_policy(seed=0, words=True)
    ids, am = ids_and_mask(tok)
    with torch.no_grad():
        ref = token_logprobs(ReferencePolicy(policy, policy), ids, am)
        separate = token_logprobs(base, ids, am)
        mine = token_logprobs(policy, ids, am)
    assert torch.equal(ref, separate)
    assert (mine - separate).abs().max() > 1e-3
    with torch.no_grad():  # the adapter is on again afterwards
        assert torch.equal(token_logprobs(policy, ids, am), mine)


def test_kl_to_the_base_is_zero_at_step_zero(tmp_path):
    """--kl-coef > 0 with LoRA loads no second model; at step 0 the policy is the base: KL 0."""
    rc = main(["--algo", "grpo", "--steps", "2", *RUN, "--lora-rank", "4", "--kl-coef", "0.1",
               "--output-dir", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7), rows[0]["kl"]
    assert rows[1]["kl"] > 1e-6  # after an update, the policy has moved from the base


def test_engine_weights_are_the_merged_weights_computed_apart():
    """W + (alpha / R) B A, under the base model's names, against an independent computation in
    float64 (PEFT's own merge_and_unload on a copy, in float64)."""
    policy, _ = adapted()
    merged = dict(engine_weights(policy, torch.float32))
    ref = copy.deepcopy(policy).double().merge_and_unload().state_dict()
    base, _ = make_tiny_policy(seed=0, words=True)
    assert merged.keys() == base.state_dict().keys() == ref.keys()
    for k in ref:
        assert (merged[k].double() - ref[k]).abs().max() < 1e-6, k
    changed = [k for k in ref if not torch.equal(merged[k], base.state_dict()[k])]
    assert len(changed) == 7 * policy.config.num_hidden_layers  # the adapted projections, no more
    assert merged["lm_head.weight"] is merged["model.embed_tokens.weight"]  # the tied head stays one tensor


def test_a_hundred_pushes_in_bf16_leave_the_base_bit_identical():
    """The trainer's base weights never change (merging in place and unmerging in bf16 drifts,
    TRL issue 6688): after 100 merges the base is bit-identical; PEFT's merge/unmerge in place,
    100 times on a copy, is not (what this test would catch)."""
    policy, _ = adapted()
    policy = policy.to(torch.bfloat16)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    for _ in range(100):
        for _name, tensor in engine_weights(policy, torch.bfloat16):
            pass
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    in_place = copy.deepcopy(policy)
    for _ in range(100):
        in_place.merge_adapter()
        in_place.unmerge_adapter()
    drift = max(float((before[k].float() - v.float()).abs().max()) for k, v in in_place.state_dict().items())
    assert drift > 0, drift


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_lora_checkpoints_hold_the_adapter_and_resume_exactly(algo, tmp_path):
    """Checkpoints hold the adapter (and PPO's value head and critic adapter) and the optimizer
    states, not the frozen base; 2 steps + resume to 4 == 4 steps; final/ is the merged model,
    loadable by transformers, and final/adapter loads with its base to the same weights."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    base = ["--algo", algo, "--steps", "4", *RUN, "--lora-rank", "4"]
    assert main([*base, "--output-dir", str(full)]) == 0
    models = [load_file(full / "checkpoints" / "step_000002" / name) for name in
              (["model.safetensors"] + (["model_1.safetensors"] if algo == "ppo" else []))]
    for state in models:
        assert state and all("lora_" in k or "value_head" in k for k in state), list(state)[:5]
    if algo == "ppo":
        assert any("value_head" in k for k in models[1])
    os.makedirs(cut / "checkpoints")
    import shutil
    shutil.copytree(full / "checkpoints" / "step_000002", cut / "checkpoints" / "step_000002")
    assert main([*base, "--output-dir", str(cut), "--resume", "auto"]) == 0
    a, b = load_file(full / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(full / "final")
    adapter_config = json.load(open(full / "final" / "adapter" / "adapter_config.json"))
    assert adapter_config["base_model_name_or_path"] == "tiny" and adapter_config["r"] == 4
    from_adapter, _ = load_policy(str(full / "final" / "adapter"))
    fa = from_adapter.state_dict()
    for k, v in final.state_dict().items():
        assert torch.equal(v, fa[k]), k
    # a checkpoint of another rank is refused in one line, before any model is loaded
    assert main([*base, "--lora-rank", "8", "--output-dir", str(tmp_path / "other"),
                 "--resume", str(full / "checkpoints" / "step_000002")]) == 2
    untrained, tok = make_tiny_policy(seed=0, words=True)
    assert any(not torch.equal(v, untrained.state_dict()[k]) for k, v in final.state_dict().items())


def test_evaluate_takes_an_adapter_folder(tmp_path):
    """evaluate.py --model DIR/final/adapter: its base with the adapter merged (the same weights
    as final/), checked like any model folder (its base named in adapter_config.json)."""
    from plumbing.checks import InputError, check_model_arg
    policy, tok = adapted()
    folder = tmp_path / "adapter"
    save_adapter(policy, policy.state_dict(), str(folder))
    check_model_arg("--model", str(folder), adapters=True)
    loaded, _ = load_policy(str(folder))
    merged = dict(engine_weights(policy, torch.float32))
    assert all(torch.equal(v, merged[k]) for k, v in loaded.state_dict().items())
    cfg = json.load(open(folder / "adapter_config.json"))
    json.dump({**cfg, "base_model_name_or_path": str(tmp_path / "nowhere")}, open(folder / "adapter_config.json", "w"))
    with pytest.raises(InputError, match="its base"):
        check_model_arg("--model", str(folder), adapters=True)


def test_the_reference_pass_leaves_the_adapters_trainable():
    """PEFT's disable_adapter() sets the adapter's requires_grad to False for the call; FSDP2
    fixes each group's gradient dtypes from requires_grad at its first forward, which the
    reference pass can be (bf16 reduce, then a failed update: the review of 923f490). The
    reference switches the layers off without touching requires_grad."""
    policy, tok = adapted()
    seen = []
    layer = next(m for n, m in policy.named_modules() if n.endswith("q_proj"))
    layer.register_forward_pre_hook(lambda m, a: seen.append(all(p.requires_grad for n, p in m.named_parameters()
                                                                  if "lora_" in n)))
    ids, am = ids_and_mask(tok)
    with torch.no_grad():
        token_logprobs(ReferencePolicy(policy, policy), ids, am)
    assert seen and all(seen)


def test_a_lora_resume_that_would_restore_nothing_is_refused(tmp_path):
    """strict=False (the checkpoint lacks the frozen base) hid a checkpoint whose tensors match
    none of this run's (saved under DDP, module.*, resumed on one process; other target modules):
    the adapter stayed fresh while the optimizer's moments were restored. Now one line. A changed
    alpha (as applied) or target list is refused before loading; the same alpha spelled 0 is not."""
    from safetensors.torch import save_file
    base = ["--algo", "grpo", "--steps", "2", *RUN, "--lora-rank", "4"]
    assert main([*base, "--output-dir", str(tmp_path / "run")]) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert main([*base, "--steps", "3", "--lora-alpha", "8", "--output-dir", str(tmp_path / "same"),
                 "--resume", str(ckpt)]) == 0  # 8 = 2 x 4: what 0 applied
    for flags, msg in ((["--lora-alpha", "16"], "--lora-alpha 8 (as applied), this run has --lora-alpha 16"),
                       (["--lora-target-modules", "q_proj"], "--lora-target-modules empty (as applied)")):
        assert main([*base, "--steps", "3", *flags, "--output-dir", str(tmp_path / "x"), "--resume", str(ckpt)]) == 2
    state = load_file(ckpt / "model.safetensors")
    save_file({f"module.{k}": v for k, v in state.items()}, ckpt / "model.safetensors")  # as DDP saves it
    assert main([*base, "--steps", "3", "--output-dir", str(tmp_path / "ddp"), "--resume", str(ckpt)]) == 2


def test_train_refuses_an_adapter_folder_and_a_model_with_nothing_to_adapt(tmp_path, capsys):
    """train.py --model DIR/final/adapter: the critic and reference loaders cannot read it (a
    traceback under PPO); one line names the merged final/ instead. A model whose projections
    are not nn.Linear (GPT-2's Conv1D): one line, not PEFT's traceback."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from plumbing.checks import InputError
    policy, _ = adapted()
    save_adapter(policy, policy.state_dict(), str(tmp_path / "adapter"))
    assert main(["--model", str(tmp_path / "adapter"), "--output-dir", str(tmp_path / "out"),
                 "--report-to", "none"]) == 2
    assert "a LoRA adapter folder; train from its merged model" in capsys.readouterr().err
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(InputError, match="no linear projection"):
        add_adapter(gpt2, ARGS, "gpt2")


# ---------------------------------------------------------------- faults, round six: item 8
def test_a_tiny_adapter_evaluated_with_another_seed_gets_the_base_it_was_trained_on(tmp_path):
    """A tiny-model adapter loaded with another --seed got another random base (max abs diff
    0.128 against final/). final/adapter records the seed its base was built with and uses it."""
    assert main(["--algo", "grpo", "--steps", "2", *RUN, "--lora-rank", "4", "--seed", "3",
                 "--output-dir", str(tmp_path)]) == 0
    assert json.load(open(tmp_path / "final" / "adapter" / "tiny_base.json")) == {"seed": 3}
    final = load_file(tmp_path / "final" / "model.safetensors")
    loaded, _ = load_policy(str(tmp_path / "final" / "adapter"), seed=0)  # evaluate.py --seed 0
    state = loaded.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in final.items())


def test_target_modules_are_applied_and_recorded_sorted_without_blanks(tmp_path):
    """--lora-target-modules "," was applied as every projection but recorded as ","; a list in
    another order or spacing was refused on resume. The list is normalised before it is applied
    and recorded; a resume naming the same modules otherwise is accepted."""
    base = ["--algo", "grpo", "--steps", "2", *RUN, "--lora-rank", "4"]
    assert main([*base, "--lora-target-modules", " v_proj,q_proj, ", "--output-dir", str(tmp_path / "a")]) == 0
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    assert json.load(open(ckpt / "trainer_state.json"))["config"]["lora_target_modules"] == "q_proj,v_proj"
    assert json.load(open(tmp_path / "a" / "final" / "adapter" / "adapter_config.json"))["target_modules"] in (
        ["q_proj", "v_proj"], ["v_proj", "q_proj"])
    assert main([*base, "--steps", "3", "--lora-target-modules", "q_proj,v_proj,q_proj", "--resume", str(ckpt),
                 "--output-dir", str(tmp_path / "b")]) == 0
    assert main([*base, "--lora-target-modules", ",", "--output-dir", str(tmp_path / "c")]) == 0
    state = json.load(open(tmp_path / "c" / "checkpoints" / "step_000002" / "trainer_state.json"))
    assert state["config"]["lora_target_modules"] == ""  # every projection, as applied


def test_a_lora_resume_may_turn_the_kl_on_or_off(tmp_path):
    """Turning --kl-coef on or off on a LoRA resume was refused ("saved without a KL reference
    model"), though a LoRA reference is the base with the adapter off and is never saved."""
    base = ["--algo", "grpo", "--steps", "2", *RUN, "--lora-rank", "4"]
    assert main([*base, "--output-dir", str(tmp_path / "a")]) == 0
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    assert main([*base, "--steps", "3", "--kl-coef", "0.1", "--resume", str(ckpt),
                 "--output-dir", str(tmp_path / "b")]) == 0
    ckpt = tmp_path / "b" / "checkpoints" / "step_000003"
    assert main([*base, "--steps", "4", "--resume", str(ckpt), "--output-dir", str(tmp_path / "c")]) == 0


def test_a_target_module_that_matches_nothing_is_refused_before_any_weight_loads(tmp_path, capsys, monkeypatch):
    """A target module that matched nothing was found after the policy's weights were loaded
    (minutes for a 7B model). The names are checked on the model's configuration first."""
    import train

    def no_loading(*a, **k):
        raise AssertionError("the models were loaded")
    monkeypatch.setattr(train, "load_models", no_loading)
    assert main(["--steps", "2", *RUN, "--lora-rank", "4", "--lora-target-modules", "q_proj,nope",
                 "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error: --lora-target-modules: nope matches no linear projection of tiny")


def test_the_empty_model_names_the_modules_the_loaded_one_has():
    """The check above reads an empty model (plumbing.models.empty_model: meta device, from the
    configuration): its projections are those of the model loaded whole."""
    from plumbing.lora import linear_targets
    from plumbing.models import empty_model, smollm2_missing
    if smollm2_missing():
        pytest.skip(smollm2_missing())
    empty = empty_model("smollm2")
    assert next(empty.parameters()).device.type == "meta"
    assert linear_targets(empty) == linear_targets(load_policy("smollm2")[0]) != []


def test_a_lora_resume_of_the_tiny_model_with_another_seed_is_refused(tmp_path, capsys):
    """From a review: a LoRA checkpoint holds the adapter, not the frozen base, which the tiny
    model builds from --seed: a resume with another seed put the adapter on another base."""
    base = ["--algo", "grpo", "--steps", "2", *RUN, "--lora-rank", "4"]
    assert main([*base, "--output-dir", str(tmp_path / "a")]) == 0
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    assert main([*base, "--steps", "3", "--seed", "1", "--resume", str(ckpt), "--output-dir", str(tmp_path / "b")]) == 2
    assert "saved by a run with --seed 0, this run has --seed 1" in capsys.readouterr().err


def test_a_critic_with_nothing_to_adapt_is_refused_before_any_weight_loads(tmp_path, capsys, monkeypatch):
    """From a review: PPO's --critic-model gets the adapter too; its modules are checked on its
    configuration as the policy's are, before the loading."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import train

    def no_loading(*a, **k):
        raise AssertionError("the models were loaded")
    monkeypatch.setattr(train, "load_models", no_loading)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=300)).save_pretrained(tmp_path / "gpt2")
    assert main(["--algo", "ppo", "--steps", "2", *RUN, "--lora-rank", "4", "--critic-model", str(tmp_path / "gpt2"),
                 "--output-dir", str(tmp_path / "out")]) == 2
    assert "has no linear projection (nn.Linear) to adapt" in capsys.readouterr().err.strip().splitlines()[-1]
