"""Argument types and settings shared by the ``rslurm`` commands (cli.py and the command modules beside it,
diff.py): a step or tag argument, the settings given as flags, the catalog of an inspection command. Below
the commands: it imports none of them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from . import config
from .errors import ConfigError
from .paths import default_local_dir, expand_local_dir, nearest_existing, node_name

if TYPE_CHECKING:
    from .catalog import Catalog

# Storage settings the inspection commands take as flags (how to reach the durable tier).
INSPECT_STORAGE_FLAGS = ("s3_endpoint_url", "s3_region", "s3_max_attempts", "drain_threads")


def flag_settings(args: argparse.Namespace, components: tuple[str, ...]) -> dict[str, Any]:
    """Settings given as ``--name`` flags (parsed and checked like their environment variables)."""
    out: dict[str, Any] = {}
    for name, s in config.SETTINGS.items():
        value = getattr(args, f"set_{name}", None)
        if s.component not in components or value is None:
            continue
        try:
            s.parse(value)
        except ValueError as exc:
            raise ConfigError(f"--{name.replace('_', '-')}={value!r}: {exc}") from exc
        out[name] = value  # the text: an explicit 'none' (unset) then wins over the environment and file
    return out



def step_arg(v: str) -> int | str:
    """A STEP argument: a step number, or a tag (resolved per run by ``Catalog.resolve_step``)."""
    from .paths import id_problem

    if v.isascii() and v.isdigit():
        problem = id_problem("step", v)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return int(v)
    problem = id_problem("tag", v)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected a step number or a tag, got {v[:80]!r} ({problem})")
    return v


def tag_arg(v: str) -> str:
    from .paths import id_problem

    problem = id_problem("tag", v)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"invalid tag name: {problem}")
    return v


def inspect_settings(args: argparse.Namespace) -> config.Settings:
    """Settings of an inspection command: flag > RSLURM_* environment > config file > default."""
    given = flag_settings(args, ("storage", "checkpoint"))
    given.update(local_dir=args.local_dir, durable=args.durable, run_id=args.run_id)
    return config.load(given, config_path=args.config)


def local_root(cfg: config.Settings, node: str) -> str:
    """This node's local root (``local_dir`` for ``node``); ConfigError when something other than a directory
    is there."""
    import os

    root = expand_local_dir(cfg.local_dir or default_local_dir(), node)
    there = nearest_existing(root)
    if not os.path.isdir(there):
        raise ConfigError(f"local_dir {root} is not a directory ({there} is not one); set --local-dir/RSLURM_LOCAL_DIR "
                          "to the node-local root the run saves in")
    return root


def open_catalog(args: argparse.Namespace, *, durable: bool) -> tuple[Catalog, config.Settings]:
    """The catalog of the command's tiers; ``durable`` False leaves the durable tier closed (not read). A local
    root that is a file (or lies below one) is a ConfigError, for every command alike."""
    from .catalog import Catalog

    cfg = inspect_settings(args)
    if args.tier == "durable" and not cfg.durable:
        raise ConfigError("--tier durable: no durable tier; give --durable URL or set RSLURM_DURABLE")
    template = cfg.local_dir or default_local_dir()
    node = node_name(cfg.node_name)
    local_root(cfg, node)
    if not durable:
        return Catalog(template, node, None), cfg
    return Catalog.open(cfg, local_template=template, node=node), cfg
