"""How a distributed test worker leaves once its work is done: ``leave(code)``."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Exit with ``code`` now, skipping the interpreter's teardown. Call it once every output is written and
    every process group destroyed. In teardown, gloo's threads behind a device mesh's or FSDP's groups have
    aborted a finished rank now and then ("terminate called without an active exception", no Python frame
    left, the other ranks exit 0: CI, a tensor-parallel run of parallel_worker.py; earlier fsdp_worker.py and
    provenance_worker.py before the Checkpointer destroyed its own groups). A test checks the program's
    results, not torch's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
