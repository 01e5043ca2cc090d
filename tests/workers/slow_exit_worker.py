"""``resilient_slurm.examples.train_toy``, then a slow exit: a rank that saved and left its loop, but is not
gone before Slurm's SIGKILL (on a busy node, the interpreter's final garbage collection took 10 s at a load
of 20 on two cores). For tests/test_launcher_slurm.py.

    python slow_exit_worker.py SECONDS [train_toy arguments ...]
"""

from __future__ import annotations

import sys
import time

from resilient_slurm.examples.train_toy import main

if __name__ == "__main__":
    code = main(sys.argv[2:])
    time.sleep(float(sys.argv[1]))
    sys.exit(code)
