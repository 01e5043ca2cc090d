"""``rslurm submit``: placeholder being replaced in this change (see the CLI issue)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``rslurm submit`` on the CLI's sub-parsers (called by :func:`resilient_slurm.cli.build_parser`)."""
    sp: argparse.ArgumentParser = sub.add_parser("submit", help="(not yet implemented)")
    sp.set_defaults(func=lambda args: 2)
    return sp
