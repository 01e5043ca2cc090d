"""Dependencies point down: the checkpoint engine, the storage tiers and the on-disk layout know nothing
of the daemon, the launcher, the inspection CLI or doctor (docs/architecture.md, "Layers").

Every import in those modules is read from the source with ``ast``, including imports inside functions
(a lazy import is still a dependency), and resolved to an absolute module name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "resilient_slurm"

# The lower layers, and what they may not import.
LOWER = ["checkpoint", "storage", "manifest.py", "paths.py", "errors.py", "config.py", "telemetry.py",
         "failpoints.py", "distributed.py"]
UPPER = ["resilient_slurm.daemon", "resilient_slurm.launcher", "resilient_slurm.cli", "resilient_slurm.catalog",
         "resilient_slurm.doctor", "resilient_slurm.submit", "resilient_slurm.demo", "resilient_slurm.slurm"]


def _modules() -> list[Path]:
    out: list[Path] = []
    for entry in LOWER:
        p = PKG / entry
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def _imports(path: Path, text: str | None = None) -> set[str]:
    """Absolute names of every module ``path`` imports (``from X import y`` yields X and X.y); ``text``
    replaces the file's source."""
    package = ["resilient_slurm", *path.relative_to(PKG).parent.parts]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.add(mod)
            names |= {f"{mod}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_lower_layers_do_not_import_upper_ones(path: Path) -> None:
    bad = sorted(n for n in _imports(path) if any(n == u or n.startswith(u + ".") or n.startswith(u + "_")
                                                  for u in UPPER))
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}: move what it needs down a layer"


def test_the_check_sees_a_lazy_relative_import() -> None:
    names = _imports(PKG / "checkpoint" / "engine.py", "def f():\n    from ..daemon.drain import durable_steps\n")
    assert "resilient_slurm.daemon.drain" in names
    names = _imports(PKG / "manifest.py", "from .launcher import launch\n")
    assert "resilient_slurm.launcher" in names
