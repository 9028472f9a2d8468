"""Several nodes, rehearsed on one machine: tests/cpu_launch.py --nnodes 2 starts one launcher
per node, as `accelerate launch --num_machines 2 --machine_rank K` on two hosts, each with its
processes (global RANK, LOCAL_RANK within the node, the node's rank) over gloo on 127.0.0.1.
--node-local-dirs gives each node its own working directory, so a relative --output-dir is a
different disk per node. What goes wrong on clusters, each from the libraries' issues: a file
written by every node (transformers 27925, LlamaFactory 176), folders made by every process at
once (accelerate 1760, prime-rl 2699), a checkpoint only one node has (accelerate 3010), a node
that stops without saying why."""
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from conftest import ROOT
from test_multiprocess import TINY, UNEVEN, final_weights, metric_steps

LAUNCH = os.path.join(ROOT, "tests", "cpu_launch.py")


def launch_nodes(mode, nproc, *argv, local_dirs=None, audit=None, timeout=300, env=None):
    cmd = [sys.executable, LAUNCH, "--nnodes", "2", "--nproc", str(nproc), "--mode", mode, "--timeout", str(timeout)]
    if local_dirs:
        cmd += ["--node-local-dirs", str(local_dirs)]
    if audit:
        cmd += ["--audit-writes", str(audit)]
    p = subprocess.run([*cmd, "--", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout + 90,
                       env={**os.environ, **(env or {})})
    return p.returncode, p.stdout + p.stderr


def error_lines(log):
    return [line[line.index("train.py: error:"):] for line in log.splitlines() if "train.py: error:" in line]


def writers(audit, out):
    """From the processes' audit records: {path under `out`: the ranks that wrote, renamed onto
    or removed it}, and the folders a process other than the main one made (that did not exist)."""
    by_path, made_elsewhere = defaultdict(set), []
    for name in os.listdir(audit):
        for line in open(os.path.join(audit, name), encoding="utf-8"):
            e = json.loads(line)
            if not (e["path"] + os.sep).startswith(str(out) + os.sep):
                continue
            if e["op"] == "mkdir":
                if not e["existed"] and e["rank"] != 0:
                    made_elsewhere.append(e)
            else:
                by_path[e["path"]].add(e["rank"])
    return by_path, made_elsewhere


@pytest.mark.parametrize("mode,nproc,algo,extra", [
    ("fsdp2", 2, "grpo", ["--group-size", "2", "--per-turn-samples", *UNEVEN]),
    ("ddp", 1, "ppo", ["--group-size", "1", *UNEVEN]),
])
def test_two_nodes_on_a_shared_output_dir_write_each_file_once_and_resume_exactly(mode, nproc, algo, extra, tmp_path):
    """Issue 48 items 1-2. One --output-dir for both nodes (a shared file system): every file
    under it has one writer (metrics, samples, the locks, each checkpoint's files and renames,
    final/), every folder is made by the main process before the others write into it (on
    a9f81d0 every process made the output folder and the FSDP checkpoint's folders at once),
    each step's row is written once, each node says which ranks and host it runs and where the
    main process is; resumed from the step-2 checkpoint, the run ends with exactly the weights of
    the uninterrupted run."""
    full, cut, audit = tmp_path / "full", tmp_path / "cut", tmp_path / "audit"
    audit.mkdir()
    base = ["train.py", "--algo", algo, *TINY, *extra, "--steps", "4"]
    rc, log = launch_nodes(mode, nproc, *base, "--output-dir", str(full), audit=audit)
    assert rc == 0, log[-3000:]
    assert metric_steps(full) == [0, 1, 2, 3]
    assert [json.loads(line)["step"] for line in open(full / "samples.jsonl")] == [0, 1, 2, 3]
    rows = [json.loads(line) for line in open(full / "metrics.jsonl")]
    assert all(r["dialogues"] == 4 * (2 if algo == "grpo" else 1) for r in rows)  # all 2 x nproc processes
    by_path, made_elsewhere = writers(audit, full)
    assert not made_elsewhere, made_elsewhere[:3]
    several = {p: ranks for p, ranks in by_path.items() if len(ranks) > 1}
    assert not several, several
    written = {os.path.relpath(p, full) for p in by_path}
    assert {"metrics.jsonl", "samples.jsonl", ".lock", f".lock-{2 * nproc - 1}", "final"} <= written, written
    assert any(p.startswith("checkpoints/.tmp-step_000004/") for p in written)  # each process's part, seen
    assert sorted(os.listdir(full / "checkpoints")) == ["step_000002", "step_000004"]
    assert not [n for n in os.listdir(full) if n.startswith(".shared-check")]
    for k in (0, 1):
        assert f"node {k} of 2: ranks {k * nproc}-{k * nproc + nproc - 1} on host" in log, log[-3000:]
    shutil.copytree(full / "checkpoints" / "step_000002", cut / "checkpoints" / "step_000002")
    rc, log = launch_nodes(mode, nproc, *base, "--output-dir", str(cut), "--resume", "auto")
    assert rc == 0, log[-3000:]
    assert "resumed from" in log and "at step 2" in log
    assert metric_steps(cut) == [2, 3]
    a, b = final_weights(str(full)), final_weights(str(cut))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_an_output_dir_on_each_nodes_own_disk_is_refused_at_start(tmp_path):
    """Issue 48 item 3. A relative --output-dir on node-local disks: on a9f81d0 the run trained,
    node 0 alone held the checkpoints, and `--resume auto` ended node 1 in a traceback ("Tried to
    find runs/x/checkpoints/step_000002 but folder does not exist"). Now every node refuses at
    start in one line naming the node that does not see the main process's files, before any
    model is loaded; no file is left on either disk (the marker removed)."""
    rc, log = launch_nodes("ddp", 2, "train.py", *TINY, "--steps", "2", "--output-dir", "runs/x",
                           local_dirs=tmp_path)
    lines = error_lines(log)
    assert rc == 2 and "Traceback" not in log, log[-3000:]
    assert len(lines) == 2, lines  # one per node (its first process)
    assert all("--output-dir runs/x: node 1 does not see the files the main process (node 0" in line
               and "a file system all nodes share" in line for line in lines), lines
    for k in (0, 1):
        left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / f"node-{k}") for f in fs]
        assert not left, left


