"""plumbing/lora.py - LoRA policies and critics (--lora-rank R), done exactly (a reader may skip it).

The paper trains every weight of Qwen2.5-7B on 8 GPUs. With LoRA (Hu et al. 2021) the policy
is the frozen base W plus a trained low-rank update (alpha / R) B A on every linear projection
of attention and MLP, so a 7B policy fits one GPU (docs/LORA.md). What this file does, each
against a pitfall the peers have:

  LoraArgs            the flags; lora_problem: bad input in one line
  add_adapter         PEFT's adapter on the policy or the critic's backbone, before gradient
                      checkpointing and before accelerate.prepare (adapters added after FSDP2
                      has sharded the model stay replicated and are never averaged)
  ReferencePolicy     the KL reference: the policy's own forward with its adapter disabled (the
                      base itself), no second model
  engine_weights      what the generation engine loads: W + (alpha / R) B A, computed out of
                      place in fp32 per tensor and cast to the engine's dtype, under the base
                      model's names. The trainer's W is never touched (merging in place and
                      unmerging in bf16 drifts: TRL issue 6688)
  trainable_only      a checkpoint holds the adapters, the value head and their optimizer states,
                      not the frozen base (single process and DDP)
  save_adapter        final/adapter: the adapter in PEFT's format (adapter_config.json names the base)
  load_adapter_dir    --model DIR with adapter_config.json: the base with the adapter merged

lora_dropout is 0: the update's log-probs (train mode) must be those of the sampler (eval
mode), or the PPO ratio of the first minibatch is not 1.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

ADAPTER = "default"  # PEFT's name of the one adapter


@dataclass
class LoraArgs:
    """LoRA's flags (train.py)."""
    lora_rank: int = field(default=0, metadata={
        "help": "LoRA rank R of the policy (and of PPO's critic); 0: full fine-tuning (the paper)"})
    lora_alpha: float = field(default=0.0, metadata={"help": "LoRA alpha (the update is alpha / R x B A); 0: 2 x R"})
    lora_target_modules: str = field(default="", metadata={
        "help": "comma-separated module names to adapt; empty: every linear projection of attention and MLP "
                "(never the embeddings or the LM head)"})


def lora_problem(cfg) -> str | None:
    """One line for LoRA flags that cannot work, before any model is loaded; None when fine."""
    if cfg.lora_rank < 0:
        return f"--lora-rank {cfg.lora_rank}: must be >= 0 (0: full fine-tuning)"
    if cfg.lora_rank == 0 and (cfg.lora_alpha or cfg.lora_target_modules):
        given = "--lora-alpha" if cfg.lora_alpha else "--lora-target-modules"
        return f"{given} needs --lora-rank > 0 (--lora-rank 0 trains every weight)"
    if cfg.lora_alpha < 0:
        return f"--lora-alpha {cfg.lora_alpha}: must be >= 0 (0: 2 x rank)"
    return None


def target_list(text: str) -> str:
    """--lora-target-modules as applied and recorded: sorted, without blanks or repeats, so that a
    resume naming the same modules in another order or spacing matches ("" and ",": every
    linear projection)."""
    return ",".join(sorted({t.strip() for t in text.split(",") if t.strip()}))


