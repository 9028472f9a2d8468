import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The official SAGE/RLVER scenario files are not in the repo; they sit in shared/ beside the
# checkout when available (RLVER_DATA overrides).
OFFICIAL_DATA = os.environ.get("RLVER_DATA", os.path.join(ROOT, "..", "shared", "data", "rlver"))
