"""Docs stay in step with the code: every setting is documented."""

from __future__ import annotations

from pathlib import Path

from resilient_slurm.config import SETTINGS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_setting_is_in_the_configuration_reference() -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [s.env for s in SETTINGS.values() if f"`{s.env}`" not in text or f"`{s.name}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_flags_in_the_configuration_reference_exist() -> None:
    """Every `rslurm CMD --flag` the reference names is an option of that command."""
    import argparse
    import re

    from resilient_slurm.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    text = (DOCS / "configuration.md").read_text()
    named = re.findall(r"`(launch|daemon|gc|status|ls|show|verify|export|doctor) (--[a-z0-9-]+)`", text)
    named += [(cmd.strip(), flag) for flag, cmds in re.findall(r"`(--[a-z-]+)` \(([a-z, ]+)\)", text)
              for cmd in cmds.split(",")]
    assert len(named) > 40
    missing = [f"{c} {f}" for c, f in named if f not in subs[c]._option_string_actions]
    assert not missing, f"docs/configuration.md names options that do not exist: {missing}"
