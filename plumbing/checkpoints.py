"""plumbing/checkpoints.py - checkpoints, the final model and --resume (a reader may skip it).

Everything a later command reads is written to a temporary path beside its place and renamed
onto it when complete (`written_atomically`), so a crash or a kill mid-write never leaves a
checkpoint, a final model or a log that looks complete but is not.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys

import torch
from accelerate.utils import DistributedType, broadcast_object_list
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

from plumbing.files import SaveError, _FailedElsewhere, _remove, append_line, written_atomically  # noqa: F401 (SaveError, append_line: re-exported)
from plumbing.lora import adapter_state, engine_weights, is_lora, save_adapter
from update import all_sum

log = logging.getLogger("train")


def resume_hint(cfg, argv: list[str]) -> str:
    """What an interrupted or failed run kept and the command that continues it (one line):
    this run's flags less any --resume (and its value), quoted for the shell, under the launcher
    that started it."""
    done = saved_checkpoints(cfg)
    kept = "no checkpoint yet"
    if done:
        kept = f"the last checkpoint is {os.path.join(ckpt_dir(cfg), done[-1])} (after step {int(done[-1][5:])})"
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True  # its value is the next word
        elif not a.startswith("--resume="):
            args.append(a)
    command = shlex.join([*launch_command(), *args, "--resume", "auto"])
    return f"{kept}; continue with: {command} (steps after the checkpoint are done again)"


def launch_command() -> list[str]:
    """The words that started this process, up to its script: `python train.py`, or under a
    launcher (several processes) the launcher's own command line, read from the parent process
    (`accelerate launch --config_file configs/fsdp_8gpu.yaml --num_machines 2 ... train.py`):
    run as printed, a resumed run gets the same config file, process count and node flags.
    Paths inside the working directory are made relative to it."""
    script = os.path.basename(sys.argv[0])
    if not script.endswith(".py") or script == "__main__.py":  # train.main() called from elsewhere
        script = "train.py"
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ["python", "train.py"]
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            words = [w.decode() for w in f.read().split(b"\0") if w]
        words = words[:next(i for i, w in enumerate(words) if os.path.basename(w) == script) + 1]
    except (OSError, UnicodeDecodeError, StopIteration):  # no /proc, or a launcher that hides the script
        return ["accelerate", "launch", script]
    if os.path.basename(words[0]).startswith("python") and len(words) > 1 and not words[1].startswith("-") \
            and not words[1].endswith(".py"):  # python /path/to/bin/accelerate launch ...: the console script
        words = words[1:]
    if os.path.basename(words[0]).startswith("python"):
        words[0] = "python"
    else:
        words[0] = os.path.basename(words[0])  # .../bin/accelerate, .../bin/torchrun
    here = os.getcwd() + os.sep
    return [w[len(here):] if w.startswith(here) else w for w in words]


def ckpt_dir(cfg):
    return os.path.join(cfg.output_dir, "checkpoints")


def saved_checkpoints(cfg) -> list[str]:
    """The finished checkpoints' folder names (step_NNNNNN), oldest first."""
    root = ckpt_dir(cfg)
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("step_"))


def save_checkpoint(accelerator, cfg, step, unscored: int = 0):
    """Models, optimizers, schedulers and every process's RNG state (accelerate's save_state),
    and trainer_state.json (the step, the steps in a row before it that scored no dialogue, and
    the run's config), as checkpoints/step_NNNNNN. Every
    process learns the outcome, the main process's rename included: a process that raised alone
    would leave the others waiting in the next collective (on NCCL, for the whole timeout), and
    their nodes would not say why."""
    root = ckpt_dir(cfg)
    path = os.path.join(root, f"step_{step:06d}")
    outcome = None
    try:
        with written_atomically(path, owner=accelerator.is_main_process) as tmp:
            # The main process makes the folders (after removing a stale temporary one), the
            # others wait for it (prime-rl 2699: folders made by every process at once fail on
            # parallel file systems), and all learn whether it could.
            error = None
            if accelerator.is_main_process:
                try:
                    for folder in checkpoint_folders(accelerator, tmp):
                        os.makedirs(folder, exist_ok=True)
                except OSError as e:
                    error = e
            made = all_sum(torch.tensor(float(error is None), device=accelerator.device), accelerator).item()
            if error is not None:
                raise error
            if made < accelerator.num_processes:
                raise _FailedElsewhere("the main process could not make the checkpoint's folder")
            try:
                accelerator.save_state(tmp)
                if accelerator.is_main_process:
                    with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
                        json.dump({"step": step, "unscored": unscored, "config": dataclasses.asdict(cfg)}, f,
                                  indent=1)
            except Exception as e:  # e.g. this process's disk is full
                error = e
            # Every process writes its own files (RNG state, FSDP shards): all must have
            # finished, and all succeeded, before the main process publishes the folder by
            # renaming it (when this block ends).
            failed = all_sum(torch.tensor(float(error is not None), device=accelerator.device), accelerator).item()
            if error is not None:
                raise error
            if failed:
                raise _FailedElsewhere(f"{int(failed)} other process(es) could not write their part")
        if accelerator.is_main_process:
            for old in saved_checkpoints(cfg)[:-cfg.keep_last]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    except SaveError as e:
        outcome = e
    agree(accelerator, outcome, f"could not write {path}: the main process could not publish it")


