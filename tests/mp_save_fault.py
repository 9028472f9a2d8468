"""Run by test_multiprocess.py and test_multinode.py under tests/cpu_launch.py: train.py whose
process 1 cannot write its part of a checkpoint (a full disk there), or with RLVER_TEST_FAULT=
publish (final), whose main process cannot rename the finished checkpoint (final/) into place.
Everything else is train.py unchanged."""
import errno
import os
import sys

from accelerate import Accelerator

if os.environ.get("RLVER_TEST_FAULT") in ("publish", "final"):
    if os.environ.get("RANK") == "0":
        replace = os.replace
        target = "step_" if os.environ["RLVER_TEST_FAULT"] == "publish" else "final"

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
