"""plumbing/distributed.py - several processes (FSDP2 / DDP through accelerate); a reader may skip it.

  make_accelerator      devices, mixed precision, the launch checked (FSDP2 only, the process
                        count accelerate sees)
  claim_output_dir      --output-dir made once, seen by every node (a shared file system), and
                        locked by every process; which node and host each process is on
  run_rollout           rollout.rollout with the model this process generates from: under FSDP
                        an unsharded copy gathered once per rollout (make_generation_copy)
  pad_to_equal_rows     every process runs as many forward/backward passes (each is a
                        collective under FSDP)
  gather_rollout_stats  the step's dialogue statistics over all processes
  reduce_stats          the update's statistics over all processes
With one process every function here is the identity or the plain call.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import datetime
import functools
import gc
import logging
import math
import os
import socket
import tempfile
import time
import uuid

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    broadcast_object_list,
    gather_object,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, register_fsdp_forward_method
from transformers import AutoModelForCausalLM

from plumbing.files import InputError, lock_output_dir, make_output_dir
from plumbing.logs import reply_measures, rollout_stats, trackers
from plumbing.lora import engine_weights, trainable_only
from rollout import rollout
from update import all_sum

log = logging.getLogger("train")


def make_accelerator(cfg):
    """-> (Accelerator, mixed precision "bf16" | "no", FSDP on?), the launch checked.

    step_scheduler_with_optimizer=False: a prepared scheduler otherwise advances once per
    PROCESS at each step (accelerate assumes the data loader's batch grew with the process
    count), which would make the warmup N times shorter on N processes."""
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() else "no"
    pg = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=process_group_timeout(cfg)))
    fsdp_plugin = None
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and os.environ.get("FSDP_VERSION") == "2" \
            and mp == "bf16":  # (FSDP1 is refused below, in one line: its plugin takes no such policy)
        # Compute in bf16, reduce gradients in fp32. accelerate's own policy under bf16 reduces
        # in bf16 too (param = reduce = bf16: utils/dataclasses.py, set_mixed_precision), and a
        # bf16 reduce-scatter over 8 or more ranks rounds away what the fp32 master weights are
        # there to keep at lr 1e-6 (verl reduces in fp32). Its config file has no key for it;
        # the rest of the plugin comes from the launcher's FSDP_* settings, as it would.
        fsdp_plugin = FullyShardedDataParallelPlugin(mixed_precision_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    accelerator = Accelerator(mixed_precision=mp, log_with=trackers(cfg), project_dir=cfg.output_dir,
                              step_scheduler_with_optimizer=False, kwargs_handlers=[pg], fsdp_plugin=fsdp_plugin)
    # Meet before any refusal below: a process that refuses and exits while another is still
    # joining the process group ends that one's join with gloo's "Connection reset by peer", a
    # traceback beside the one-line error (seen in CI: FSDP1's refusal on 2 CPU processes).
    accelerator.wait_for_everyone()
    check_launch(accelerator)
    if cfg.lora_rank:  # checkpoints hold the adapters and value head, not the frozen base
        accelerator.register_save_state_pre_hook(trainable_only)
    if cfg.batch_size % accelerator.num_processes:
        raise InputError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes "
                         f"({accelerator.num_processes})")
    return accelerator, mp, accelerator.distributed_type == DistributedType.FSDP


def process_group_timeout(cfg) -> float:
    """Seconds a process may wait for the others at a collective (--process-group-timeout, else
    derived). After each rollout the processes meet (pad_to_equal_rows, the stats): one whose
    dialogues ended early waits there for the slowest process's simulator calls. torch's default
    (10 min with NCCL; accelerate passes none) is shorter than a slow hosted simulator can take,
    and the NCCL watchdog would end the job. Derived from the rollout's worst case: a process's
    dialogues in waves of --simulator-concurrency, each making at most 2 x --max-turns + 1 calls
    (an opening, then an appraisal and an answer per turn) of at most --simulator-call-budget
    seconds; twice that, plus 10 minutes for generation and the update, and never below TRL's
    default of 30 minutes (the offline rule user makes no call: 30 minutes). The flags' ranges
    are checked before (plumbing.checks.FLOAT_RANGES, through validate)."""
    if cfg.process_group_timeout > 0:
        return float(cfg.process_group_timeout)
    if cfg.simulator == "rule":
        return 1800.0
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    dialogues = math.ceil(cfg.batch_size * cfg.group_size / processes)
    waves = math.ceil(dialogues / cfg.simulator_concurrency)
    worst = waves * (2 * cfg.max_turns + 1) * cfg.simulator_call_budget
    return max(1800.0, 2 * worst + 600.0)


def check_launch(accelerator):
    """Refuse launches that would silently train wrong.
    - accelerate sees fewer processes than were launched: it fell back to one process per rank
      (an FSDP or multi-GPU config on a machine without GPUs), so every process would train
      alone on its own data and all would append to the same metrics file.
    - FSDP1 (fsdp_version: 1): it replaces the parameters after the optimizer is built, so the
      optimizer would hold stale tensors; this project supports FSDP2 (fully_shard) only."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise InputError(f"{launched} processes were launched (WORLD_SIZE) but accelerate sees "
                         f"{accelerator.num_processes}: it found no GPU for this config; launch on GPUs, "
                         f"or set use_cpu: true / pass --cpu to accelerate launch")
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise InputError("fsdp_version: 1 in the accelerate config is not supported; "
                         "set fsdp_config.fsdp_version: 2 (FSDP2, as configs/fsdp_8gpu.yaml)")