def agree(accelerator, outcome, elsewhere: str):
    """After a save whose last step is the main process's alone (a checkpoint's rename, final/):
    every process learns whether it was done (one collective), and raises if not. `outcome`:
    this process's SaveError or None; `elsewhere`: what the others say. A main process that
    raised alone would leave the others waiting in the next collective (on NCCL, for the whole
    timeout), and their nodes would not say why."""
    failed = all_sum(torch.tensor(float(outcome is not None), device=accelerator.device), accelerator).item()
    if outcome is not None:
        raise outcome
    if failed:
        error = SaveError(elsewhere)
        error.elsewhere = True
        raise error


def checkpoint_folders(accelerator, tmp: str) -> list[str]:
    """The folders a checkpoint's processes write into: the checkpoint, and under FSDP the
    folder of each model's and optimizer's shards (accelerate's save_fsdp_model and
    save_fsdp_optimizer name them, and make them on every process, which is then a no-op)."""
    folders = [tmp]
    if accelerator.distributed_type == DistributedType.FSDP:
        folders += [os.path.join(tmp, f"{FSDP_MODEL_NAME}_{i}") for i in range(len(accelerator._models))]
        folders += [os.path.join(tmp, f"{OPTIMIZER_NAME}_{i}") for i in range(len(accelerator._optimizers))]
    return folders


def save_final(accelerator, policy, tok, path, dtype=None):
    """The policy in plain Hugging Face format (evaluate.py and transformers load it). Under
    FSDP the full state dict is gathered to the main process, which writes it. `dtype`: the
    dtype to save in, the training's compute dtype (bf16 under bf16 mixed precision, whose
    master weights are fp32: a 7B model would be 30 GB in fp32, and its config would say so),
    written into the config too; None: as the weights are. A LoRA policy is saved merged (the
    weights the engine gets, plumbing.lora.engine_weights), its adapter in final/adapter."""
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(policy)
    adapter = None
    if is_lora(model):  # LoRA: final/ is the merged model, final/adapter the adapter (PEFT's format)
        adapter, merged, on_cpu = adapter_state(model, accelerator.is_main_process), {}, {}
        for name, tensor in engine_weights(model, dtype or next(model.parameters()).dtype):  # on every process
            if accelerator.is_main_process:
                if id(tensor) not in on_cpu:  # a tied head stays one tensor
                    on_cpu[id(tensor)] = tensor.cpu()
                merged[name] = on_cpu[id(tensor)]
        state, model = merged, model.get_base_model()  # cast already
    else:
        state = accelerator.get_state_dict(policy)
    outcome = None
    if accelerator.is_main_process:
        if dtype is not None and adapter is None:
            cast = {}  # by storage: tied tensors (an embedding shared with the LM head) cast once, stay one
            for k, v in state.items():
                if v.is_floating_point():
                    if v.data_ptr() not in cast:
                        cast[v.data_ptr()] = v.to(dtype)
                    state[k] = cast[v.data_ptr()]
        try:
            _write_final(accelerator, policy, model, tok, state, path, dtype, adapter)
        except SaveError as e:
            outcome = e
    agree(accelerator, outcome, f"could not write {path}: the main process could not write it")


def _write_final(accelerator, policy, model, tok, state, path, dtype, adapter):
    """The main process's part of save_final: the folder, written whole or not at all."""
    with written_atomically(path) as tmp:  # a crash mid-save leaves the old final/ or none
        model.save_pretrained(tmp, state_dict=state)
        tok.save_pretrained(tmp)
        if adapter is not None:
            save_adapter(accelerator.unwrap_model(policy), adapter, os.path.join(tmp, "adapter"))
        if dtype is not None:  # save_pretrained writes the parameters' dtype (fp32) into config.json
            config_file = os.path.join(tmp, "config.json")
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
            config["dtype"] = str(dtype).removeprefix("torch.")
            with open(config_file, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")


def checkpoint_state(path: str) -> dict:
    """A checkpoint's trainer_state.json: {"step": the step to resume at, "unscored": the steps
    in a row before it that scored no dialogue (absent in older checkpoints), "config": the run's}."""
    with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)
    if not isinstance(state.get("step"), int):
        raise TypeError(f"{path}: trainer_state.json's step is not an integer: {state.get('step')!r:.40}")
    return state