def adapted_modules(model, targets: str, base_name: str) -> list[str]:
    """The module names an adapter goes on -> `targets` (target_list's form) or, empty, every
    linear projection of `model`; InputError for a name that matches no linear projection, or
    that names the embeddings or the LM head. `model` may be an empty one (plumbing.models.
    empty_model: its modules without weights), so that this is checked before any loading."""
    from plumbing.files import InputError
    linear = linear_targets(model)
    if not linear:  # e.g. GPT-2's Conv1D projections
        raise InputError(f"--lora-rank: {base_name} has no linear projection (nn.Linear) to adapt")
    wanted = targets.split(",") if targets else linear
    wrong = [t for t in wanted if t not in linear]
    if wrong:
        raise InputError(f"--lora-target-modules: {', '.join(wrong)} matches no linear projection of {base_name} "
                         f"(its projections: {', '.join(linear)}; the embeddings and the LM head are not adapted)")
    return wanted


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def linear_targets(model) -> list[str]:
    """Every linear projection's name inside the model but the output head (q_proj, ..., down_proj)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head and name})


def add_adapter(model, cfg, base_name: str):
    """-> the model with a fresh LoRA adapter (PEFT), only the adapter trainable. The adapter's B
    starts at 0, so the policy is the base at step 0. InputError for target names that match no
    linear projection, or that name the embeddings or the LM head (adapted_modules)."""
    from peft import LoraConfig, get_peft_model
    targets = adapted_modules(model, target_list(cfg.lora_target_modules), base_name)
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, target_modules=targets,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM" if model.get_output_embeddings() else None)
    peft = get_peft_model(model, config)
    if os.path.isdir(os.path.expanduser(base_name)):  # a folder: named so that it loads from anywhere
        base_name = os.path.abspath(os.path.expanduser(base_name))
    peft.peft_config[ADAPTER].base_model_name_or_path = base_name  # PEFT reads it off the config: empty for ours
    return peft


class ReferencePolicy:
    """The KL reference under LoRA: the policy (as prepared: DDP, FSDP2 or plain) run with its
    adapter disabled, i.e. the frozen base, exactly (a LoRA layer without its adapter computes
    base_layer(x) alone). logprobs.token_logprobs reads the LM head from `.module` and calls
    this object like the model. Each LoRA layer's switch is set directly: PEFT's
    disable_adapter() also sets the adapter's requires_grad to False for the call, and FSDP2
    fixes each group's gradient dtypes at its first forward from requires_grad (this pass can be
    the first: the reduce would then be in bf16, and the update fail)."""

    def __init__(self, policy, peft_model):
        from peft.tuners.lora import LoraLayer
        self.policy, self.module = policy, peft_model
        self.layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]

    def __call__(self, *args, **kwargs):
        for layer in self.layers:
            layer._disable_adapters = True
        try:
            return self.policy(*args, **kwargs)
        finally:
            for layer in self.layers:
                layer._disable_adapters = False

    def parameters(self):
        return self.policy.parameters()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def engine_weights(model, dtype):
    """Yield (name, tensor) of the weights a generation engine loads, under the base model's
    names, floating tensors in `dtype`, FSDP2 shards gathered whole (one collective per tensor,
    streamed). Without LoRA the state dict (shards cast before gathering: half the bytes in bf16).
    With LoRA, each adapted weight merged out of place: W + (alpha / R) B A in fp32 (W, A, B
    gathered in fp32), then cast once; the adapter's own tensors are not sent."""
    adapted = {}
    if is_lora(model):
        from peft.tuners.lora import LoraLayer
        adapted = {f"{n}.base_layer.weight": m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    state = model.state_dict()
    # Tied tensors (an LM head shared with the embeddings) stay one tensor: those kept here.
    ptrs = [_storage(t) for t in state.values()]
    shared = {p for p in ptrs if ptrs.count(p) > 1}
    made = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        out_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".") if adapted else name
        ptr = _storage(tensor)
        if ptr in made:
            yield out_name, made[ptr]
            continue
        tensor = tensor.detach()
        if name in adapted:
            layer = adapted[name]
            a = _full(layer.lora_A[ADAPTER].weight.detach()).float()
            b = _full(layer.lora_B[ADAPTER].weight.detach()).float()
            tensor = (_full(tensor).float() + layer.scaling[ADAPTER] * (b @ a)).to(dtype)
        elif tensor.is_floating_point():
            tensor = tensor.to(dtype)  # a DTensor casts shard by shard, no gather
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if ptr in shared:
            made[ptr] = tensor
        yield out_name, tensor


def _storage(t) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).data_ptr()


def trainable_only(models, weights, output_dir=None):
    """accelerate's save_state pre-hook: each model's saved state keeps only its trainable
    tensors (the adapter, a critic's value head) when it has a frozen part. FSDP2 models are
    saved sharded by accelerate before the hook (weights is empty): their checkpoints also hold
    the frozen base's shards."""
    for model, state in zip(models, weights):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if len(trainable) < len(list(model.parameters())):
            for key in [k for k in state if k not in trainable]:
                del state[key]


def adapter_state(model, keep: bool) -> dict:
    """The adapter's tensors whole, on the CPU where `keep` (the main process): what
    final/adapter holds. Every process calls it: under FSDP2 each tensor is gathered in turn (the
    adapter alone; the base is never gathered for it)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            tensor = _full(tensor.detach())
            if keep:
                state[name] = tensor.cpu()
    return state


TINY_BASE = "tiny_base.json"  # beside adapter_config.json when the base is the seeded random model


def save_adapter(peft_model, state: dict, folder: str):
    """The adapter in PEFT's format: adapter_config.json (naming the base) and
    adapter_model.safetensors, from `state`, the adapter's tensors whole (adapter_state). A base
    built from a seed (--model tiny) has it recorded (TINY_BASE): the same base is rebuilt
    whatever --seed the adapter is evaluated with."""
    peft_model.save_pretrained(folder, state_dict=state, save_embedding_layers=False)  # (no hub lookup)
    seed = getattr(peft_model.get_base_model().config, "tiny_seed", None)
    if seed is not None:
        with open(os.path.join(folder, TINY_BASE), "w", encoding="utf-8") as f:
            json.dump({"seed": seed}, f)


def load_adapter_dir(folder: str, load_base):
    """--model DIR where DIR holds adapter_config.json (a train.py final/adapter) -> (the base
    named there with the adapter merged in fp32 (engine_weights), its tokenizer). load_base(name,
    seed) -> (model, tokenizer) loads the base; seed: the one a random base was built with
    (TINY_BASE), else None."""
    from peft import PeftModel
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
        base_name = json.load(f)["base_model_name_or_path"]
    seed = None
    if os.path.isfile(os.path.join(folder, TINY_BASE)):
        with open(os.path.join(folder, TINY_BASE), encoding="utf-8") as f:
            seed = json.load(f)["seed"]
    base, tok = load_base(base_name, seed)
    dtype = next(base.parameters()).dtype
    peft = PeftModel.from_pretrained(base, folder)
    merged = dict(engine_weights(peft, dtype))
    plain = peft.unload()  # the LoRA layers out, the base weights as they were
    plain.load_state_dict(merged)
    return plain, tok
