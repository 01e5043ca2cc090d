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
LOWER = ["checkpoint", "storage", "manifest.py", "layout.py", "tags.py", "paths.py", "errors.py", "config.py", "jobenv.py",
         "telemetry.py", "failpoints.py", "distributed.py", "terminal.py", "rendezvous.py"]
# A package stands for all its modules: "resilient_slurm.doctor" covers doctor/storage.py, doctor/probe.py...;
# "resilient_slurm.examples" the README demo (examples/demo.py) and the example training programs.
UPPER = ["resilient_slurm.daemon", "resilient_slurm.launcher", "resilient_slurm.cli", "resilient_slurm.catalog",
         "resilient_slurm.doctor", "resilient_slurm.submit", "resilient_slurm.examples", "resilient_slurm.slurm",
         "resilient_slurm.rehearse"]


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


def _upward(names: set[str]) -> list[str]:
    """The names among ``names`` that are an upper layer or inside one."""
    return sorted(n for n in names if any(n == u or n.startswith(u + ".") for u in UPPER))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_lower_layers_do_not_import_upper_ones(path: Path) -> None:
    bad = _upward(_imports(path))
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}: move what it needs down a layer"


def test_the_check_sees_a_lazy_relative_import() -> None:
    names = _imports(PKG / "checkpoint" / "engine.py", "def f():\n    from ..daemon.drain import durable_steps\n")
    assert "resilient_slurm.daemon.drain" in names
    names = _imports(PKG / "manifest.py", "from .launcher import launch\n")
    assert "resilient_slurm.launcher" in names


def test_every_upper_layer_exists() -> None:
    """A name in UPPER that no longer matches a module or package (one renamed or moved) would make the
    check pass vacuously."""
    missing = [u for u in UPPER if not (PKG / (u.split(".", 1)[1] + ".py")).is_file()
               and not (PKG / u.split(".", 1)[1] / "__init__.py").is_file()]
    assert not missing, f"UPPER names modules that do not exist: {missing}"


def test_the_check_sees_the_doctor_package_and_the_demo() -> None:
    """doctor and examples are packages: an import of one of their modules, relative or absolute, is upward."""
    names = _imports(PKG / "storage" / "fileio.py", "def f():\n    from ..doctor.storage import mount_of\n")
    assert "resilient_slurm.doctor.storage" in _upward(names)
    names = _imports(PKG / "paths.py", "from resilient_slurm.doctor import probe\n")
    assert "resilient_slurm.doctor.probe" in _upward(names)
    names = _imports(PKG / "checkpoint" / "engine.py", "from ..examples.demo import main\n")
    assert "resilient_slurm.examples.demo" in _upward(names)
    assert not _upward({"resilient_slurm.paths", "resilient_slurm.storage.fileio", "resilient_slurm.doctoral"})
