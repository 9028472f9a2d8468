"""cpu_launch.py - TEST-ONLY launcher: run a script on N CPU processes over gloo, the way
`accelerate launch` runs it on a GPU node, or on several nodes.

    python tests/cpu_launch.py --nproc 2 --mode fsdp2 -- train.py --algo grpo ...
    python tests/cpu_launch.py --nproc 2 --mode ddp   -- train.py --algo ppo ...
    python tests/cpu_launch.py --nnodes 2 --nproc 2 --mode fsdp2 -- train.py ...   # 2 nodes x 2
    python tests/cpu_launch.py --nnodes 2 --nproc 1 --node-local-dirs /tmp/n -- train.py ...

Why this file exists: accelerate never switches FSDP on for CPU processes (its state picks
MULTI_CPU = DDP over gloo), so the FSDP2 code paths of train.py could not run in CI. This
launcher
  1. builds the environment with accelerate's OWN launch code (`prepare_multi_gpu_env`) from the
     same config file a GPU node uses (configs/fsdp_8gpu.yaml; --mode ddp: plain multi-process),
     so every FSDP_* variable is exactly what `accelerate launch` would set;
  2. starts N processes with RANK / WORLD_SIZE / MASTER_ADDR set (what torchrun does);
  3. in each process, before the script runs, turns accelerate's MULTI_CPU state into FSDP when
     ACCELERATE_USE_FSDP is set (the one thing accelerate refuses on CPU). From there on it is
     accelerate's and torch's real FSDP2 code (fully_shard, sharded checkpoints, gloo
     collectives) running train.py unchanged.

Several nodes (--nnodes N), rehearsed on one machine: one launcher process per node, each
started as `cpu_launch.py --nnodes N --node-rank K --main-process-port PORT ...` (what
`accelerate launch --num_machines N --machine_rank K --main_process_ip HOST --main_process_port
PORT` is on host K), its environment built by accelerate's launch code for that machine rank,
its P processes given what torchrun's static rendezvous gives them: RANK = K x P + local rank,
LOCAL_RANK, GROUP_RANK = K (the node's rank), WORLD_SIZE = N x P, LOCAL_WORLD_SIZE = P, and
MASTER_ADDR 127.0.0.1 (the host of node 0). Each node's processes see their own launcher as
their parent process, as on a cluster. --node-local-dirs D: node K's processes run in the
working directory D/node-K, so a relative --output-dir is a different disk per node.
--audit-writes D (for tests): every process records in D/writes.RANK.jsonl each file it opens
for writing, renames, removes and each folder it makes (Python's audit hooks; safetensors'
own writes, in Rust, are not seen).

Not for users: on a GPU node use `accelerate launch --config_file configs/fsdp_8gpu.yaml`.
Exit status: the first non-zero exit status of a process (all others are then killed), else 0.
"""
from __future__ import annotations

import argparse
import os
import runpy
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "fsdp_8gpu.yaml")


def launch_argv(mode: str, nproc: int, config_file: str, nnodes: int = 1, node_rank: int = 0,
                port: int = 0) -> list[str]:
    """The `accelerate launch` arguments of node `node_rank`: those of docs/MULTI_GPU.md's SLURM
    recipe (config file, machines, processes, machine rank, main process's address and port,
    --same_network, a static rendezvous: rank 0 on machine 0), and --mixed_precision no (CPU)."""
    argv = ["--num_processes", str(nproc * nnodes), "--mixed_precision", "no", "--main_process_port", str(port),
            "--num_machines", str(nnodes), "--machine_rank", str(node_rank), "--main_process_ip", "127.0.0.1",
            "--same_network", "--rdzv_backend", "static"]
    argv = (["--config_file", config_file] if mode.startswith("fsdp") else ["--multi_gpu"]) + argv
    return argv + (["--fsdp_version", "1"] if mode == "fsdp1" else [])


def accelerate_env(mode: str, nproc: int, config_file: str, nnodes: int = 1, node_rank: int = 0,
                   port: int = 0) -> dict:
    """The environment `accelerate launch` would give each process of node `node_rank` (of
    `nnodes`, `nproc` processes each), built by accelerate itself; MASTER_PORT included."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    argv = launch_argv(mode, nproc, config_file, nnodes, node_rank, port)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv + ["dummy.py"]))
    env = prepare_multi_gpu_env(args)
    if mode == "fsdp1":  # FSDP1's plugin refuses to sync module states on CPU; not what is tested
        env.update(FSDP_SYNC_MODULE_STATES="false", FSDP_CPU_RAM_EFFICIENT_LOADING="false")
    env["MASTER_PORT"] = str(args.main_process_port)
    if nnodes > 1:  # what accelerate hands torchrun for this machine (same_network: a static rendezvous)
        assert int(args.nproc_per_node) == nproc and args.node_rank == node_rank, vars(args)
        env.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
    return env


def launch(mode: str, nproc: int, argv: list[str], config_file: str, timeout: float, nnodes: int = 1,
           node_rank: int | None = None, port: int = 0, node_local_dirs: str = "", audit: str = "") -> int:
    """One node's processes (nnodes 1, or node_rank given), else one launcher per node."""
    if nnodes > 1 and node_rank is None:  # the cluster: a launcher per node, on one free port
        return launch_nodes(mode, nproc, argv, config_file, timeout, nnodes, node_local_dirs, audit)
    env = accelerate_env(mode, nproc, config_file, nnodes, node_rank or 0, port)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.update(WORLD_SIZE=str(nproc * nnodes), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node_rank or 0),
               ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if audit:
        env["CPU_LAUNCH_AUDIT"] = os.path.abspath(audit)
    # A node's launcher ended by the cluster's (SIGTERM) ends its processes first (wait_all's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs = []
    for local in range(nproc):
        rank = (node_rank or 0) * nproc + local
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *argv],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(local)}))
    return wait_all(procs, timeout)


