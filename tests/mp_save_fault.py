"""Run by test_multiprocess.py and test_multinode.py under tests/cpu_launch.py: train.py whose
process 1 cannot write its part of a checkpoint (a full disk there), or with RLVER_TEST_FAULT=
publish (final, truncate), whose main process cannot rename the finished checkpoint (final/, the
logs a resume cuts back) into place, or with RLVER_TEST_FAULT=metrics, whose main process cannot
append to metrics.jsonl. Everything else is train.py unchanged."""
import builtins
import errno
import os
import sys

from accelerate import Accelerator

if os.environ.get("RLVER_TEST_FAULT") == "metrics":
    if os.environ.get("RANK") == "0":
        real_open = builtins.open

        def full_disk_on_append(file, mode="r", *a, **kw):
            if str(file).endswith("metrics.jsonl") and "a" in mode:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(file, mode, *a, **kw)
        builtins.open = full_disk_on_append
elif os.environ.get("RLVER_TEST_FAULT") in ("publish", "final", "truncate"):
    if os.environ.get("RANK") == "0":
        replace = os.replace
        target = {"publish": "step_", "final": "final", "truncate": "metrics.jsonl"}[os.environ["RLVER_TEST_FAULT"]]

        def full_disk_on_publish(src, dst, *a, **kw):
            if os.path.basename(str(dst)).startswith(target):
                raise OSError(errno.EDQUOT, "Disk quota exceeded")
            return replace(src, dst, *a, **kw)
        os.replace = full_disk_on_publish
elif os.environ.get("RANK") == "1":
    def full_disk(self, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    Accelerator.save_state = full_disk

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402 (after sys.path)

raise SystemExit(train.main(sys.argv[1:]))
