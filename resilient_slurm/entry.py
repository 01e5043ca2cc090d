"""The console scripts' entry points (``rslurm``, ``rsrun``): ``rslurm launch`` and ``rsrun`` trap the stop
signals (:mod:`resilient_slurm.early_signals`) before the CLI is imported."""

from __future__ import annotations

import sys

from .early_signals import is_launch, trap_early


def main() -> int:
    """``rslurm``."""
    if is_launch(sys.argv[1:]):
        trap_early()
    from .cli import main as cli_main

    return cli_main()


def rsrun_main() -> int:
    """``rsrun``: always ``rslurm launch``."""
    trap_early()
    from .cli import rsrun_main as cli_rsrun_main

    return cli_rsrun_main()
