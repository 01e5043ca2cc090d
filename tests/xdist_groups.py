"""Two workers, one Slurm cluster: how `make test` (`pytest -n 2 --dist loadgroup`) shares out the suite.

Every test on the session's Slurm cluster (a test that uses the ``slurm`` or ``slurm_cluster`` fixture) must
run on one worker, one after another: the test cluster has two nodes and each test wants both, and a
second worker would start a second cluster beside it. pytest-xdist's own ``loadgroup`` cannot do this under
pytest 9: it marks a group by appending ``@group`` to ``item._nodeid``, which pytest 9 no longer reads
(a node's id is ``str(item._id)``), so every test was its own group and both workers started clusters.

So the grouping is done here, in two halves that meet through one file:
- on each worker, :func:`record` (called from ``conftest.pytest_collection_modifyitems``) writes the ids of
  the Slurm tests to ``<tmp>/rslurm-xdist-<testrunuid>.slurm``;
- on the controller, :class:`SlurmGroupScheduling` (returned by ``conftest.pytest_xdist_make_scheduler``
  for ``--dist loadgroup``) reads it when every worker has collected, and makes those tests one scope;
  every other test is a scope of its own. Scopes go out largest first (xdist's default), so the Slurm chain,
  the longest, starts at once on one worker while the other takes the rest.

The tests that share a module-scoped fixture (a trained run, a crashed run, a telemetry scenario: 10 to 50
seconds to set up) are a scope too, one per module: on two workers each such fixture would otherwise be
built twice, once per worker that happens to get one of its tests (:func:`shared_scope`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

GROUP = "slurm"


def _ids_file(testrunuid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"rslurm-xdist-{testrunuid}.slurm"


# Fixtures set up once for several tests: such a fixture defined in a test module makes its tests one scope.
_SHARED = ("module", "class", "package")


def shared_scope(item: Any) -> str | None:
    """The scope for a test that uses a fixture set up once per module (or class) of its test file, else
    None. Session fixtures (the S3 server) are left alone: each worker needs its own anyway."""
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs and defs[-1].scope in _SHARED:
            return item.nodeid.split("::", 1)[0]
    return None


def record(workerinput: dict, scopes: Mapping[str, str | None]) -> None:
    """On a worker: write every grouped test's id and its scope for the controller (every worker writes the
    same lines)."""
    path = _ids_file(workerinput["testrunuid"])
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text("".join(f"{scope}\t{nodeid}\n" for nodeid, scope in scopes.items() if scope))
    os.replace(tmp, path)


class SlurmGroupScheduling(LoadScopeScheduling):
    """``loadscope`` where the scope of a test is the Slurm group for a Slurm test, its file for a test that
    shares a module-scoped fixture, else the test itself."""

    _scopes: dict[str, str] = {}

    def schedule(self) -> None:
        if self.collection is None and self.nodes:  # the first call: every worker has collected
            path = _ids_file(self.nodes[0].workerinput["testrunuid"])
            try:
                lines = path.read_text().splitlines()
            except FileNotFoundError:  # no worker wrote one: no test of this run is grouped
                lines = []
            else:
                path.unlink(missing_ok=True)
            self._scopes = {nodeid: scope for scope, nodeid in (line.split("\t", 1) for line in lines)}
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        return self._scopes.get(nodeid, nodeid)
