"""``rslurm``: the command-line entry point. The only place that configures logging.

Commands: ``launch``, ``daemon``, ``status``, ``history``, ``report``, ``health``, ``submit``, ``doctor``, the demo, and the inspection
commands over the on-disk contract on both tiers (``ls``, ``runs``, ``show``, ``verify``, ``gc``, ``export``, ``tag``,
``untag``),
whose logic lives in :mod:`resilient_slurm.catalog` (this module parses, resolves settings and prints;
see docs/cli.md). Exit codes: 0 ok; 1 a fault in the data (verify, export of a corrupt step, a gc
deletion that failed); 2 bad usage or settings, or a store that cannot be reached.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # `python -m resilient_slurm.cli launch` (and the drain daemon a launcher starts): trap the stop signals
    # before the imports below.
    from resilient_slurm.early_signals import is_job_daemon, is_launch, trap_early

    if is_launch(sys.argv[1:]) or is_job_daemon(sys.argv[1:]):
        trap_early()

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import stat
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import __version__, config, diff, doctor, rehearse, submit
from .cliargs import INSPECT_STORAGE_FLAGS
from .cliargs import flag_settings as _flag_settings
from .cliargs import local_root as _local_root
from .cliargs import open_catalog as _open_catalog
from .cliargs import step_arg as _step_arg
from .cliargs import tag_arg as _tag_arg
from .early_signals import release_early, trap_early
from .errors import ConfigError, CorruptCheckpointError, ResilientSlurmError
from .paths import default_local_dir, node_name
from .terminal import PrintableFormatter, printable

if TYPE_CHECKING:  # rich and the catalog are imported by the commands that use them (fast `rslurm launch`)
    from rich.console import Console
    from rich.table import Table

    from .catalog import Catalog, StepView
    from .catalog.checks import ProgressFactory
    from .checkpoint.verify import StepReport
    from .tags import RunTags

log = logging.getLogger("resilient_slurm.cli")


# Settings `rslurm launch` takes as flags: every one that ranks or the launcher read. Each given flag is
# checked here, then exported to the launcher and its ranks as the RSLURM_* variable of the same name.
LAUNCH_FLAG_COMPONENTS = ("checkpoint", "rank", "launcher")


def cmd_launch(args: argparse.Namespace) -> int:
    # The stop signals are trapped before the launcher's set-up (settings, the run's claim, Slurm's record of the
    # job), if the console script has not already: a time-limit USR1 or a preemption SIGTERM in those seconds
    # would otherwise end the job unsaved and unrequeued. The launcher's trap takes over what was heard.
    trap_early()
    try:
        return _launch(args)
    finally:
        release_early()


def _launch(args: argparse.Namespace) -> int:
    from .launcher.launch import Launcher

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    env = dict(os.environ)
    for name, value in _flag_settings(args, LAUNCH_FLAG_COMPONENTS).items():
        env[config.SETTINGS[name].env] = value  # the launcher passes its settings to the ranks as variables
    result = Launcher(command, nprocs=args.nprocs, env=env, config_path=args.config).run()
    return result.exit_code




# ------------------------------------------------------------------ inspection: ls, show, verify, gc, export
# The logic lives in resilient_slurm.catalog; these functions resolve settings, call it and print.
STALE_AFTER_S = 6 * 3600.0  # as the daemon's STALE_UPLOAD_AGE: leftovers older than this have no writer


def _seconds(v: str) -> float:
    try:
        s = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (e.g. 3600), got {v!r}") from None
    if not math.isfinite(s) or s < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {v!r}")
    return s


def _say(*values: object, file: Any = None) -> None:
    """``print`` for human output: every value made :func:`~resilient_slurm.terminal.printable` (strings
    from disk never drive the terminal). JSON output is printed as it is."""
    print(*(printable(v, newlines=True) for v in values), file=sys.stdout if file is None else file)


def _ranks(ranks: Sequence[int]) -> str:
    """``-``, or the ranks that hold their own copy of a key (``0-7``, ``0, 2``)."""
    if not ranks:
        return "-"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _console() -> Console:
    from rich.console import Console

    class Piped(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1 ("a fault in the data"): main() ends it as SIGPIPE
            raise BrokenPipeError

    # Piped output keeps whole lines (no wrapping at 80 columns): scripts and logs read it.
    return Piped() if sys.stdout.isatty() else Piped(width=int(os.environ.get("COLUMNS") or 240))


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[str] = ()) -> Table:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    for r in rows:
        # Text: no markup in paths or messages; printable: no control character from disk reaches the terminal
        t.add_row(*(Text("-" if v is None else printable(v)) for v in r))
    return t


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit}"
    return f"{s}s"


def _progress(args: argparse.Namespace) -> ProgressFactory:
    """Progress bars on stderr when it is a terminal and the output is not JSON."""
    from .catalog.progress import byte_progress

    enabled = not args.json and sys.stderr.isatty()
    return lambda description, total: byte_progress(description, total, enabled=enabled)


def _local_cell(row: dict[str, Any]) -> str:
    loc = row["local"]
    state = loc["state"]
    if state == "partial":
        return f"{len(loc['domains'])}/{len(row['domains'] or [])} domains"
    return {"complete": "complete", "invalid": "INVALID", "in_progress": "in progress", "absent": "-"}.get(state, state)


def _durable_cell(row: dict[str, Any]) -> str:
    d = row["durable"]
    if d["state"] == "partial":
        return f"partial {len(d['markers'])}/{d['domains'] or '?'} ({len(d.get('committed', []))} committed)"
    return {"invalid": "INVALID", "absent": "-", "unknown": "?"}.get(d["state"], d["state"])


def _run_tags(catalog: Catalog, run: str) -> RunTags | None:
    """A run's tags for a listing; None (and the fault recorded) when a copy cannot be read (a store that cannot
    be reached is an error)."""
    from .errors import StorageError, TagsFileError

    try:
        return catalog.tags(run)
    except TagsFileError as exc:
        catalog.faults.append(f"run {run}: tags: {exc}")
    except StorageError as exc:
        catalog.errors.append(f"run {run}: tags: {exc}")
    return None


def _listing_status(catalog: Catalog) -> int:
    """``ls``/``runs``: 2 when a store could not be listed, 1 when only data could not be read, else 0."""
    return 2 if catalog.errors else 1 if catalog.faults else 0


def cmd_ls(args: argparse.Namespace) -> int:
    """``rslurm ls``: runs and steps with their state in each tier."""
    catalog, cfg = _open_catalog(args, durable=args.tier != "local")
    now = time.time()
    with catalog:
        strict = args.run_id is not None  # typed: a misspelt one is an error
        runs = [catalog.given_run(cfg.run_id, strict=strict)] if cfg.run_id else catalog.runs(strict=False)
        rows = []
        replicas = []
        for run in runs:
            if args.tier != "durable":  # spare copies of partner domains' steps, never this node's own
                replicas += [rs.to_json(now) for rs in catalog.replicas(run)]
            views = catalog.steps(run, strict=False)
            tags = _run_tags(catalog, run) if views else None
            for v in views:
                row = v.to_json(now, tags.names(v.step) if tags is not None else [])
                if args.tier == "durable" and row["durable"]["state"] == "absent":
                    continue
                if args.tier == "durable":
                    row["local"] = None
                rows.append(row)
        doc: dict[str, Any] = {"local_roots": catalog.roots if args.tier != "durable" else [],
               "durable": catalog.durable_url if args.tier != "local" else None,
               "steps": rows, "replicas": replicas, "errors": catalog.errors + catalog.faults}
    if args.json:
        print(json.dumps(doc, indent=1))
        return _listing_status(catalog)
    con = _console()
    if args.tier != "durable":
        con.print(printable(f"local tier   {', '.join(doc['local_roots'])}"), markup=False, highlight=False)
    if args.tier != "local":
        con.print(printable(f"durable tier {doc['durable'] or '(not set: --durable / RSLURM_DURABLE)'}"), markup=False,
                  highlight=False)
    has_durable = bool(doc["durable"])
    notes = ["; ".join(n for n in ((r["local"] or {}).get("why"), (r["durable"] or {}).get("why")) if n)
             for r in rows]
    has_tags = any(r["tags"] for r in rows)
    cols = ["RUN", "STEP"] + (["TAGS"] if has_tags else []) + ["REASON", "SIZE", "RANKS"] + (
        ["LOCAL"] if args.tier != "durable" else []) + (["DURABLE"] if has_durable else []) + ["AGE"] + (
        ["NOTE"] if any(notes) else [])
    table_rows = []
    for r, note in zip(rows, notes):
        table_rows.append([r["run_id"], r["step"]] + ([", ".join(r["tags"]) or "-"] if has_tags else [])
                          + [r["reason"], _size(r["bytes"]), r["world_size"]]
                          + ([_local_cell(r)] if args.tier != "durable" else [])
                          + ([_durable_cell(r)] if has_durable else [])
                          + [_age(r["age_s"])] + ([note] if any(notes) else []))
    if table_rows:
        con.print(_table(cols, table_rows, right=("STEP", "SIZE", "RANKS", "AGE")))
    else:
        con.print("(no checkpoints)", markup=False)
    if replicas:
        con.print("\nreplicas held here (partner domains' steps copied to this node; not its own steps)",
                  markup=False, highlight=False)
        rep_rows = _replica_rows(replicas)
        has_note = any(r[-1] for r in rep_rows)
        con.print(_table(["RUN", "REPLICA OF", "STEP", "SIZE", "AGE"] + (["NOTE"] if has_note else []),
                         [r if has_note else r[:-1] for r in rep_rows], right=("STEP", "SIZE", "AGE")))
    for e in doc["errors"]:
        _say(f"error: {e}", file=sys.stderr)
    return _listing_status(catalog)


def _replica_rows(replicas: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """``rslurm ls``'s replica table: one row per committed replica step, one per replica being received."""
    out: list[list[Any]] = []
    for rs in replicas:
        out += [[rs["run_id"], rs["domain"], r["step"], _size(r["bytes"]), _age(r["age_s"]), r["problem"] or ""]
                for r in rs["steps"]]
        out += [[rs["run_id"], rs["domain"], t["step"], "-", "-", "being received"] for t in rs["receiving"]]
    return out