_KEPT = []  # process groups end_training keeps alive until exit (see there)


def end_training(accelerator, engine=None):
    """Close the vLLM engine (if any) and end training (accelerator.end_training()), with the
    process group kept alive until the models are gone. A DDP model's Reducer holds the process
    group, and when the Reducer drops the last reference the group is destroyed with the GIL
    held: gloo's destructor joins its worker threads, and a worker still freeing the last
    collective's tensors waits for the GIL. Both wait forever (a race; pytorch issue 56297; in CI
    a 2-process DDP PPO resume hung as train() returned). So the group's last reference is a
    Python one, taken before the engine's cleanup tears the group down, and dropped at exit after
    the models (release_kept_groups: a Python reference is let go with the GIL released)."""
    if torch.distributed.is_initialized():
        _KEPT.append(torch.distributed.group.WORLD)
    if engine is not None:  # after the last collective: vLLM's cleanup tears down the process group
        engine.close()
    accelerator.end_training()


@atexit.register
def release_kept_groups():
    gc.collect()  # the models first (a model can sit in a reference cycle)...
    _KEPT.clear()  # ...then the groups


def node_of(rank: int) -> int:
    """The node a process runs on: torchrun gives node K the ranks K x P .. K x P + P - 1 (P =
    LOCAL_WORLD_SIZE processes per node). With the static rendezvous (docs/MULTI_GPU.md) K is
    the machine rank; with c10d, the order in which the nodes joined."""
    return rank // processes_per_node()


def processes_per_node() -> int:
    """P: the launcher's LOCAL_WORLD_SIZE; without one, every process is on this node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def first_on_node() -> bool:
    """Is this the first process of its node (LOCAL_RANK 0)? It says a launch's one-line errors
    on its node: a user reading node 1's log learns why node 1 stopped. Also without a launcher."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


SEEN_WAIT = 10.0  # seconds a process looks for the main process's marker (file systems lag)


