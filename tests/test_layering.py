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
         "telemetry.py", "failpoints.py", "distributed.py", "terminal.py", "rendezvous.py", "run_history.py",
         "early_signals.py"]
# A package stands for all its modules: "resilient_slurm.doctor" covers doctor/storage.py, doctor/probe.py...;
# "resilient_slurm.examples" the README demo (examples/demo.py) and the example training programs.
UPPER = ["resilient_slurm.entry", "resilient_slurm.daemon", "resilient_slurm.launcher", "resilient_slurm.cli", "resilient_slurm.catalog",
         "resilient_slurm.doctor", "resilient_slurm.submit", "resilient_slurm.examples", "resilient_slurm.slurm",
         "resilient_slurm.rehearse", "resilient_slurm.diff", "resilient_slurm.cliargs",
         "resilient_slurm.integrations"]


def _modules() -> list[Path]:
    out: list[Path] = []
    for entry in LOWER:
        p = PKG / entry
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def _imports(path: Path, text: str | None = None, *, typing_only: bool = True,
             modules: set[str] | None = None) -> set[str]:
    """Absolute names of every module ``path`` imports (``from X import y`` yields X and X.y); ``text``
    replaces the file's source. ``typing_only`` False leaves out ``if TYPE_CHECKING:`` blocks (annotations,
    not imports at run time). With ``modules`` (the package's module names), ``from X import y`` yields only
    X.y when that is a module (importing a submodule), else only X."""
    package = ["resilient_slurm", *path.relative_to(PKG).parent.parts]
    names: set[str] = set()
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    if not typing_only:
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list):
                node.body = [b for b in body  # type: ignore[attr-defined]
                             if not (isinstance(b, ast.If) and "TYPE_CHECKING" in ast.unparse(b.test))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if modules is None:
                names.add(mod)
                names |= {f"{mod}.{a.name}" for a in node.names}
            else:
                names |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names}
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


# ----------------------------------------------------------------------------- cross-rank calls
# Collectives of torch.distributed, and the Coordinator's primitives behind its phases.
_COLLECTIVE = ("all_gather", "all_gather_object", "all_reduce", "broadcast", "broadcast_object_list", "barrier",
               "reduce", "gather", "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "all_to_all",
               "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier")
_PRIMITIVES = ("_all_gather", "_all_max", "_bytes_max")
_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
# Where each kind of call may be: the phase primitive (coordination.py), and the point-to-point transfers of
# peer replicas (peers.py: paired rounds with their own failure protocol, run inside a phase at a restore).
_ALLOWED = {"collective": {"checkpoint/coordination.py"}, "p2p": {"checkpoint/peers.py"}}
# Example training programs are the user's code, not the product's.
_USER_CODE = ("examples/",)


def _cross_rank_calls(path: Path, text: str | None = None) -> list[tuple[str, str, int]]:
    """(kind, name, line) of every collective, primitive or point-to-point call in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            owner = ast.unparse(node.func.value)
            if name in _PRIMITIVES:
                out.append(("collective", name, node.lineno))
            elif name in _COLLECTIVE and owner in ("dist", "torch.distributed"):
                out.append(("collective", name, node.lineno))
            elif name in _P2P and owner in ("dist", "torch.distributed"):
                out.append(("p2p", name, node.lineno))
    return out


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_cross_rank_calls_go_through_the_phase_primitive(path: Path) -> None:
    """Every cross-rank step is a phase (Coordinator.phase / phase_max / phase_flags): a rank whose part
    raised tells the others, so none waits in a collective a failed rank will not join."""
    rel = path.relative_to(PKG).as_posix()
    if rel.startswith(_USER_CODE):
        return
    bad = [f"line {line}: {name}" for kind, name, line in _cross_rank_calls(path) if rel not in _ALLOWED[kind]]
    assert not bad, f"{rel} makes cross-rank calls outside the phase primitive: {bad}"


def test_the_check_sees_collectives_and_primitives() -> None:
    calls = _cross_rank_calls(PKG / "checkpoint" / "engine.py",
                              "def f(coord, t):\n    dist.all_reduce(t)\n    coord._all_gather(1)\n    dist.isend(t, 1)\n")
    assert [(k, n) for k, n, _ in calls] == [("collective", "all_reduce"), ("collective", "_all_gather"),
                                             ("p2p", "isend")]


# ------------------------------------------------------------------------------------- import cycles
# The upper layers, from the top: each may import only those below it (and the lower layers). Written down in
# docs/architecture.md, "Layers".
TIERS = [["resilient_slurm.entry"],
         ["resilient_slurm.cli"],
         ["resilient_slurm.diff", "resilient_slurm.submit", "resilient_slurm.rehearse", "resilient_slurm.doctor",
          "resilient_slurm.examples"],
         ["resilient_slurm.cliargs"],
         ["resilient_slurm.launcher"],
         ["resilient_slurm.daemon"],
         ["resilient_slurm.catalog", "resilient_slurm.slurm", "resilient_slurm.integrations"]]


def _module_names() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _graph(level: str) -> dict[str, set[str]]:
    """Who imports whom inside the package (lazy imports too; ``from pkg import mod`` is an import of ``mod``):
    between modules, or between packages (``resilient_slurm.<package or top-level module>``)."""
    mods = _module_names()

    def node(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if level == "package" else name

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for imported in _imports(path, typing_only=False, modules=set(mods)):
            parts = imported.split(".")
            hit = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods), None)
            if hit is not None:
                targets.add(hit)
        graph.setdefault(node(name), set()).update(node(t) for t in targets if node(t) != node(name))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_cycles(level: str) -> None:
    cycles = _cycles(_graph(level))
    assert not cycles, f"import cycles between {level}s: {cycles}: move what both need down a layer"


def test_upper_layers_import_only_downwards() -> None:
    graph = _graph("package")
    tier = {p: i for i, names in enumerate(TIERS) for p in names}
    bad = [f"{a} -> {b}" for a in tier for b in sorted(graph.get(a, ())) if b in tier and tier[b] <= tier[a]]
    assert not bad, f"upper layers importing sideways or upwards (docs/architecture.md, Layers): {bad}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles({"a": {"b"}, "b": set()})


# The three hubs stay facades over the modules that do the work (issue 28): each class under 300 lines.
HUBS = [("checkpoint/checkpointer.py", "Checkpointer"), ("launcher/launch.py", "Launcher"),
        ("checkpoint/restore.py", "Restorer")]
HUB_LINES = 300


def _class_lines(path: Path, name: str) -> int:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return (node.end_lineno or node.lineno) - node.lineno + 1
    raise AssertionError(f"class {name} not found in {path}")


@pytest.mark.parametrize("rel,name", HUBS)
def test_the_hubs_stay_under_300_lines(rel: str, name: str) -> None:
    lines = _class_lines(PKG / rel, name)
    assert lines < HUB_LINES, (f"{name} ({rel}) is {lines} lines: move what it does into the module that owns "
                               f"it and keep {name} a facade (docs/architecture.md)")


def test_the_size_check_counts_a_class_whole(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("x = 1\n\nclass A:\n    def f(self):\n        return 1\n\n    def g(self):\n        pass\n")
    assert _class_lines(src, "A") == 6