def test_a_second_launch_on_a_shared_output_dir_is_refused_on_every_node(tmp_path):
    """Issue 48 item 4. Another run of another size holds the folder (here: the locks of its
    ranks 0 and 1): the new launch's ranks 0 and 1 clash, its ranks 2 and 3 do not. On a9f81d0
    those two went on alone and node 1 stopped without a word when they were ended; now every
    process stops together and each node says why."""
    held = []
    for name in (".lock", ".lock-1"):
        f = open(tmp_path / name, "a+")
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write(str(os.getpid()))
        f.flush()
        held.append(f)
    rc, log = launch_nodes("ddp", 2, "train.py", *TINY, "--steps", "2", "--output-dir", str(tmp_path), timeout=120)
    lines = error_lines(log)
    assert rc == 2 and "Traceback" not in log, log[-3000:]
    assert len(lines) == 2 and all(f"in use by another run (pid {os.getpid()})" in line for line in lines), lines
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_failed_save_prints_each_nodes_own_resume_command(tmp_path):
    """Issue 48 item 4. Process 1 (node 0) cannot write its part of the step-1 checkpoint. Each
    node says it, with the command that continues on that node: its own launcher's, with its
    machine rank (on a9f81d0 node 1 said nothing)."""
    rc, log = launch_nodes("ddp", 2, "tests/mp_save_fault.py", *TINY, "--steps", "2", "--save-every", "1",
                           "--output-dir", str(tmp_path), timeout=200)
    lines = error_lines(log)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    for k in (0, 1):
        mine = [line for line in lines if f"cpu_launch.py --nnodes 2 --node-rank {k} --nproc 2 --mode ddp" in line]
        assert mine and all("step_000001" in line and "continue with: python" in line and
                            "-- tests/mp_save_fault.py --batch-size 4" in line and line.endswith("--resume auto (steps "
                            "after the checkpoint are done again)") for line in mine), lines
    assert any("No space left on device" in line for line in lines), lines
    assert not os.path.exists(tmp_path / "checkpoints" / "step_000001")


def test_a_checkpoint_the_main_process_cannot_publish_ends_every_node_in_one_line(tmp_path):
    """The main process's rename of a finished checkpoint fails (a quota): on ff8b164 it alone
    said so, and node 1 waited in the next collective (a gloo traceback here; on NCCL, the whole
    process-group timeout). Every process learns the outcome; each node says it, with its own
    command."""
    rc, log = launch_nodes("ddp", 1, "tests/mp_save_fault.py", *TINY, "--steps", "2", "--save-every", "1",
                           "--output-dir", str(tmp_path), timeout=200, env={"RLVER_TEST_FAULT": "publish"})
    lines = error_lines(log)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert len(lines) == 2, lines
    assert any("Disk quota exceeded" in line and "--node-rank 0" in line for line in lines), lines
    assert any("the main process could not publish it" in line and "--node-rank 1" in line for line in lines), lines
    assert not os.path.exists(tmp_path / "checkpoints" / "step_000001")


