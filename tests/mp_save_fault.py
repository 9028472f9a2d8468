"""Run by test_multiprocess.py under tests/cpu_launch.py: train.py whose process 1 cannot write
its part of a checkpoint (a full disk there). Everything else is train.py unchanged."""
import errno
import os
import sys

from accelerate import Accelerator

if os.environ.get("RANK") == "1":
    def full_disk(self, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    Accelerator.save_state = full_disk

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

raise SystemExit(train.main(sys.argv[1:]))
