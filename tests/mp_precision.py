"""Run by tests/test_multiprocess.py under tests/cpu_launch.py --mode fsdp2 (2 gloo processes):
the FSDP2 mixed-precision policy train.py's accelerator gives a prepared model under
--mixed-precision bf16, and what plumbing/engines.py's push() gathers from its fp32 shards for a
bf16 engine (a stand-in for vLLM's LLM records the weights it is given), written to the JSON file
named on the command line."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402 (after sys.path)
from torch.distributed.tensor import DTensor  # noqa: E402 (after sys.path)

from plumbing.distributed import make_accelerator, make_generation_copy, refresh_generation_copy  # noqa: E402 (after sys.path)
from plumbing.engines import VLLMEngine  # noqa: E402 (after sys.path)
from plumbing.models import make_tiny_policy  # noqa: E402 (after sys.path)
from train import parse_args  # noqa: E402 (after sys.path)


def main(out):
    cfg = parse_args(["--mixed-precision", "bf16", "--report-to", "none", "--output-dir", tempfile.mkdtemp()])
    accelerator, mp, fsdp = make_accelerator(cfg)
    model, _ = make_tiny_policy(seed=0)
    model = accelerator.prepare(model)
    policy = model._get_fsdp_state()._mp_policy  # what FSDP2 casts to (param) and reduces in
    gathered, full_tensor = [], DTensor.full_tensor

    def recording_full_tensor(self, *a, **kw):  # the dtype each collective moves
        gathered.append(str(self.dtype))
        return full_tensor(self, *a, **kw)
    DTensor.full_tensor = recording_full_tensor
    engine = object.__new__(VLLMEngine)  # push() alone: a bf16 engine (a GPU's) with a stand-in LLM
    engine.asleep, engine.dtype, engine.llm = False, torch.bfloat16, _RecordingLLM()
    engine.push(accelerator.unwrap_model(model))
    pushed_gathers = list(gathered)
    # --engine hf's generation copy (bf16 on a GPU) is refreshed the same way
    unwrapped = accelerator.unwrap_model(model)
    copy = make_generation_copy(unwrapped, "cpu", torch.bfloat16)
    gathered.clear()
    refresh_generation_copy(unwrapped, copy)
    copy_gathers = list(gathered)
    DTensor.full_tensor = full_tensor
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"fsdp": fsdp, "mixed_precision": mp, "param_dtype": str(policy.param_dtype),
                       "reduce_dtype": str(policy.reduce_dtype), "master": str(next(model.parameters()).dtype),
                       "gathered": sorted(set(pushed_gathers)), "gathers": len(pushed_gathers),
                       "copy_gathered": sorted(set(copy_gathers)), "copy_gathers": len(copy_gathers),
                       "pushed": sorted({str(t.dtype) for _, t in engine.llm.weights}),
                       "pushed_whole": all(not isinstance(t, DTensor) for _, t in engine.llm.weights)}, f)
    accelerator.wait_for_everyone()


class _RecordingLLM:
    """What push() calls on vLLM's LLM, keeping the weights it is given."""

    def collective_rpc(self, method, kwargs):
        self.weights = list(kwargs["weights_iterator"])

    def reset_prefix_cache(self):
        pass


if __name__ == "__main__":
    main(sys.argv[1])