def claim_output_dir(accelerator, path: str):
    """--output-dir for this launch -> this process's lock (keep it referenced); InputError (one
    line, on every process) when it cannot be used.

    Several processes, several nodes: what goes wrong on clusters (ours to prevent, each seen in
    the libraries' issues):
    - Made once. Only the main process creates the folder; the others wait (one collective). A
      folder made by every process at once (os.makedirs(exist_ok=True)) fails on parallel file
      systems whose metadata lags: EEXIST, then "not a folder" (prime-rl 2699, NeMo 3686).
    - Seen by every node. The main process writes a marker named by a random token; every process
      looks for it (up to SEEN_WAIT seconds: NFS caches lookups) and all agree (one gather).
      A node that does not see it has its own disk there (a relative --output-dir on node-local
      storage): the checkpoints would be the main node's alone (each node would hold only its
      processes' RNG states and shards, never renamed; accelerate 3010: a sharded checkpoint's
      .metadata is written by rank 0 only), and --resume would fail on the others. Refused,
      naming the nodes.
    - Locked (plumbing.checks.lock_output_dir, a file per rank): the main process first, then
      the others, each outcome agreed: a second launch on the same folder stops on every process
      together, even when only some of its ranks clash with the first run's (a launch of another
      size), and of two launches started at once one runs. A lock file this process cannot open
      (another user's) is one line too.
    Each node's first process logs which ranks and host it runs and where the main process is:
    with a c10d rendezvous rank 0 is not always on the host given (pytorch 150660)."""
    if accelerator.num_processes == 1:
        make_output_dir("--output-dir", path)
        return lock_output_dir(path)
    problem = token = None
    if accelerator.is_main_process:
        token = uuid.uuid4().hex
        try:
            make_output_dir("--output-dir", path)
            with open(os.path.join(path, f".shared-check-{token}"), "w", encoding="utf-8") as f:
                f.write(token)
        except InputError as e:
            problem = str(e)
        except OSError as e:
            problem = f"--output-dir {path}: cannot write there ({e.strerror or e})"
    problem, token, main_host = broadcast_object_list([problem, token, socket.gethostname()])
    if problem:
        raise InputError(problem)
    mine = None if _sees(path, token) else "blind"
    if mine is None:
        try:
            tempfile.TemporaryFile(dir=path).close()
        except OSError as e:
            mine = f"--output-dir {path}: cannot write there on host {socket.gethostname()} ({e.strerror or e})"
    views = gather_object([(accelerator.process_index, mine)])  # all have looked: the marker goes
    if accelerator.is_main_process:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(path, f".shared-check-{token}"))
    blind = sorted({node_of(rank) for rank, seen in views if seen == "blind"})
    if blind:
        nodes = f"node {blind[0]} does" if len(blind) == 1 else f"nodes {', '.join(map(str, blind))} do"
        raise InputError(
            f"--output-dir {path}: {nodes} not see the files the main process (node 0, host {main_host}) "
            f"writes there, so it is on each node's own disk: the checkpoints could not be resumed from on "
            f"every node; put --output-dir on a file system all nodes share (NFS, Lustre, ...), the same path "
            f"on each")
    other = next((seen for _, seen in views if seen), None)
    if other:
        raise InputError(other)
    lock = None
    for turn in ("main", "others"):  # the main process's lock decides which of two launches runs
        error = None
        if accelerator.is_main_process == (turn == "main"):
            try:
                lock = lock_output_dir(path)
            except InputError as e:
                error = str(e)
            except OSError as e:
                error = f"--output-dir {path}: cannot lock {e.filename or path} ({e.strerror or e})"
        errors = [e for e in gather_object([error]) if e]
        if errors:
            if lock is not None:
                lock.close()
            raise InputError(errors[0])
    per = processes_per_node()
    nodes = accelerator.num_processes // per
    if nodes > 1 and first_on_node():
        node = node_of(accelerator.process_index)
        log.info("node %d of %d: ranks %d-%d on host %s; the main process (rank 0: metrics.jsonl, samples.jsonl, "
                 "final/ and the checkpoints' renames; every process writes its own part of a checkpoint) runs "
                 "on host %s; --output-dir %s is shared", node, nodes, node * per,
                 node * per + per - 1, socket.gethostname(), main_host, path)
    return lock


def _sees(path: str, token: str) -> bool:
    """Does this process find the main process's marker in `path` (within SEEN_WAIT seconds)?"""
    deadline = time.time() + SEEN_WAIT
    while True:
        try:
            with open(os.path.join(path, f".shared-check-{token}"), encoding="utf-8") as f:
                if f.read() == token:
                    return True
        except OSError:
            pass
        if time.time() > deadline:
            return False
        time.sleep(0.5)


def make_generation_copy(model, device, dtype):
    """An unsharded copy of the policy for generation (built once; refreshed every rollout).

    Why: FSDP keeps 1/N of every weight on each GPU. Calling `generate` on the sharded model
    all-gathers every layer at EVERY decoding step (for a 7B policy about 15 GB moved per
    generated token across the node) and needs `synced_gpus`, so a process whose dialogues
    ended must keep joining with dummy forward passes. Gathering the weights ONCE per rollout
    into a plain copy costs one all-gather per tensor, and then every process generates alone,
    with no collectives, at single-GPU speed. The price: one full policy per GPU (about 15 GB
    for a 7B model in bf16); `--no-gather-for-generation` falls back to sharded generation."""
    # In the compute dtype (bf16 on GPU; the FSDP master weights are fp32), directly on the GPU;
    # from a copy of the config (from_config would otherwise rewrite the policy's config.dtype).
    with torch.device(device):
        gen_copy = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype)
    gen_copy.generation_config = model.generation_config
    return gen_copy.requires_grad_(False).eval()


