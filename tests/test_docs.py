"""Docs stay in step with the code: every setting is documented."""

from __future__ import annotations

from pathlib import Path

from resilient_slurm.config import SETTINGS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_setting_is_in_the_configuration_reference() -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [s.env for s in SETTINGS.values() if f"`{s.env}`" not in text or f"`{s.name}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"
