"""Run by tests/test_vllm.py under tests/cpu_launch.py (2 gloo processes): each process builds
its own vLLM engine as train.py does under `accelerate launch`, and writes what it saw to
<out>.<rank>.json: the local rank its engine's worker runs on, that the trainer's process group
still sums across processes after the engine joined it, and how long its own generation took
while the other process held back (an engine waiting on the other process's engine would take
as long as that)."""
import json
import os
import sys
import time

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.engines import EngineArgs, VLLMEngine  # noqa: E402 (after sys.path)
from plumbing.models import make_tiny_policy  # noqa: E402 (after sys.path)


def main(out):
    accelerator = Accelerator()
    rank = accelerator.process_index
    # the trainer's current device (on a GPU the one vLLM's worker would move; on a CPU the
    # accelerator's device, which only shows that building the engine left it alone)
    def current():
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else str(accelerator.device)
    device_before = current()
    model, _ = make_tiny_policy(seed=0, hidden_size=128, num_heads=2, words=True)
    engine = VLLMEngine(model, EngineArgs(engine="vllm", vllm_kv_cache_gb=0.25), 512, seed=0)
    engine.push(model)
    res = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "engine_local_rank": engine.worker_local_rank(),
           "device_before": device_before, "device_after": current()}
    total = accelerator.reduce(torch.tensor([float(rank + 1)]), reduction="sum")  # the trainer's group
    res["allreduce"] = float(total)
    if rank == 1:
        time.sleep(12)  # process 1 holds back; process 0 generates meanwhile
    params = engine.SamplingParams(temperature=1.0, max_tokens=8, seed=rank)
    t = time.monotonic()
    out_tokens = engine.llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
    res["generate_s"] = time.monotonic() - t
    res["tokens"] = len(out_tokens[0].outputs[0].token_ids)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(res, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
