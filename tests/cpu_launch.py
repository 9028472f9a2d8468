"""cpu_launch.py - TEST-ONLY launcher: run a script on N CPU processes over gloo, the way
`accelerate launch` runs it on a GPU node.

    python tests/cpu_launch.py --nproc 2 --mode fsdp2 -- train.py --algo grpo ...
    python tests/cpu_launch.py --nproc 2 --mode ddp   -- train.py --algo ppo ...

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

Not for users: on a GPU node use `accelerate launch --config_file configs/fsdp_8gpu.yaml`.
Exit status: the first non-zero exit status of a process (all others are then killed), else 0.
"""
from __future__ import annotations

import argparse
import os
import runpy
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accelerate_env(mode: str, nproc: int, config_file: str) -> dict:
    """The environment `accelerate launch` would give each process, built by accelerate itself."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    argv = ["--num_processes", str(nproc), "--mixed_precision", "no", "--main_process_port", "0"]
    argv = (["--config_file", config_file] if mode.startswith("fsdp") else ["--multi_gpu"]) + argv
    if mode == "fsdp1":
        argv += ["--fsdp_version", "1"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv + ["dummy.py"]))
    env = prepare_multi_gpu_env(args)
    if mode == "fsdp1":  # FSDP1's plugin refuses to sync module states on CPU; not what is tested
        env.update(FSDP_SYNC_MODULE_STATES="false", FSDP_CPU_RAM_EFFICIENT_LOADING="false")
    env["MASTER_PORT"] = str(args.main_process_port)
    return env


def launch(mode: str, nproc: int, argv: list[str], config_file: str, timeout: float) -> int:
    env = accelerate_env(mode, nproc, config_file)
    env.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(nproc):
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *argv],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    deadline = time.time() + timeout
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if bad or time.time() > deadline:  # one failed (or hung): the others would wait forever
                rc = bad[0] if bad else 124
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
    return rc or next((p.returncode for p in procs if p.returncode), 0)


def child(argv: list[str]):
    """Runs in each process: switch accelerate's CPU state to FSDP when asked, then run the script."""
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
        ap.add_argument("--nproc", type=int, default=2)
        ap.add_argument("--mode", choices=["ddp", "fsdp2", "fsdp1"], default="fsdp2")
        ap.add_argument("--config-file", default=os.path.join(ROOT, "configs", "fsdp_8gpu.yaml"))
        ap.add_argument("--timeout", type=float, default=600)
        ap.add_argument("cmd", nargs=argparse.REMAINDER)
        a = ap.parse_args()
        cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
        raise SystemExit(launch(a.mode, a.nproc, cmd, a.config_file, a.timeout))
