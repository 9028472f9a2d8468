"""Several processes, for real: 2 CPU processes over gloo, DDP and FSDP2 (tests/cpu_launch.py
switches accelerate's CPU state to FSDP; everything else is accelerate's and torch's own code
running train.py unchanged)."""
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT

LAUNCH = os.path.join(ROOT, "tests", "cpu_launch.py")


def launch(mode, *argv, timeout=300):
    p = subprocess.run([sys.executable, LAUNCH, "--nproc", "2", "--mode", mode, "--timeout", str(timeout), "--", *argv],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_update_equals_one_process_update(mode, tmp_path):
    """The 2-process gradient is the 1-process gradient of the same rows (global token and
    sequence counts, global PPO whitening), also when one process holds only padding rows, and
    with LoRA adapters (issue 49: added before prepare, only they and the value head trained); the
    FSDP generation copy holds exactly the full weights and samples what one process samples;
    the final save loads with transformers and gives the in-memory model's logits."""
    out = tmp_path / "res.json"
    rc, log = launch(mode, "tests/mp_checks.py", str(out))
    assert rc == 0, log[-3000:]
    res = json.loads(out.read_text())
    assert len(res["grad_rel_l2"]) == 14 and sum(k.endswith("/lora") or "/lora/" in k for k in res["grad_rel_l2"]) == 6
    for case, d in res["grad_rel_l2"].items():
        assert d <= 1e-5, (case, d)
    assert res["copy_keys_match"] and res["copy_max_diff"] == 0.0
    assert res["same_generation"] and res["generated_tokens"] > 8
    assert res["saved_logits_diff"] <= 1e-6
    assert res["distributed_type"].endswith("FSDP" if mode == "fsdp2" else "MULTI_CPU")


def test_training_ends_without_the_gloo_exit_deadlock(tmp_path):
    """A 2-process DDP run ends: plumbing.distributed.end_training keeps the process group until
    the models are gone. With accelerate's end_training alone a DDP Reducer destroyed the group
    with the GIL held while gloo's worker waited for the GIL (CI: the DDP PPO resume below hung
    at exit; tests/mp_exit.py plain hangs in 3 of 3 launches here)."""
    rc, log = launch("ddp", "tests/mp_exit.py", "fixed", str(tmp_path), timeout=120)
    assert rc == 0, log[-3000:]
    assert log.count("rounds ended") == 2, log[-3000:]


# --minibatch-size counts scenarios of the whole step: 4 / 2 = 2 optimizer steps per rollout on
# any number of processes (and so the rollout's old log-probs are computed).
# A warmup over 3 of the 4 steps: the learning rate after step 0 is 2/3 of the peak on any
# number of processes (a prepared scheduler stepping once per process would reach the peak).
TINY = ["--batch-size", "4", "--minibatch-size", "2", "--max-new-tokens", "8", "--report-to", "none",
        "--save-every", "2", "--actor-lr", "1e-2", "--actor-warmup-ratio", "0.75", "--critic-warmup-ratio", "0.75"]
# Dialogues end at different turns on the two processes (a low start: some users give up after
# one turn, others play on), and per-turn samples give the processes different row counts, so
# padding rows and idle processes are exercised.
UNEVEN = ["--initial-emotion", "12", "--max-turns", "4"]


def final_weights(d):
    from safetensors.torch import load_file
    return load_file(os.path.join(d, "final", "model.safetensors"))


def metric_steps(d):
    return [json.loads(line)["step"] for line in open(os.path.join(d, "metrics.jsonl")) if line.strip()]


@pytest.mark.parametrize("mode,algo,extra", [
    ("fsdp2", "grpo", ["--group-size", "2", "--per-turn-samples", *UNEVEN]),
    ("ddp", "ppo", ["--group-size", "1", *UNEVEN]),
    ("ddp", "grpo", ["--group-size", "2", *UNEVEN, "--lora-rank", "4"]),  # issue 49: adapter-only checkpoints
    ("fsdp2", "ppo", ["--group-size", "1", *UNEVEN, "--lora-rank", "4"]),
])
def test_train_resume_equals_uninterrupted(mode, algo, extra, tmp_path):
    """train.py on 2 processes: a run resumed (--resume auto) from the step-2 checkpoint ends
    with exactly the weights of the uninterrupted run that wrote it."""
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    base = ["train.py", "--algo", algo, *TINY, *extra, "--steps", "4"]
    rc, log = launch(mode, *base, "--output-dir", full)
    assert rc == 0, log[-3000:]
    assert metric_steps(full) == [0, 1, 2, 3]  # one row per step: the processes stayed in step
    rows = [json.loads(line) for line in open(os.path.join(full, "metrics.jsonl"))]
    assert all(r["dialogues"] == 4 * (2 if algo == "grpo" else 1) for r in rows)  # summed, not averaged
    # A minibatch is minibatch_size x group_size rows of the whole step: a row is a dialogue, or
    # with per-turn samples an agent turn (issue 29: as the official think mode counts them).
    group = 2 if algo == "grpo" else 1
    for r in rows:
        rows_of_step = round(r["dialogues"] * r["turns"]) if "--per-turn-samples" in extra else r["dialogues"]
        assert r["optimizer_steps"] == math.ceil(rows_of_step / (2 * group)), r
    assert [r["lr"] for r in rows] == pytest.approx([1e-2 * 2 / 3, 1e-2, 1e-2, 1e-2])
    ck = sorted(os.listdir(os.path.join(full, "checkpoints")))
    assert ck == ["step_000002", "step_000004"]  # no temporary folder left behind
    # A run that stopped after its step-2 checkpoint: the same checkpoint, nothing after it.
    shutil.copytree(os.path.join(full, "checkpoints", "step_000002"), os.path.join(cut, "checkpoints", "step_000002"))
    rc, log = launch(mode, *base, "--output-dir", cut, "--resume", "auto")
    assert rc == 0, log[-3000:]
    assert "resumed from" in log and "at step 2" in log
    assert metric_steps(cut) == [2, 3]
    a, b = final_weights(full), final_weights(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if "--lora-rank" in extra:  # final/adapter, its tensors gathered whole (FSDP2: shard by shard), loads to final/
        from plumbing.models import load_policy
        merged = load_policy(os.path.join(full, "final", "adapter"))[0].state_dict()
        for k, v in a.items():
            assert torch.equal(merged[k], v), k


def test_a_checkpoint_one_process_cannot_write_ends_every_process_in_one_line(tmp_path):
    """Process 1's part of the step-1 checkpoint fails (a full disk): it said nothing, and the
    main process published the checkpoint without that part, or waited in the next collective
    for the launcher to kill it. Now each says so, the checkpoint is not published."""
    rc, log = launch("ddp", "tests/mp_save_fault.py", *TINY, "--steps", "2", "--save-every", "1",
                     "--output-dir", str(tmp_path), timeout=200)
    lines = [line[line.index("train.py: error:"):] for line in log.splitlines() if "train.py: error:" in line]
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert any("No space left on device" in line for line in lines), log[-3000:]
    assert all("step_000001" in line and "continue with:" in line for line in lines), lines
    # issue 41 item 7: the command that continues is the one that started the run, launcher
    # and all (it printed `accelerate launch train.py ...`: run as printed, another launch)
    assert all("continue with: python tests/cpu_launch.py --nproc 2 --mode ddp --timeout 200 -- "
               "tests/mp_save_fault.py --batch-size 4" in line
               and line.endswith("(steps after the checkpoint are done again)")
               for line in lines), lines
    assert not os.path.exists(tmp_path / "checkpoints" / "step_000001")


def test_fsdp2_ppo_runs_with_sharded_generation(tmp_path):
    """PPO (policy and critic: two FSDP2 models, one prepare call each) trains and saves, here
    with the fallback that generates from the sharded model (synced_gpus, dummy passes)."""
    rc, log = launch("fsdp2", "train.py", "--algo", "ppo", *TINY, "--group-size", "1", *UNEVEN,
                     "--steps", "2", "--no-gather-for-generation", "--output-dir", str(tmp_path))
    assert rc == 0, log[-3000:]
    assert metric_steps(str(tmp_path)) == [0, 1]
    assert os.path.isfile(tmp_path / "checkpoints" / "step_000002" / "trainer_state.json")


@pytest.mark.parametrize("precision,extra", [("no", []), ("bf16", []), ("no", ["--lora-rank", "4"])])
def test_fsdp1_is_refused_with_one_line(precision, extra, tmp_path):
    """Also under bf16 (a GPU's default): the fp32-reduce policy is FSDP2's, and given to FSDP1's
    plugin it was a traceback before the one-line refusal. Also with LoRA (issue 49)."""
    rc, log = launch("fsdp1", "train.py", *TINY, "--steps", "1", "--mixed-precision", precision, *extra,
                     "--output-dir", str(tmp_path))
    assert rc == 2, log[-3000:]
    lines = [line for line in log.splitlines() if "train.py: error:" in line]
    assert lines and all("fsdp_version: 1" in line for line in lines), log[-3000:]
    assert "Traceback" not in log


def test_every_process_has_joined_before_any_refuses(tmp_path, monkeypatch):
    """CI, round 5: FSDP1's refusal on 2 CPU processes once came with gloo's "Connection reset by
    peer" traceback: one process refused and exited while the other was still joining the
    process group. make_accelerator now meets the others (a barrier) before check_launch and
    the batch check can refuse. The race is a matter of milliseconds, so the order is checked."""
    import plumbing.distributed as dist
    from plumbing.checks import InputError
    from train import parse_args
    calls = []

    class Joined:  # what Accelerator() leaves: a process group of 2, FSDP1
        num_processes, distributed_type, is_fsdp2 = 2, dist.DistributedType.FSDP, False

        def __init__(self, **kw):
            calls.append("join")

        def wait_for_everyone(self):
            calls.append("meet")

    monkeypatch.setattr(dist, "Accelerator", Joined)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse_args([*TINY, "--output-dir", str(tmp_path)])
    with pytest.raises(InputError, match="fsdp_version: 1"):
        dist.make_accelerator(cfg)
    assert calls == ["join", "meet"]


def test_process_count_mismatch_is_refused(tmp_path):
    """`accelerate launch` with the GPU node's FSDP config on a machine without GPUs starts 2
    ranks, but accelerate falls back to one process per rank: refuse (each would otherwise
    train alone and all would append to one metrics file)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", os.path.join(ROOT, "configs", "fsdp_8gpu.yaml"),
           "--num_processes", "2", "--main_process_port", "0", "train.py", *TINY, "--steps", "1",
           "--output-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("train.py: error:")]
    assert p.returncode != 0
    assert len(errors) == 1, p.stderr[-3000:]  # the same on every rank: said once, by rank 0
    assert all("2 processes were launched (WORLD_SIZE) but accelerate sees 1" in line for line in errors)
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_slow_simulator_on_one_process_waits_within_the_process_group_timeout(tmp_path):
    """Issue 38 item 14: after each rollout the processes meet in collectives; one whose
    dialogues end early waits there for the other's simulator calls, and torch's timeout (10 min
    with NCCL) could end the job when a hosted simulator slows. The timeout is now derived from
    the rollout's worst case (or --process-group-timeout). Process 1's scenario makes the
    simulated user answer in 6 s, process 0's at once: with a 2-second timeout the waiting
    process gives up (the setting reaches the process group), with the derived one both finish."""
    from fake_openai import FakeOpenAIServer, default_user

    def slow_for_one(messages):
        if "SLOW-PERSONA" in messages[0]["content"]:
            time.sleep(6)
        return default_user(messages)
    scen = tmp_path / "two.jsonl"
    scen.write_text("".join(json.dumps({"id": f"s{i}", "persona": persona, "background": "Lost a job.",
                                        "hidden_goal": "advice", "first_message": "I lost my job."}) + "\n"
                            for i, persona in enumerate(["FAST-PERSONA", "SLOW-PERSONA"])))
    flags = ["train.py", "--algo", "ppo", "--group-size", "1", "--batch-size", "2", "--steps", "1", "--max-turns", "1",
             "--max-new-tokens", "4", "--scenarios", str(scen), "--simulator", "openai", "--simulator-model", "m",
             "--simulator-call-budget", "20", "--report-to", "none"]
    with FakeOpenAIServer(responder=slow_for_one) as srv:
        url = ["--simulator-base-url", srv.base_url]
        rc, log = launch("ddp", *flags, *url, "--process-group-timeout", "2", "--output-dir", str(tmp_path / "short"),
                         timeout=120)
        assert rc != 0 and not os.path.exists(tmp_path / "short" / "final"), log[-3000:]
        assert "a collective waits at most 2 s" in log
        rc, log = launch("ddp", *flags, *url, "--output-dir", str(tmp_path / "derived"), timeout=120)
    assert rc == 0, log[-3000:]
    # derived: 1 dialogue per process, 3 calls of at most 20 s: max(1800, 2 x 60 + 600)
    assert "a collective waits at most 1800 s" in log
    assert metric_steps(str(tmp_path / "derived")) == [0]


def test_the_process_group_timeout_is_the_rollouts_worst_case():
    """The derived timeout: a process's dialogues in waves of --simulator-concurrency, each
    making 2 x turns + 1 calls of at most --simulator-call-budget; twice that, plus 10 minutes,
    never below 30 minutes; the rule user makes no call; the flag wins."""
    import types

    from plumbing.distributed import process_group_timeout
    paper = types.SimpleNamespace(process_group_timeout=0.0, simulator="openai", batch_size=32, group_size=4,
                                  max_turns=8, simulator_concurrency=64, simulator_call_budget=300.0)
    os.environ["WORLD_SIZE"] = "8"
    try:  # 16 dialogues per process: one wave of 17 calls x 300 s = 5100 s, x 2 + 600
        assert process_group_timeout(paper) == 2 * 17 * 300 + 600
        os.environ["WORLD_SIZE"] = "1"  # 128 dialogues: two waves
        assert process_group_timeout(paper) == 2 * 2 * 17 * 300 + 600
    finally:
        del os.environ["WORLD_SIZE"]
    assert process_group_timeout(types.SimpleNamespace(**{**vars(paper), "simulator": "rule"})) == 1800
    assert process_group_timeout(types.SimpleNamespace(**{**vars(paper), "process_group_timeout": 90.0})) == 90


def test_fsdp2_under_bf16_reduces_gradients_in_fp32(tmp_path):
    """Issue 41 item 1: nothing set FSDP2's MixedPrecisionPolicy, and accelerate's default under
    bf16 reduces gradients in bf16 across the ranks. The policy train.py's accelerator gives a
    prepared model on 2 gloo processes: compute in bf16, reduce in fp32. Item 5: the weights it
    pushes to a bf16 vLLM engine are cast before they are gathered."""
    out = tmp_path / "policy.json"
    rc, log = launch("fsdp2", "tests/mp_precision.py", str(out), timeout=200)
    assert rc == 0, log[-3000:]
    got = json.loads(out.read_text())
    assert {k: got[k] for k in ("fsdp", "mixed_precision", "param_dtype", "reduce_dtype", "master")} == {
        "fsdp": True, "mixed_precision": "bf16", "param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32",
        "master": "torch.float32"}
    # Issue 41 item 5: the weight push to a bf16 engine gathers each fp32 shard cast to bf16
    # first (half the bytes), and hands vLLM whole tensors.
    assert got["gathers"] > 0 and got["gathered"] == ["torch.bfloat16"], got
    assert got["pushed"] == ["torch.bfloat16"] and got["pushed_whole"]
    # and --engine hf's bf16 generation copy is refreshed from bf16 gathers too
    assert got["copy_gathers"] > 0 and got["copy_gathered"] == ["torch.bfloat16"], got