def launch_nodes(mode, nproc, argv, config_file, timeout, nnodes, node_local_dirs, audit) -> int:
    """Start one launcher per node, as a user starts `accelerate launch ... --machine_rank K` on
    each host; with node_local_dirs, node K works in D/node-K (the script's path made absolute)."""
    with socket.socket() as s:  # a free port, known to every node before node 0 binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if node_local_dirs and argv:  # (the script's own relative arguments resolve in D/node-K)
        argv = [os.path.abspath(argv[0]), *argv[1:]]
    config_file = os.path.abspath(config_file)
    procs = []
    for k in range(nnodes):
        cwd = None
        if node_local_dirs:
            cwd = os.path.join(node_local_dirs, f"node-{k}")
            os.makedirs(cwd, exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--nnodes", str(nnodes), "--node-rank", str(k),
               "--nproc", str(nproc), "--mode", mode, "--main-process-port", str(port), "--timeout", str(timeout)]
        if config_file != os.path.abspath(DEFAULT_CONFIG):
            cmd += ["--config-file", config_file]
        if audit:
            cmd += ["--audit-writes", os.path.abspath(audit)]
        procs.append(subprocess.Popen([*cmd, "--", *argv], cwd=cwd))
    return wait_all(procs, timeout + 30, grace=20.0, stop=signal.SIGTERM)


def wait_all(procs, timeout: float, grace: float = 5.0, stop=signal.SIGKILL) -> int:
    """Wait for every process. After the first non-zero exit the others get `grace` seconds to
    end on their own (to say their own line), then are ended: one waiting in a collective for the
    failed one would wait forever. A timeout ends all (exit status 124). Ended with `stop`: the
    script's processes with SIGKILL, a node's launcher with SIGTERM, which it passes on to its
    processes (its own wait_all's finally)."""
    deadline, failed_at, rc = time.time() + timeout, None, 0
    try:
        while any(p.poll() is None for p in procs):
            bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if bad and failed_at is None:
                failed_at, rc = time.time(), bad[0]
            if (failed_at is not None and time.time() > failed_at + grace) or time.time() > deadline:
                rc = rc or 124
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(stop)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return rc or next((p.returncode for p in procs if p.returncode), 0)


def audit_writes(folder: str):
    """Record this process's writes (files opened to write, renames, removals, folders made) in
    folder/writes.RANK.jsonl: one writer per file is then checked from outside. A folder that
    exists when mkdir is asked is marked `existed` (os.makedirs(exist_ok=True) of a made folder)."""
    import json
    rank = os.environ["RANK"]
    out = open(os.path.join(folder, f"writes.{rank}.jsonl"), "a", encoding="utf-8", buffering=1)
    seen = {"rank": int(rank)}

    def record(what, path, **extra):
        out.write(json.dumps({**seen, "op": what, "path": os.path.abspath(os.fsdecode(path)), **extra}) + "\n")

    def hook(event, args):
        try:
            if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
                mode, flags = args[1] or "", args[2] or 0
                writes = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
                if writes and not os.path.isdir(args[0]):  # O_TMPFILE names the folder: no file of its own
                    record("write", args[0])
            elif event == "os.rename":
                record("rename", args[1], src=os.path.abspath(os.fsdecode(args[0])))
            elif event in ("os.remove", "os.rmdir", "shutil.rmtree"):
                record("remove", args[0])
            elif event == "os.mkdir":
                record("mkdir", args[0], existed=os.path.isdir(args[0]))
        except Exception:  # an audit hook must never break the program
            pass
    sys.addaudithook(hook)


def child(argv: list[str]):
    """Runs in each process: switch accelerate's CPU state to FSDP when asked, then run the script."""
    if os.environ.get("CPU_LAUNCH_AUDIT"):
        audit_writes(os.environ["CPU_LAUNCH_AUDIT"])
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType
        init = AcceleratorState.__init__

        def init_fsdp_on_cpu(self, *a, fsdp_plugin=None, **kw):
            init(self, *a, fsdp_plugin=fsdp_plugin, **kw)
            if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
                self.distributed_type = DistributedType.FSDP
                self.fsdp_plugin = fsdp_plugin
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState.__init__ = init_fsdp_on_cpu
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    # Leave without interpreter teardown: gloo's background threads can abort it after the
    # script has finished ("terminate called without an active exception"), a false failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        ap.add_argument("--nproc", type=int, default=2, help="processes per node")
        ap.add_argument("--nnodes", type=int, default=1)
        ap.add_argument("--node-rank", type=int, default=None, help="start only this node's processes")
        ap.add_argument("--main-process-port", type=int, default=0, help="with --node-rank: node 0's port")
        ap.add_argument("--node-local-dirs", default="", help="node K works in D/node-K")
        ap.add_argument("--audit-writes", default="", help="each process records its writes here")
        ap.add_argument("--mode", choices=["ddp", "fsdp2", "fsdp1"], default="fsdp2")
        ap.add_argument("--config-file", default=DEFAULT_CONFIG)
        ap.add_argument("--timeout", type=float, default=600)
        ap.add_argument("cmd", nargs=argparse.REMAINDER)
        a = ap.parse_args()
        if a.node_rank is not None and not a.main_process_port:
            ap.error("--node-rank needs --main-process-port (node 0's port: every node must use the same)")
        cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
        raise SystemExit(launch(a.mode, a.nproc, cmd, a.config_file, a.timeout, a.nnodes, a.node_rank,
                                a.main_process_port, a.node_local_dirs, a.audit_writes))
