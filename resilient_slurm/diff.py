"""``rslurm diff A B [--json]``: compare two steps (state keys, shapes, dtypes, provenance).

    rslurm diff 1000 2000                 two steps of the run (--run-id, or the only run, or this job's)
    rslurm diff best 2000                 a tag stands for a step
    rslurm diff exp1:1000 exp2:1000       steps of two runs: RUN:STEP

The comparison is :mod:`resilient_slurm.catalog.diff`; this module is the command: arguments, the
catalog of the tiers (the same settings and tier choice as ``rslurm show``), printing, exit code.
Only manifests and DCP metadata are read (restricted unpickler), never a shard.

Exit codes: 0 the steps have the same keys, shapes, dtypes and provenance; 1 they differ (or a step
cannot be read: its manifest or metadata is corrupt); 2 usage errors (a step or run that does not
exist, bad settings, a store that cannot be reached).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from . import config
from .cliargs import INSPECT_STORAGE_FLAGS, open_catalog, step_arg
from .errors import ConfigError, CorruptCheckpointError
from .paths import id_problem


def _step_spec(v: str) -> tuple[str | None, int | str]:
    """``[RUN:]STEP``: a run (or None: the command's run) and a step number or tag."""
    run, sep, step = v.rpartition(":")
    if sep and not run:
        raise argparse.ArgumentTypeError(f"expected [RUN:]STEP, got {v!r} (a run before the ':')")
    if run and (problem := id_problem("run id", run)) is not None:
        raise argparse.ArgumentTypeError(f"in {v!r}: {problem}")
    return (run or None), step_arg(step)


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare steps A and B; print the differences (or JSON); exit 0 equal, 1 different."""
    from .catalog.diff import compare, format_diff, step_facts
    from .catalog.source import open_source

    catalog, cfg = open_catalog(args, durable=args.tier != "local")
    facts = []
    with catalog:
        for run_id, step in (args.a, args.b):
            run = catalog.resolve_run(run_id or cfg.run_id, strict=bool(run_id) or args.run_id is not None)
            view = catalog.step(run, step)
            if view.manifest is None:
                raise CorruptCheckpointError(f"run {run} step {view.step} has no readable manifest; "
                                             f"run `rslurm verify {view.step}`")
            try:
                tier = catalog.choose_tier(view, args.tier)
            except ConfigError:
                if args.tier == "durable" or not view.valid_local:  # as show: a node's own domain will do
                    raise
                tier = "local"
            facts.append(step_facts(open_source(catalog, view, tier)))
    doc = compare(facts[0], facts[1])
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        from .terminal import printable

        for line in format_diff(doc):
            print(printable(line, newlines=True))
    return 0 if doc["equal"] else 1


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``rslurm diff`` on the CLI's sub-parsers (called by :func:`resilient_slurm.cli.build_parser`)."""

    sp: argparse.ArgumentParser = sub.add_parser(
        "diff", help="compare two steps: state keys, shapes, dtypes and provenance (exit 1 when they differ)",
        description="Compare two steps' DCP metadata (keys only in one of them, shapes, dtypes: the flattened keys "
        "restore(allow_missing=...) takes) and their provenance (code version, command line, versions, world "
        "size, nodes, Slurm job, config). A STEP is a step number or a tag; RUN:STEP takes it from another run. "
        "Exit codes: 0 no difference, 1 differences (or a corrupt step), 2 bad usage or settings, or a store that "
        "cannot be reached. See docs/cli.md.")
    sp.add_argument("a", type=_step_spec, metavar="A", help="[RUN:]STEP, a step number or tag")
    sp.add_argument("b", type=_step_spec, metavar="B", help="[RUN:]STEP, a step number or tag")
    sp.add_argument("--local-dir", default=None, help="node-local root; %%n = node name (RSLURM_LOCAL_DIR)")
    sp.add_argument("--durable", default=None, help="durable tier URL: /path, file:///path or s3://bucket/prefix "
                    "(RSLURM_DURABLE)")
    sp.add_argument("--run-id", default=None, help="run of a STEP without RUN: (RSLURM_RUN_ID; default: this job's "
                    "run, else the only run)")
    sp.add_argument("--tier", choices=("auto", "local", "durable"), default="auto",
                    help="which tier (default: auto, as rslurm show)")
    sp.add_argument("--json", action="store_true", help="one JSON document on stdout")
    for n in INSPECT_STORAGE_FLAGS:
        st = config.SETTINGS[n]
        sp.add_argument(f"--{n.replace('_', '-')}", dest=f"set_{n}", default=None, metavar="V",
                        help=f"{st.help} ({st.env})".replace("%", "%%"))
    sp.set_defaults(func=cmd_diff)
    return sp


__all__ = ["add_parser", "cmd_diff"]
