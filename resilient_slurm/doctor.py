"""``rslurm doctor``: placeholder being replaced in this change (see the CLI issue)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``rslurm doctor`` on the CLI's sub-parsers (called by :func:`resilient_slurm.cli.build_parser`)."""
    sp: argparse.ArgumentParser = sub.add_parser("doctor", help="(not yet implemented)")
    sp.set_defaults(func=lambda args: 2)
    return sp