def find_resume(cfg):
    if cfg.resume != "auto":
        return cfg.resume or None
    done = saved_checkpoints(cfg)
    if not done:
        return None
    return os.path.join(ckpt_dir(cfg), done[-1])


def resume_if_asked(accelerator, cfg) -> tuple[int, int]:
    """--resume: restore models, optimizers, schedulers and RNG states -> the step to start at
    (0 for a fresh run) and the steps in a row before it that scored no dialogue (train.py's
    --max-unscored-steps counts across resumes; 0 when the checkpoint does not say). Log rows
    and checkpoints of the steps after it are dropped (redone now): a fresh run in a folder that
    holds an earlier run's checkpoints must not keep them (its own step 10 would be pruned as
    the oldest, and a later --resume auto would load the old run's)."""
    resume = find_resume(cfg)
    if accelerator.num_processes > 1:  # the main process decides (file systems may lag)
        resume = broadcast_object_list([resume])[0]
    start = unscored = 0
    if resume:  # LoRA: the checkpoint holds the trainable tensors only (plumbing.lora.trainable_only)
        accelerator.load_state(resume, **({"strict": False} if cfg.lora_rank else {}))
        if cfg.lora_rank:
            check_restored(accelerator, resume)
        state = checkpoint_state(resume)
        start, unscored = state["step"], state.get("unscored")
        if not isinstance(unscored, int) or not 0 <= unscored <= start:  # saved before the count was kept
            if accelerator.is_main_process:
                log.warning("%s holds no count of unscored steps: --max-unscored-steps counts from step %d",
                            resume, start)
            unscored = 0
        if accelerator.is_main_process:
            log.info("resumed from %s at step %d", resume, start)
    outcome = None
    if accelerator.is_main_process:
        try:
            truncate_logs(cfg.output_dir, start)
        except SaveError as e:  # every process learns it (agree), not only the one that wrote
            outcome = e
        later = [d for d in saved_checkpoints(cfg) if int(d[5:]) > start]
        if later and outcome is None:
            log.warning("%s: removing the checkpoints after step %d (%s), an earlier run's: this run redoes "
                        "those steps", ckpt_dir(cfg), start, ", ".join(later))
            for d in later:
                shutil.rmtree(os.path.join(ckpt_dir(cfg), d), ignore_errors=True)
    agree(accelerator, outcome, f"could not rewrite the logs in {cfg.output_dir}: the main process could not")
    return start, unscored


def check_restored(accelerator, path: str):
    """A LoRA checkpoint is loaded with strict=False (it lacks the frozen base): each model's
    file must then hold exactly that model's trainable tensors, or nothing was restored into
    them (another process count under DDP names them module.*, other target modules other
    layers) while the optimizer's moments were. One line (InputError) on every process."""
    from safetensors import safe_open

    from plumbing.files import InputError
    for i, model in enumerate(accelerator._models):
        file = os.path.join(path, "model.safetensors" if i == 0 else f"model_{i}.safetensors")
        if not os.path.isfile(file):  # FSDP2: sharded, loaded whole and strictly
            continue
        with safe_open(file, "pt") as f:
            saved = set(f.keys())
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if saved != trainable:
            raise InputError(f"--resume {path}: {os.path.basename(file)} holds {len(saved)} tensors, "
                             f"{len(saved & trainable)} of them this run's {len(trainable)} trainable ones "
                             f"(e.g. {sorted(saved ^ trainable)[0]}): "
                             f"resume with the process count and --lora-target-modules it was saved with")


def truncate_logs(output_dir: str, step: int):
    """Keep only the rows of metrics.jsonl and samples.jsonl for steps < `step`: a resumed run
    redoes the later steps (step 0: a fresh run starts both empty). A row that does not parse,
    i.e. the last line cut by a kill, is dropped. Written to a temporary file and renamed, so a
    kill during this rewrite leaves the old file or the new one, never half of one."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(output_dir, name)
        if not os.path.exists(path):
            continue
        keep = []
        try:
            with open(path, "rb") as f:
                lines = f.readlines()
        except OSError as e:  # a read error (NFS's ESTALE, EIO, a folder in its place): one line on every process
            raise SaveError(f"could not read {path}: {e.strerror or e}") from e
        for line in lines:
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
                keep.append(line.rstrip(b"\n") + b"\n")
        with written_atomically(path) as tmp, open(tmp, "wb") as f:
            f.writelines(keep)