def _pick_step(catalog: Catalog, args: argparse.Namespace, cfg: config.Settings) -> StepView:
    run = catalog.resolve_run(cfg.run_id, strict=args.run_id is not None)
    if args.step is not None:
        return catalog.step(run, args.step)
    views = [v for v in catalog.steps(run) if v.manifest is not None]
    if not views:
        raise ConfigError(f"run {run} has no committed step in {', '.join(catalog.roots)}"
                          + (f" or {catalog.durable_url}" if catalog.durable_url else ""))
    return views[-1]


def cmd_show(args: argparse.Namespace) -> int:
    """``rslurm show [STEP]``: what a step holds."""
    from .catalog.describe import describe, provenance_lines
    from .catalog.source import open_source

    catalog, cfg = _open_catalog(args, durable=args.tier != "local")
    with catalog:
        view = _pick_step(catalog, args, cfg)
        if view.manifest is None:
            lstate, lwhy = view.local_state
            dstate, dwhy = view.durable_state
            raise CorruptCheckpointError(
                f"run {view.run_id} step {view.step} has no readable manifest: local tier {lstate}"
                + (f" ({lwhy})" if lwhy else "") + (f"; durable tier {dstate}" + (f" ({dwhy})" if dwhy else "")
                                                    if dstate else "") + f". Run `rslurm verify {view.step}`")
        try:
            tier = catalog.choose_tier(view, args.tier)
        except ConfigError:
            # A node's own domain (a partial step on a cluster node) can still be shown.
            if args.tier == "durable" or not view.valid_local:
                raise
            tier = "local"
        doc = describe(open_source(catalog, view, tier))
        tags = _run_tags(catalog, view.run_id)
        doc["tags"] = tags.names(view.step) if tags is not None else None
    for e in catalog.errors + catalog.faults:
        _say(f"rslurm show: {e}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    con = _console()

    def line(text: str) -> None:
        con.print(printable(text, newlines=True), markup=False, highlight=False)

    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["created_at"]))
    line(f"run {doc['run_id']}  step {doc['step']}  ({doc['tier']} tier: {doc['where']})"
         + (f"  tags: {', '.join(doc['tags'])}" if doc["tags"] else ""))
    stored = doc["stored_bytes"]
    kept = (f" (stored {_size(stored)}: {stored / doc['bytes']:.2f} of it)"
            if stored is not None and doc["bytes"] and stored != doc["bytes"] else "")
    line(f"  reason {doc['reason']}  world size {doc['world_size']}  size {_size(doc['bytes'])}{kept}  created {created} "
         f"({_age(time.time() - doc['created_at'])} ago)")
    line(f"  torch {doc['torch_version']}  resilient_slurm {doc['library_version']}  format {doc['format']}  "
         f"schema {doc['schema_version']}")
    line("  storage domains: " + "; ".join(f"{d} ranks {r}" for d, r in doc["domains"].items()))
    for text in provenance_lines(doc["provenance"]):
        line(f"  {text}")
    con.print(_table(["SHARD", "RANK", "DOMAIN", "SIZE", "STORED", "ITEMS", "CHECKSUM"],
                     [[s["path"], s["rank"], s["domain"], _size(s["bytes"]),
                       "-" if s["stored_bytes"] is None else _size(s["stored_bytes"]), s["items"], s["checksum"]]
                      for s in doc["shards"]], right=("RANK", "SIZE", "STORED", "ITEMS")))
    con.print(_table(["KEY", "ITEMS", "TENSORS", "VALUES", "TENSOR BYTES", "DTYPES", "PER RANK"],
                     [[k["key"], k["items"], k["tensors"], k["values"], _size(k["tensor_bytes"]),
                       ", ".join(k["dtypes"]) or ("empty " + k["empty"] if k.get("empty") else "-"),
                       _ranks(k["per_rank"])] for k in doc["keys"]],
                     right=("ITEMS", "TENSORS", "VALUES", "TENSOR BYTES")))
    if doc["ddp_bucket_layout"]:
        line("  DDP gradient bucket layout: recorded (re-applied at the resume)")
    rng = doc["rng"]
    if rng["present"]:
        gens = sorted({g for gs in rng["generators"].values() for g in gs})
        missing = f"; missing for ranks {rng['missing_ranks']}" if rng["missing_ranks"] else ""
        line(f"  RNG state: {len(rng['ranks'])} of {doc['world_size']} ranks ({', '.join(gens)}){missing}")
    else:
        line("  RNG state: not captured (capture_rng off)")
    if not doc["data_position"]:
        line("  data position: none found (no ResumableSampler or StatefulDataLoader in the state)")
    for p in doc["data_position"]:
        vals = ", ".join(f"{k} {v}" for k, v in p["values"].items())
        line(f"  data position: {p['key']} ({p['kind']})" + (f": {vals}" if vals else ""))
    for n in doc["notes"]:
        line(f"  note: {n}")
    return 0