def refresh_generation_copy(model, gen_copy):
    """Copy the current policy weights into the generation copy: one all-gather per sharded
    tensor (DTensor.full_tensor), streamed, so at most one full tensor is in flight. Each shard
    is cast to the copy's dtype before it is gathered (bf16 on a GPU: half the bytes of the fp32
    master weights, the same values once copied), a LoRA policy's adapted weights merged out of
    place: the weights VLLMEngine.push sends (plumbing.lora.engine_weights)."""
    dst = gen_copy.state_dict()
    dtype = next(gen_copy.parameters()).dtype
    seen = set()
    with torch.no_grad():
        for name, tensor in engine_weights(model, dtype):
            if name not in dst:
                raise RuntimeError(f"generation copy does not match the policy: no {name}")
            dst[name].copy_(tensor)
            seen.add(name)
    if seen != dst.keys():
        raise RuntimeError(f"generation copy does not match the policy: {sorted(dst.keys() - seen)[:4]}")


@contextlib.contextmanager
def generation_mode(accelerator, model):
    """Yield (module to call .generate on, extra generate kwargs) for sharded generation
    (`--no-gather-for-generation`), or for one process / DDP (the model itself).

    FSDP2 does not gather parameters for `generate()` (it is not `forward`): register
    `generate` as a forward method, and pass `synced_gpus=True` so a rank that finished keeps
    running forward passes until all have (each forward is a collective; otherwise ranks
    deadlock; rollout's `any_active` does the same between turns). Gradient checkpointing is
    switched off while generating (it disables the KV cache)."""
    unwrapped = accelerator.unwrap_model(model)
    gc_on = getattr(unwrapped, "is_activation_checkpointing", None)  # transformers >= 5 name
    if gc_on is None:
        gc_on = getattr(unwrapped, "is_gradient_checkpointing", False)
    if gc_on:
        unwrapped.gradient_checkpointing_disable()
    try:
        if accelerator.distributed_type == DistributedType.FSDP:
            if not getattr(model, "_generate_registered", False):  # once: it wraps `generate`
                register_fsdp_forward_method(model, "generate")
                model._generate_registered = True
            yield model, {"synced_gpus": accelerator.num_processes > 1}
        else:
            yield unwrapped, {}
    finally:
        if gc_on:
            unwrapped.gradient_checkpointing_enable()


def run_rollout(accelerator, policy, gen_copy, tok, sim, scenarios, group_size, think, cfg, engine=None, seed=0):
    """rollout.rollout with the model this launch generates from: the vLLM engine (its weights
    refreshed first), or the gathered copy under FSDP (make_generation_copy), else the policy
    itself (one process, DDP, or FSDP's sharded model with --no-gather-for-generation, see
    generation_mode). `cfg` is the rollout.RolloutConfig."""
    policy.eval()
    if engine is not None:  # vLLM: each dialogue on its own; the engine's memory freed afterwards
        engine.push(accelerator.unwrap_model(policy))
        batch = rollout(None, tok, sim, scenarios, group_size, think, cfg, engine=engine, seed=seed)
        engine.sleep()
        return batch
    if gen_copy is not None:  # FSDP: gather the weights once, then generate with no collectives
        refresh_generation_copy(accelerator.unwrap_model(policy), gen_copy)
        return rollout(gen_copy, tok, sim, scenarios, group_size, think, cfg)
    any_active = None
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1:
        # Every forward pass of a sharded model is a collective: a process whose dialogues have
        # all ended keeps joining them until no process has one left (rollout asks each turn).
        any_active = functools.partial(any_process_active, accelerator)
    with generation_mode(accelerator, policy) as (gen_model, gen_kwargs):
        return rollout(gen_model, tok, sim, scenarios, group_size, think, cfg, generate_kwargs=gen_kwargs,
                       any_active=any_active)


