"""What the benchmark scripts share: the command line they print beside their tables, and the
end of a run: its results as JSON (--json PATH, read by tests/test_benchmarks.py) and an exit
status that says whether every configuration asked for produced a result."""
import json
import os
import shlex
import sys


def command(argv=None) -> str:
    """The command that reproduces this run (argv: the flags; default this process's)."""
    flags = sys.argv[1:] if argv is None else argv
    return "python " + shlex.join([f"benchmarks/{os.path.basename(sys.argv[0])}", *flags])


def finish(json_path, results: dict, failed: dict, skipped: dict | None = None, cmd: str | None = None) -> int:
    """Say what failed, write the run to `json_path` (when given) and return the exit status:
    1 when a configuration asked for failed, else 0. `results` maps each configuration that ran
    to its figures and counts, `failed` each that did not to why, `skipped` each left out on
    purpose (a peer library that is not installed) to why: a skip is not a failure."""
    for name, why in failed.items():
        print(f"FAILED {name}: {why}")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"command": cmd or command(), "results": results, "failed": failed,
                       "skipped": skipped or {}}, f, indent=1)
    return 1 if failed else 0