def _scratch_dir(path: str) -> str:
    """``--scratch-dir``, absolute, once a directory can be made in it: a setting that cannot be used is exit
    2 before anything is read, not a fault of every durable shard."""
    import shutil
    import tempfile

    path = os.path.abspath(path)
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix="rslurm-probe-", dir=path))
    except OSError as exc:
        raise ConfigError(f"--scratch-dir {path}: cannot make a directory in it ({exc.strerror or exc}); give an "
                          "existing directory you can write, with room for the largest shard") from None
    return path


def cmd_verify(args: argparse.Namespace) -> int:
    """``rslurm verify [STEP]``: full checksum verification; exit 1 on any fault."""
    from .catalog.checks import verify_view

    scratch = _scratch_dir(args.scratch_dir) if args.scratch_dir else None
    catalog, cfg = _open_catalog(args, durable=args.tier != "local")
    progress = _progress(args)
    reports: list[StepReport] = []
    with catalog:
        if args.step is not None:
            run = catalog.resolve_run(cfg.run_id, strict=args.run_id is not None)
            scope = [(catalog.step(run, args.step), True)]
        else:
            strict = args.run_id is not None
            runs = [catalog.given_run(cfg.run_id, strict=strict)] if cfg.run_id else catalog.runs()
            scope = [(v, False) for run in runs for v in catalog.steps(run)]
        for view, explicit in scope:
            reports += verify_view(catalog, view, args.tier, explicit=explicit, progress=progress,
                                   scratch=scratch)
        where = ", ".join(catalog.roots) + (f" and {catalog.durable_url}" if catalog.durable_url else "")
        # A run directory or tier that could not be listed: a fault, unreadable (of the tiers verified).
        tiers = {"local": ("local tier",), "durable": ("durable tier",)}.get(args.tier, ("local tier", "durable tier"))
        errors = [e for e in catalog.errors if e.startswith(tiers)]
    faults = sum(len(r.faults) for r in reports) + len(errors)
    checked = [r for r in reports if r.files_checked or r.faults]
    ok = faults == 0 and bool(checked)
    if args.json:
        print(json.dumps({"ok": ok, "faults": faults, "reports": [r.to_json() for r in reports], "errors": errors},
                         indent=1))
    else:
        for r in reports:
            status = "OK" if r.ok else "CORRUPT"
            if r.ok and not r.files_checked:
                status = "SKIPPED"
            label = f"run {r.run_id} step {r.step}  {r.tier}" + (f" {r.domain}" if r.domain else "")
            files = f"{r.files_checked} file" + ("s" if r.files_checked != 1 else "")
            _say(f"{status:<8} {label}  {r.where}  ({_size(r.bytes_checked)} in {files})")
            for f in r.faults:
                _say(f"         {f}")
            for n in r.notes:
                _say(f"         note: {n}")
        if not checked:
            _say(f"nothing verified: no committed steps in {where}")
        else:
            bad = sum(1 for r in reports if not r.ok)
            copies, in_copies = len(checked), faults - len(errors)
            _say(f"{copies} cop{'y' if copies == 1 else 'ies'} verified, {bad} with faults "
                 f"({in_copies} fault{'' if in_copies == 1 else 's'})"
                 + (f"; {len(errors)} unreadable (below)" if errors else ""))
        for e in errors:
            _say(f"rslurm verify: unreadable: {e}; nothing in it was verified", file=sys.stderr)
    return 0 if ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    """``rslurm gc [--dry-run]``: retention on both tiers and removal of interrupted leftovers."""
    from .catalog.gc import plan_gc, run_gc
    from .checkpoint.policy import RetentionPolicy

    # Even for --tier local: which local steps are durable decides what may go.
    catalog, cfg = _open_catalog(args, durable=True)
    policy = RetentionPolicy(cfg.keep_last, cfg.keep_every)
    tiers = ("local", "durable") if args.tier == "all" else (args.tier,)
    with catalog:
        if cfg.run_id:
            catalog.given_run(cfg.run_id, strict=args.run_id is not None)
        actions = plan_gc(catalog, policy, tiers=tiers, run_id=cfg.run_id,
                          stale_after=args.stale_after)
        if not args.dry_run:
            run_gc(catalog, actions, stale_after=args.stale_after)
    failed = [a for a in actions if a.state == "failed"]
    # Directories that could not be listed (nothing in them was deleted), and runs whose tags file cannot be read
    # (its message says that nothing of the run is deleted).
    errors = [f"{e}; nothing in it was deleted" for e in catalog.errors] + list(catalog.faults)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "keep_last": policy.keep_last, "keep_every": policy.keep_every,
                          "stale_after_s": args.stale_after, "ok": not failed and not errors,
                          "actions": [a.to_json() for a in actions], "errors": errors}, indent=1))
        return 1 if failed or errors else 0
    con = _console()
    for e in errors:
        _say(f"rslurm gc: {e}", file=sys.stderr)
    if not actions:
        con.print("nothing to delete", markup=False)
        return 1 if errors else 0
    head = "would delete (dry run; nothing was deleted):" if args.dry_run else "gc:"
    con.print(head, markup=False)
    cols = ["TIER", "RUN", "STEP", "WHAT", "SIZE", "WHERE", "WHY"] + ([] if args.dry_run else ["RESULT"])
    rows = [[a.tier, a.run_id, a.step, a.kind.replace("_", " "), _size(a.bytes), a.where, a.why]
            + ([] if args.dry_run else [a.state + (f": {a.detail}" if a.detail else "")]) for a in actions]
    con.print(_table(cols, rows, right=("STEP", "SIZE")))
    total = sum(a.bytes or 0 for a in actions if args.dry_run or a.state == "deleted")
    con.print(f"{'would free' if args.dry_run else 'freed'} {_size(total)}"
              + (f"; {len(failed)} failed" if failed else ""), markup=False)
    return 1 if failed or errors else 0