def sampler_mismatch(accelerator, batch) -> dict:
    """How far the generation engine's log-probs of the sampled tokens are from the trainer's
    (the batch's old_logprobs, at the same temperature): mean and max |difference| over all
    processes' sampled tokens (verl logs it as rollout_probs_diff)."""
    mask = batch.loss_mask.bool()
    diff = torch.zeros(0, dtype=torch.float64)
    if batch.old_logprobs is not None and batch.sampler_logprobs is not None:  # else no row here (all failed)
        diff = (batch.old_logprobs - batch.sampler_logprobs).abs()[mask].double()
    t = torch.tensor([float(diff.sum()), float(len(diff))], dtype=torch.float64, device=accelerator.device)
    top = torch.tensor([float(diff.max()) if len(diff) else 0.0], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
        top = accelerator.gather(top)
    total, count = t.tolist()
    return {"sampler_logprob_diff_mean": total / count if count else None,
            "sampler_logprob_diff_max": float(top.max()) if count else None}


def any_process_active(accelerator, mine_active: bool) -> bool:
    """Does any process still have a dialogue running? (one all-reduce)"""
    return bool(all_sum(torch.tensor([float(mine_active)]), accelerator).item() > 0)


def pad_to_equal_rows(accelerator, batch, pad_id: int):
    """Every process must run the same number of forward/backward passes (under FSDP each is a
    collective): pad this process's batch to the largest row count of any process, with rows
    whose loss mask is all zero (they add exactly nothing to the gradient; pad_rows)."""
    if accelerator.num_processes == 1:
        return batch
    rows = accelerator.gather(torch.tensor([len(batch)], device=accelerator.device)).max().item()
    return pad_rows(batch, int(rows), pad_id)


def pad_rows(batch, n: int, pad_id: int):
    """The batch with rows appended up to n: an all-zero loss mask, each its own group and
    dialogue. A padding row takes part in the forward/backward passes and contributes exactly
    zero gradient."""
    k = n - len(batch)
    if k <= 0:
        return batch
    T = max(batch.input_ids.shape[1], 2)
    am = _add_rows(batch.attention_mask, k, T, 0)
    am[len(batch):, :2] = 1  # two real (padding) tokens so a forward pass is well defined
    new_ids = torch.arange(k)  # ids no real row has: after the largest
    first_group = int(batch.group_ids.max()) + 1 if len(batch) else 0
    first_dialogue = int(batch.dialogue_ids.max()) + 1 if len(batch) else 0
    return dataclasses.replace(
        batch, input_ids=_add_rows(batch.input_ids, k, T, pad_id), attention_mask=am,
        loss_mask=_add_rows(batch.loss_mask, k, T, 0), old_logprobs=_add_rows(batch.old_logprobs, k, T, 0.0),
        ref_logprobs=_add_rows(batch.ref_logprobs, k, T, 0.0),
        sampler_logprobs=_add_rows(batch.sampler_logprobs, k, T, 0.0),
        rewards=torch.cat([batch.rewards, torch.zeros(k)]),
        group_ids=torch.cat([batch.group_ids, first_group + new_ids]),
        dialogue_ids=torch.cat([batch.dialogue_ids, first_dialogue + new_ids]))


def _add_rows(x, k: int, T: int, value):
    """[N, T'] -> [N + k, T]: every row right-padded with `value` to T columns, then k rows of
    `value` appended. None (log-probs not computed) stays None."""
    if x is None:
        return None
    x = F.pad(x, (0, T - x.shape[1]), value=value)
    return torch.cat([x, torch.full((k, T), value, dtype=x.dtype)])


def gather_rollout_stats(accelerator, batch) -> dict:
    """rollout_stats over the dialogues of ALL processes (each played its own slice): the
    per-dialogue numbers are gathered, so means are over all dialogues and `dialogues` /
    `simulator_errors` are totals (a mean of per-process means would be wrong when the
    processes hold different numbers of valid dialogues)."""
    # What the replies look like travels as numbers (reply_measures), not as the dialogues' text.
    light = [{**{k: v for k, v in m.items() if k not in ("history", "agent_texts")},
              "replies": reply_measures(m["history"], m.get("goal_type", "")) if m["valid"] else []}
             for m in batch.metrics]
    if accelerator.num_processes > 1:
        light = gather_object(light)
    return rollout_stats(dataclasses.replace(batch, metrics=light))


def reduce_stats(accelerator, stats: dict, summed) -> dict:
    """Per-process numbers -> one row over all processes. For the keys in `summed`, the total
    (counts; a loss, since each process's loss is its share of the global loss: its sum / the
    global count); else the mean over the processes that have a value (None: no value there;
    it stays None when no process has one). Gradient norms are already global (clipping sees the
    synchronised gradients), so their mean is that value; so is a count every process shares
    (optimizer_steps), which stays an integer."""
    if accelerator.num_processes == 1:
        return stats
    keys = sorted(stats)
    t = torch.tensor([[float(stats[k] or 0.0), float(stats[k] is not None)] for k in keys],
                     dtype=torch.float64, device=accelerator.device)
    t = accelerator.reduce(t, reduction="sum").tolist()
    out = {}
    for k, (total, n_values) in zip(keys, t):
        if k in summed:
            value = total
        elif n_values:
            value = total / n_values
        else:
            value = None
        if isinstance(stats[k], int) and value is not None and float(value).is_integer():
            value = int(value)
        out[k] = value
    return out