def test_a_lock_file_one_rank_cannot_open_is_one_line_on_every_node(tmp_path):
    """Rank 1's lock file cannot be opened (here a folder in its place; another user's file
    would be EACCES): on ff8b164 rank 1 raised a traceback and rank 0 waited in a collective."""
    (tmp_path / ".lock-1").mkdir()
    rc, log = launch_nodes("ddp", 1, "train.py", *TINY, "--steps", "1", "--output-dir", str(tmp_path), timeout=120)
    lines = error_lines(log)
    assert rc == 2 and "Traceback" not in log, log[-3000:]
    assert len(lines) == 2 and all("cannot lock" in line and ".lock-1" in line for line in lines), lines


def test_a_final_model_the_main_process_cannot_write_ends_every_node_in_one_line(tmp_path):
    """The same for final/ (plumbing.checkpoints.save_final, written by the main process alone):
    on 5656ea2 node 1 waited in a collective while node 0 said why."""
    rc, log = launch_nodes("ddp", 1, "tests/mp_save_fault.py", *TINY, "--steps", "1", "--output-dir", str(tmp_path),
                           timeout=200, env={"RLVER_TEST_FAULT": "final"})
    lines = error_lines(log)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert len(lines) == 2, lines
    assert any("Disk quota exceeded" in line and "--node-rank 0" in line for line in lines), lines
    assert any("the main process could not write it" in line and "--node-rank 1" in line for line in lines), lines
    assert all("step_000001 (after step 1)" in line for line in lines), lines
    assert not os.path.exists(tmp_path / "final")


@pytest.mark.parametrize("fault", ["metrics", "truncate"])
def test_logs_the_main_process_cannot_write_end_every_node_in_one_line(fault, tmp_path):
    """Faults round six, item 3: the main process cannot append to metrics.jsonl (a full disk),
    or cannot put back the logs a resume cuts to its step: node 0 said why and node 1 ended in a
    gloo traceback ("Connection closed by peer"; on NCCL it would wait out the process-group
    timeout). Every process learns the outcome; each node says it in one line, exit 1."""
    if fault == "truncate":  # a checkpoint and logs to resume from
        rc, log = launch_nodes("ddp", 1, "train.py", *TINY, "--steps", "1", "--output-dir", str(tmp_path),
                               timeout=200)
        assert rc == 0, log[-3000:]
    rc, log = launch_nodes("ddp", 1, "tests/mp_save_fault.py", *TINY, "--steps", "2", "--output-dir", str(tmp_path),
                           *(["--resume", "auto"] if fault == "truncate" else []), timeout=200,
                           env={"RLVER_TEST_FAULT": fault})
    lines = error_lines(log)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert len(lines) == 2, lines
    assert any("No space left on device" in line or "Disk quota exceeded" in line for line in lines), lines
    assert any("the main process could not" in line and "--node-rank 1" in line for line in lines), lines
    assert not os.path.exists(tmp_path / "final") or fault == "truncate"


def test_the_rehearsal_launches_with_the_slurm_recipes_arguments():
    """Faults round six, item 9: the recipe relied on the config file's `same_network: true`,
    which accelerate never applies (its --same_network defaults to False, not None), while the
    rehearsal passed --same_network itself: two routes. The FSDP2 rehearsal now launches with the
    recipe's arguments, flag for flag and value for value (the SLURM variables as node 1 of 2
    expands them), --mixed_precision no aside (CPU processes); the config file holds no
    same_network key."""
    import shlex

    import yaml

    from cpu_launch import DEFAULT_CONFIG, launch_argv

    def pairs(argv):  # {flag: its value, or None for a switch}
        return {a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
                for i, a in enumerate(argv) if a.startswith("--")}
    doc = open(os.path.join(ROOT, "docs", "MULTI_GPU.md"), encoding="utf-8").read()
    recipe = doc[doc.index("srun bash -c 'accelerate launch") + len("srun bash -c 'accelerate launch"):]
    recipe = recipe[:recipe.index("train.py")].replace("\\\n", " ")
    for var, value in (("$((8 * SLURM_NNODES))", "4"), ("$SLURM_NNODES", "2"), ("$SLURM_NODEID", "1"),
                       ("$MAIN_IP", "127.0.0.1"), ("configs/fsdp_8gpu.yaml", DEFAULT_CONFIG)):
        recipe = recipe.replace(var, value)
    rehearsal = pairs(launch_argv("fsdp2", 2, DEFAULT_CONFIG, 2, 1, 29500))
    assert rehearsal.pop("--mixed_precision") == "no"
    assert pairs(shlex.split(recipe)) == rehearsal
    assert "same_network" not in yaml.safe_load(open(DEFAULT_CONFIG))