def cmd_export(args: argparse.Namespace) -> int:
    """``rslurm export STEP --format torch|safetensors|dcp|hf OUT``."""
    from .catalog.export import (
        check_out,
        check_out_of_trees,
        export_dcp,
        export_hf,
        export_safetensors,
        export_torch,
        output_paths,
    )
    from .catalog.source import open_source
    from .storage import parse_url

    if args.only and args.format == "dcp":
        raise ConfigError("--only works with --format torch, safetensors or hf (a DCP export copies the whole step)")
    if args.format == "hf" and len(args.only or []) != 1:
        raise ConfigError("--format hf needs exactly one --only KEY: the top-level key holding the model's "
                          "state_dict (e.g. --only model), whose tensors go to model.safetensors")
    catalog, cfg = _open_catalog(args, durable=args.tier != "local")
    trees = [("local tier", r) for r in catalog.roots]
    if cfg.durable and parse_url(cfg.durable)[0] == "file":
        trees.append(("durable tier", os.path.expanduser(parse_url(cfg.durable)[1])))
    with catalog:
        for path in output_paths(args.out, args.format):  # OUT and its config: before anything is read or written
            check_out_of_trees(path, trees)
        out = check_out(args.out, force=args.force, fmt=args.format)
        run = catalog.resolve_run(cfg.run_id, strict=args.run_id is not None)
        view = catalog.step(run, args.step)
        tier = catalog.choose_tier(view, args.tier)
        src = open_source(catalog, view, tier, scratch=os.path.dirname(out))
        total = sum(s.size for s in src.shards.values())
        with _progress(args)(f"export run {run} step {view.step} ({tier})", total) as adv:
            if args.format == "torch":
                res = export_torch(src, out, keys=args.only, progress=adv)
            elif args.format == "safetensors":
                res = export_safetensors(src, out, keys=args.only, progress=adv)
            elif args.format == "hf":
                res = export_hf(src, out, key=args.only[0], progress=adv)
            else:
                res = export_dcp(src, out, progress=adv)
    if args.json:
        print(json.dumps(res.to_json(), indent=1))
    else:
        keys = f"{len(res.keys)} key" + ("s" if len(res.keys) != 1 else "")
        config = (f"config to {res.config}" if res.config else
                  "no config (the step was saved without Checkpointer(config=...)), none written")
        if res.config_removed:
            config += f"; removed {res.config_removed}, an earlier export's config"
        _say(f"exported run {res.run_id} step {res.step} from the {res.tier} tier to {res.out} ({res.format}): "
              f"{keys}, {_size(res.bytes_read)} read from {len(res.files)} files, checksums verified; {config}")
    for note in res.notes:
        _say(f"rslurm export: note: {note}", file=sys.stderr)
    return 0


def cmd_tag(args: argparse.Namespace) -> int:
    """``rslurm tag STEP NAME`` / ``rslurm untag STEP NAME``: a run's tags in every copy reached."""
    from .catalog.tags import change_tag

    remove = args.command == "untag"
    catalog, cfg = _open_catalog(args, durable=args.tier != "local")
    tiers = ("local", "durable") if args.tier == "all" else (args.tier,)
    with catalog:
        run = catalog.resolve_run(cfg.run_id, strict=args.run_id is not None)
        step = catalog.resolve_step(run, args.step)
        change = change_tag(catalog, run, step, args.name, remove=remove, tiers=tiers)
    if args.json:
        print(json.dumps(change.to_json(), indent=1))
        return 0
    what = (f"untagged {change.tag!r} from run {change.run_id} step {change.step}" if remove
            else f"tagged run {change.run_id} step {change.step} as {change.tag!r}"
            + (f" (moved from step {change.moved_from})" if change.moved_from is not None else ""))
    _say(f"{what}: {', '.join(change.written)}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """``rslurm runs``: every run of a tier with its first and last step, state and size."""
    from .catalog.runs import summarize_run
    from .errors import StorageError

    catalog, cfg = _open_catalog(args, durable=args.tier != "local")
    tiers = {"all": ("local", "durable"), "local": ("local",), "durable": ("durable",)}[args.tier]
    now = time.time()
    with catalog:
        if cfg.run_id:
            runs = [catalog.given_run(cfg.run_id, strict=args.run_id is not None)]
        elif args.tier == "durable":
            try:
                runs = catalog.durable_runs()
            except StorageError as exc:
                catalog.errors.append(f"durable tier {catalog.durable_url}: {exc}")
                runs = []
        else:
            runs = catalog.runs(strict=False)
        docs = []
        unreadable: set[str] = set()  # runs whose tags file cannot be read: "?", not "-" (no tags)
        for run in runs:
            views = catalog.steps(run, strict=False)
            faults = len(catalog.faults)
            tags = _run_tags(catalog, run) if views else None
            if len(catalog.faults) > faults:
                unreadable.add(run)
            reached = [t for t in tiers if t == "local" or catalog.durable is not None]
            docs.append(summarize_run(run, views, tags, tiers=reached, now=now))
        out: dict[str, Any] = {"local_roots": catalog.roots if args.tier != "durable" else [],
                               "durable": catalog.durable_url if args.tier != "local" else None,
                               "runs": docs, "errors": catalog.errors + catalog.faults}
    if args.json:
        print(json.dumps(out, indent=1))
        return _listing_status(catalog)
    con = _console()

    def tier_cell(t: dict[str, Any] | None) -> str:
        if not t or not t["steps"]:
            return "-"
        return f"{t['steps']} step{'s' if t['steps'] != 1 else ''}, {_size(t['bytes'])}"

    has_durable = bool(out["durable"])
    cols = ["RUN", "STATE", "STEPS", "FIRST", "LAST", "SIZE"] + (["LOCAL"] if args.tier != "durable" else []) + (
        ["DURABLE"] if has_durable else []) + ["TAGS", "AGE"]
    rows = [[d["run_id"], d["state"].replace("_", " "), d["steps"], d["first_step"], d["last_step"], _size(d["bytes"])]
            + ([tier_cell(d["local"])] if args.tier != "durable" else [])
            + ([tier_cell(d["durable"])] if has_durable else [])
            + ["?" if d["run_id"] in unreadable else ", ".join(f"{n}={s}" for n, s in (d["tags"] or {}).items()) or "-",
               _age(d["age_s"])] for d in docs]
    if rows:
        con.print(_table(cols, rows, right=("STEPS", "FIRST", "LAST", "SIZE", "AGE")))
    else:
        con.print("(no runs)", markup=False)
    for e in out["errors"]:
        _say(f"error: {e}", file=sys.stderr)
    return _listing_status(catalog)


def cmd_daemon(args: argparse.Namespace) -> int:
    from .checkpoint.policy import RetentionPolicy
    from .daemon import Daemon, DaemonRunningError, daemon_running
    from .storage import open_durable

    given = _flag_settings(args, ("storage",))
    given.update(local_dir=args.local_dir, durable=args.durable, run_id=args.run_id)
    cfg = config.load(given, config_path=args.config)
    node = node_name(cfg.node_name)
    root = _local_root(cfg, node)
    if not cfg.durable:
        raise ConfigError("rslurm daemon: no durable tier; give --durable URL or set RSLURM_DURABLE "
                          "(/path, file:///path or s3://bucket/prefix)")
    if args.job_step and daemon_running(root):
        log.info("a rslurm daemon already drains %s on %s; this job step has nothing to do", root, node)
        return 0
    os.makedirs(root, mode=0o700, exist_ok=True)
    tier = open_durable(cfg)
    assert tier is not None
    save_signal = cfg.save_signal
    daemon = Daemon(root, tier, node=node, retention=RetentionPolicy(cfg.keep_last, cfg.keep_every),
                    run_ids=[cfg.run_id] if cfg.run_id else None, min_free=cfg.local_min_free,
                    poll_interval=cfg.drain_poll_interval, metrics_textfile=cfg.metrics_textfile,
                    ignore_signals=[] if save_signal == "none" else [getattr(signal, "SIG" + save_signal)])
    try:
        return daemon.run(once=args.once, job_step=args.job_step)
    except DaemonRunningError as exc:
        if args.job_step:
            log.info("%s; this job step has nothing to do", exc)
            return 0
        raise
    finally:
        tier.close()


def cmd_status(args: argparse.Namespace) -> int:
    from .daemon.status import collect_status, format_status

    cfg = config.load({**_flag_settings(args, ("storage",)), "local_dir": args.local_dir, "durable": args.durable,
                       "run_id": args.run_id}, config_path=args.config)
    node = node_name(cfg.node_name)
    root = _local_root(cfg, node)
    if args.run_id is not None:  # typed: a misspelt one is an error, as for every command (Catalog.given_run)
        _typed_run_exists(cfg)
    report = collect_status(root, cfg, run_id=cfg.run_id)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _say(format_status(report))
    return 2 if report["unreachable"] else 0  # a tier that could not be listed (named): as ls


def _typed_run_exists(cfg: config.Settings, tier: Any = None) -> None:
    """ConfigError naming the runs there when no tier has the run typed with ``--run-id`` (``tier``: the
    durable tier when the caller has it open; else it is opened, for reading, and closed)."""
    from .catalog import Catalog
    from .storage import open_durable

    own = tier is None and bool(cfg.durable)
    if own:
        tier = open_durable(cfg, upload_cap=False, create=False)
    try:
        Catalog(cfg.local_dir or default_local_dir(), node_name(cfg.node_name), tier,
                durable_url=cfg.durable).given_run(str(cfg.run_id))
    finally:
        if own and tier is not None:
            tier.close()


def cmd_history(args: argparse.Namespace) -> int:
    from .catalog.history import format_history, history_rows, read_history
    from .layout import root_runs
    from .paths import id_problem
    from .storage import open_durable

    cfg = config.load({**_flag_settings(args, ("storage",)), "local_dir": args.local_dir, "durable": args.durable,
                       "run_id": args.run_id}, config_path=args.config)
    root = _local_root(cfg, node_name(cfg.node_name))
    tier = open_durable(cfg, upload_cap=False, create=False) if cfg.durable else None
    try:
        if cfg.run_id:
            if args.run_id is not None:  # typed: a misspelt one is an error, as for ls (Catalog.given_run)
                _typed_run_exists(cfg, tier)
            runs = [cfg.run_id]
        else:
            try:
                runs = root_runs(root)
            except OSError as exc:
                raise ConfigError(f"local tier {root}: cannot list it ({exc.strerror}); set --local-dir/"
                                  "RSLURM_LOCAL_DIR to a root you can read, or give --run-id") from None
            if tier is not None:  # a StorageError names the tier (exit 2)
                runs = sorted(set(runs) | {n for n in tier.list_dirs("") if id_problem("run id", n) is None})
        found = [read_history(root, run, tier) for run in runs]
    finally:
        if tier is not None:
            tier.close()
    found = [h for h in found if h.source or h.errors or cfg.run_id]
    if args.json:
        print(json.dumps({"runs": [{"run_id": h.run_id, "source": h.source, "errors": list(h.errors),
                                    "ends": history_rows(h)} for h in found]}, indent=1))
    else:
        _say(format_history(found))
    return 1 if any(h.errors for h in found) else 0


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_picture_out(out: str, cfg: config.Settings) -> None:
    """``report --out``: never inside a tier or a run (a typo must not replace a step's manifest), and an
    existing file only when it is a picture (an earlier report's), else exit 2 before anything is written."""
    from .catalog.export import check_out_of_trees
    from .catalog.inventory import local_roots
    from .storage.registry import parse_url

    if not out:
        raise ConfigError("--out is empty: give the path of the picture to write")
    trees = [("local tier", r) for r in local_roots(cfg.local_dir or default_local_dir(), node_name(cfg.node_name))]
    if cfg.durable and parse_url(cfg.durable)[0] == "file":
        trees.append(("durable tier", os.path.expanduser(parse_url(cfg.durable)[1])))
    check_out_of_trees(out, trees, flag="--out", who="rslurm report")
    if os.path.lexists(out):
        try:
            fd = os.open(out, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                head = os.read(fd, len(_PNG_MAGIC)) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
            finally:
                os.close(fd)
        except OSError:
            head = b""
        if head != _PNG_MAGIC:
            raise ConfigError(f"--out {out} exists and is not a PNG picture: rslurm report replaces only an earlier "
                              "picture; choose another --out or remove it")


def cmd_report(args: argparse.Namespace) -> int:
    """``rslurm report [RUN]``: the run's timeline and goodput from its events and history."""
    from .catalog.history import read_history
    from .catalog.report import format_report, report_run, write_png
    from .layout import root_runs
    from .paths import default_run_id, id_problem
    from .rundir import RunDir
    from .storage import open_durable

    if args.run and args.run_id and args.run != args.run_id:
        raise ConfigError(f"two runs given: RUN {args.run!r} and --run-id {args.run_id!r}; give one")
    cfg = config.load({**_flag_settings(args, ("storage",)), "local_dir": args.local_dir, "durable": args.durable,
                       "run_id": args.run or args.run_id}, config_path=args.config)
    root = _local_root(cfg, node_name(cfg.node_name))
    if args.out is not None:  # an empty --out is refused, not read as "no picture"
        _check_picture_out(args.out, cfg)
    run = cfg.run_id
    if not run:
        try:
            runs = root_runs(root)
        except OSError as exc:
            raise ConfigError(f"local tier {root}: cannot list it ({exc.strerror}); set --local-dir/RSLURM_LOCAL_DIR "
                              "to a root you can read, or name the run: rslurm report RUN") from None
        job = default_run_id()
        if job in runs:
            run = job
        elif len(runs) == 1:
            run = runs[0]
        elif not runs:
            raise ConfigError(f"no runs in {root} (set --local-dir/RSLURM_LOCAL_DIR to where the run saves)")
        else:
            raise ConfigError(f"several runs in {root}: {', '.join(runs)}; pick one: rslurm report RUN")
    if (problem := id_problem("run id", run)) is not None:
        raise ConfigError(problem)
    run_dir = RunDir(root, run)
    if not os.path.isdir(run_dir.path):
        raise ConfigError(f"run {run}: no run directory {run_dir.path} (set --local-dir/RSLURM_LOCAL_DIR to the "
                          "node-local root the run saves in; the report reads the batch host's event log)")
    tier = open_durable(cfg, upload_cap=False, create=False) if cfg.durable else None
    try:
        history = read_history(root, run, tier)
    finally:
        if tier is not None:
            tier.close()
    report = report_run(root, run, history)
    doc = report.to_json()
    if args.out:
        try:
            write_png(report, args.out)
        except ImportError:
            raise ConfigError("rslurm report --out needs matplotlib: pip install 'resilient_slurm[demo]'") from None
        except OSError as exc:
            raise ConfigError(f"rslurm report: cannot write {args.out}: {exc.strerror or exc}") from None
        doc["picture"] = os.path.abspath(args.out)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _say(format_report(doc))
        if args.out:
            _say(f"  picture: {doc['picture']}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from .launcher.health import cli_main

    cfg = config.load({"local_dir": args.local_dir, "run_id": args.run_id,
                       "health_check_command": args.set_health_check_command}, config_path=args.config)
    return cli_main(cfg, as_json=args.json)


def cmd_demo(args: argparse.Namespace) -> int:
    from .examples.demo import main as demo_main

    return demo_main(list(args.demo_args))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to document the CLI)."""
    p = argparse.ArgumentParser(prog="rslurm", description="Resilient checkpointing for PyTorch on Slurm.")
    p.add_argument("--version", action="version", version=f"resilient_slurm {__version__}")
    p.add_argument("--config", default=None, help="TOML config file (default: $RSLURM_CONFIG)")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--local-dir", default=None, help="node-local root (RSLURM_LOCAL_DIR)")
        sp.add_argument("--run-id", default=None, help="run to inspect (RSLURM_RUN_ID; default: job id)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    def inspect(name: str, help: str, description: str, tiers: Sequence[str], default_tier: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=description + " Settings: flag > RSLURM_* environment > "
                            "config file > default. Exit codes: 0 ok, 1 a fault in the data, 2 bad usage or "
                            "settings, or a store that cannot be reached. See docs/cli.md.")
        sp.add_argument("--local-dir", default=None, help="node-local root; %%n = node name (RSLURM_LOCAL_DIR)")
        sp.add_argument("--durable", default=None, help="durable tier URL: /path, file:///path or s3://bucket/prefix "
                        "(RSLURM_DURABLE)")
        sp.add_argument("--run-id", default=None, help="run (RSLURM_RUN_ID; default: every run, or for one step "
                        "this job's run, else the only run)")
        sp.add_argument("--tier", choices=tiers, default=default_tier, help=f"which tier (default: {default_tier})")
        sp.add_argument("--json", action="store_true", help="one JSON document on stdout (no tables, no progress)")
        storage_flags(sp)
        return sp

    def storage_flags(sp: argparse.ArgumentParser) -> None:
        """The durable tier's connection settings as flags, for every command that reads the tier."""
        for n in INSPECT_STORAGE_FLAGS:
            st = config.SETTINGS[n]
            sp.add_argument(f"--{n.replace('_', '-')}", dest=f"set_{n}", default=None, metavar="V",
                            help=f"{st.help} ({st.env})".replace("%", "%%"))

    sp = inspect("ls", "list runs and steps with their state in each tier",
                 "List every run and step in the local tier (every storage domain directory visible here) and the "
                 "durable tier, merged: reason, size, ranks, state per tier, age, and why a step is invalid or "
                 "partial.", ("all", "local", "durable"), "all")
    sp.set_defaults(func=cmd_ls)
    sp = inspect("runs", "list the runs of each tier: first and last step, state, size, tags",
                 "One line per run in the local tier (every storage domain directory visible here) and the durable "
                 "tier: how many committed steps, the first and the last, the state of its newest step (durable, "
                 "committed, in progress, invalid), the size of its steps (each counted once) and in each tier, "
                 "its tags and the age of its last step.", ("all", "local", "durable"), "all")
    sp.set_defaults(func=cmd_runs)
    sp = inspect("show", "what a step holds: manifest, shards, state keys, RNG, data position",
                 "Show a step's manifest (reason, world size, versions, storage domains, every rank's shard) and "
                 "what its DCP metadata says the state holds: top-level keys, RNG state per rank, sampler or "
                 "data loader position. auto reads the local tier when the step is complete there, else the "
                 "durable tier.", ("auto", "local", "durable"), "auto")
    sp.add_argument("step", type=_step_arg, nargs="?", default=None, help="step number or tag (default: the "
                    "newest committed)")
    sp.set_defaults(func=cmd_show)
    sp = inspect("verify", "verify every checksum of one step or of all steps; exit 1 on any fault",
                 "Verify manifests, DCP metadata, domain manifests, and every shard's size, whole-file and "
                 "per-item xxh3, naming each bad file, its rank and what is wrong. auto: the local copies when "
                 "the step is complete locally, else the durable step, else the local copies there are; all: "
                 "both tiers. Exit 1 on any fault, or when nothing was verified.",
                 ("auto", "local", "durable", "all"), "auto")
    sp.add_argument("step", type=_step_arg, nargs="?", default=None, help="step number or tag (default: every "
                    "step of the run, or of every run)")
    sp.add_argument("--scratch-dir", default=None, help="where S3 shards are downloaded to be verified, one at "
                    "a time (default: $TMPDIR)")
    sp.set_defaults(func=cmd_verify)
    sp = inspect("gc", "apply retention and remove leftovers of interrupted saves and transfers",
                 "Delete the steps retention (keep_last, keep_every) does not keep, per run, in the local tier and "
                 "the durable tier, never the newest committed step nor the newest local step that is not durable "
                 "yet; remove in-progress directories, uncommitted durable steps and incomplete uploads "
                 "unchanged for --stale-after seconds. --dry-run prints exactly that and deletes nothing.",
                 ("all", "local", "durable"), "all")
    sp.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    sp.add_argument("--keep-last", dest="set_keep_last", default=None, metavar="N",
                    help=f"{config.SETTINGS['keep_last'].help} (RSLURM_KEEP_LAST)")
    sp.add_argument("--keep-every", dest="set_keep_every", default=None, metavar="N",
                    help=f"{config.SETTINGS['keep_every'].help} (RSLURM_KEEP_EVERY)")
    sp.add_argument("--stale-after", type=_seconds, default=STALE_AFTER_S, metavar="S",
                    help=f"seconds without change after which a leftover has no writer (default {STALE_AFTER_S:.0f}, "
                    "the daemon's; 0 removes every leftover: only when nothing saves or drains)")
    sp.set_defaults(func=cmd_gc)
    sp = inspect("export", "write a step as a torch.save file, safetensors weights, a DCP or a Hugging Face directory",
                 "Export a step for other tools: --format torch writes the complete state as one file that "
                 "torch.load(OUT, weights_only=True) reads; --format safetensors the model weights; --format dcp "
                 "a DCP checkpoint directory (.metadata and every rank's shard) that "
                 "torch.distributed.checkpoint.load reads; --format hf a directory with model.safetensors (the "
                 "key named by --only) and config.json that transformers' from_pretrained reads. The step's "
                 "config (Checkpointer(config=...)) goes with it: OUT/config.json for a directory, "
                 "<OUT without suffix>.config.json beside a file. Every byte is checked against the manifest, the "
                 "config against its sha256; nothing is left at OUT on failure. auto reads the local tier when "
                 "the step is complete there, else the durable tier.", ("auto", "local", "durable"), "auto")
    sp.add_argument("step", type=_step_arg, help="step number or tag to export")
    sp.add_argument("out", help="output file (torch, safetensors) or directory (dcp, hf); its parent must exist")
    sp.add_argument("--format", choices=("torch", "safetensors", "dcp", "hf"), required=True,
                    help="torch file (the whole state), safetensors file (model weights), DCP directory, or "
                    "Hugging Face directory (model.safetensors + config.json; needs --only KEY)")
    sp.add_argument("--force", action="store_true", help="replace an existing OUT and its config file (once the "
                    "export is complete)")
    sp.add_argument("--only", action="append", metavar="KEY", help="torch, safetensors: export only this top-level "
                    "key (repeatable), e.g. --only model; hf: the one key holding the model's state_dict")
    sp.set_defaults(func=cmd_export)
    tag_tiers = ("all", "local", "durable")
    tag_help = ("tag a step: retention, eviction and gc never remove a tagged step",
                "Tag STEP as NAME in every copy of the run's tags file reachable from here: each local storage domain "
                "directory of the run, and the durable tier. Retention (the engine's and the daemon's), the "
                "daemon's eviction and rslurm gc never remove a tagged step, on any tier. A name tags one step: "
                "tagging another step with it moves it there. NAME then stands where a STEP is expected (show, "
                "verify, export, untag).")
    untag_help = ("remove a tag: retention and gc treat the step as any other again",
                  "Remove tag NAME from STEP in every copy of the run's tags file reachable from here (as a removal "
                  "record, so that an older copy elsewhere, merged by the daemon, loses to it).")
    for name, (short, long) in (("tag", tag_help), ("untag", untag_help)):
        sp = inspect(name, short, long, tag_tiers, "all")
        sp.add_argument("step", type=_step_arg, help="step number (or a tag naming it)")
        sp.add_argument("name", type=_tag_arg, help="tag: 1-64 letters, digits, '.', '_', '-', not only digits")
        sp.set_defaults(func=cmd_tag)
    sp = sub.add_parser(
        "launch", help="run a job resiliently: -- srun ... inside an allocation, or -n N -- cmd ... locally",
        description="Run ranks, turn SIGTERM/SIGUSR1/SIGUSR2/SIGINT and cloud notices into an emergency "
        "checkpoint, then requeue the job (Slurm) or exit 75 (local). Every option below is also an "
        "RSLURM_* environment variable and a config key; ranks receive them as RSLURM_* variables.",
        usage="rslurm launch [options] -- srun [srun args] cmd ... | rslurm launch -n N [options] -- cmd ...")
    sp.add_argument("-n", "--nprocs", type=int, default=None,
                    help="start N local ranks (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK set)")
    for name, s in config.SETTINGS.items():
        if s.component in LAUNCH_FLAG_COMPONENTS:
            sp.add_argument(f"--{name.replace('_', '-')}", dest=f"set_{name}", default=None, metavar="V",
                            help=f"{s.help} ({s.env})".replace("%", "%%"))
    sp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command (srun ... or the program)")
    sp.set_defaults(func=cmd_launch)
    sp = sub.add_parser(
        "daemon", help="drain committed steps from the node-local tier to the durable tier",
        description="Per node: watch the local tier, drain committed steps (emergency first) to the durable "
        "tier with verification, commit them there once every node's shards are in, apply retention on both "
        "tiers and keep the local tier above local_min_free. Runs until SIGTERM, or with --once until "
        "nothing is left to do. Exit codes: 0 ok, 1 a step could not be drained, 2 bad settings or another "
        "daemon already drains this directory.")
    sp.add_argument("--local-dir", default=None, help="node-local root (RSLURM_LOCAL_DIR)")
    sp.add_argument("--durable", default=None, help="durable tier URL (RSLURM_DURABLE)")
    sp.add_argument("--run-id", default=None, help="drain only this run (RSLURM_RUN_ID; default: every run)")
    sp.add_argument("--once", action="store_true", help="drain what is there, then exit")
    sp.add_argument("--job-step", action="store_true",
                    help="started by the launcher: exit 0 at once if a daemon service already drains this node")
    for name, s in config.SETTINGS.items():
        if s.component == "storage":
            sp.add_argument(f"--{name.replace('_', '-')}", dest=f"set_{name}", default=None, metavar="V",
                            help=f"{s.help} ({s.env})".replace("%", "%%"))
    sp.set_defaults(func=cmd_daemon)
    sp = sub.add_parser("status", help="each step's state per tier (in progress, local, draining, durable) "
                        "and the drain lag")
    common(sp)
    sp.add_argument("--durable", default=None, help="durable tier URL (RSLURM_DURABLE)")
    storage_flags(sp)
    sp.set_defaults(func=cmd_status)
    sp = sub.add_parser("history", help="every incarnation of a run: how it ended (preempted, time limit, hang, "
                        "out of memory, ...) and the evidence",
                        description="Every end of a run's incarnations and of its in-job restarts, oldest first: "
                        "the class (preempted, time limit, cloud termination, hang, killed by signal, out of memory, "
                        "communicator error, node failure, storage unavailable, user error, completed), the evidence "
                        "it was read from (signal, matched line, OOM counter), the rank and node, the steps and what "
                        "the launcher did. Read from the run directory and the durable tier (the newer copy). "
                        "Exit codes: 0 ok, 1 a history file is unreadable, 2 bad usage or settings.")
    common(sp)
    sp.add_argument("--durable", default=None, help="durable tier URL (RSLURM_DURABLE)")
    storage_flags(sp)
    sp.set_defaults(func=cmd_history)
    sp = sub.add_parser("report", help="a picture of a run: its incarnations, saves, restores, drains and goodput",
                        description="The run's timeline from its event log and history: every incarnation and run "
                        "of its ranks with why it ended, the saves (stall), restores (time, tier), drains, the steps "
                        "recomputed, and the goodput (training time kept / wall time) with its losses by cause. "
                        "--out writes it as a PNG (matplotlib). Exit codes: 0 ok, 2 bad usage or settings (a run "
                        "that does not exist).")
    sp.add_argument("run", nargs="?", default=None, help="the run (default: --run-id, RSLURM_RUN_ID, this job's "
                    "run, else the only run)")
    common(sp)
    sp.add_argument("--durable", default=None, help="durable tier URL, for the history's copy there (RSLURM_DURABLE)")
    sp.add_argument("--out", default=None, metavar="PNG", help="also draw the report to this PNG file")
    storage_flags(sp)
    sp.set_defaults(func=cmd_report)
    sp = sub.add_parser("health", help="this node's health checks, as the launcher runs them on every node before "
                        "each launch", description="The checks `rslurm launch` runs on every node before it starts "
                        "the ranks: the local directory is writable with room for the run's newest checkpoint, the "
                        "GPUs answer nvidia-smi when the node has any, and health_check_command exits 0. Exit codes: "
                        "0 healthy, 1 not, 2 bad settings.")
    common(sp)
    sp.add_argument("--health-check-command", dest="set_health_check_command", default=None, metavar="CMD",
                    help=f"{config.SETTINGS['health_check_command'].help} (RSLURM_HEALTH_CHECK_COMMAND)")
    sp.set_defaults(func=cmd_health)
    submit.add_parser(sub)
    doctor.add_parser(sub)
    rehearse.add_parser(sub)
    diff.add_parser(sub)
    sp = sub.add_parser("demo", help="tiny transformer under rslurm launch: SIGTERM, emergency save, resume, "
                        "compare bitwise, loss-curve PNG (rslurm demo -h)")
    sp.add_argument("demo_args", nargs=argparse.REMAINDER)
    sp.set_defaults(func=cmd_demo)
    return p


def _failed(args: argparse.Namespace, exc: Exception, code: int) -> int:
    """A command that ends on an error: the message on stderr and, with ``--json``, one JSON document on stdout
    (``{"ok": false, "command", "error", "exit_code"}``: a script reading stdout gets a document, not nothing);
    returns ``code``."""
    _say(f"rslurm: error: {exc}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "command": args.command, "error": str(exc), "exit_code": code}, indent=1))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rslurm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # every argument is the demo's own (argparse.REMAINDER refuses a leading option)
        from .examples.demo import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        # only log_level here: each command loads (and checks) every setting itself, doctor reports them
        level = config.resolve(["log_level"], {}, config_path=args.config)["log_level"]
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=level, handlers=[handler])
        return int(args.func(args))
    except CorruptCheckpointError as exc:  # a fault in the data, not in how rslurm was called
        return _failed(args, exc, 1)
    except ResilientSlurmError as exc:
        return _failed(args, exc, 2)
    except KeyboardInterrupt:  # Ctrl-C: what a command writes is published whole or not at all
        _say(f"rslurm {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `rslurm ls | head`: the reader went away; end as a tool killed by SIGPIPE does
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail too
        return 128 + signal.SIGPIPE


def rsrun_main() -> int:
    """Entry point of the ``rsrun`` console script, a drop-in for ``srun``: ``rsrun ARGS`` is
    ``rslurm launch -- srun ARGS`` (launcher options go in ``RSLURM_*`` variables)."""
    return main(["launch", "--", "srun", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
