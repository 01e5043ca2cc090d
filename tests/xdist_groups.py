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
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

GROUP = "slurm"


def _ids_file(testrunuid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"rslurm-xdist-{testrunuid}.slurm"


def record(workerinput: dict, nodeids: Iterable[str]) -> None:
    """On a worker: write the Slurm tests' ids for the controller (every worker writes the same list)."""
    path = _ids_file(workerinput["testrunuid"])
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text("".join(f"{n}\n" for n in nodeids))
    os.replace(tmp, path)


class SlurmGroupScheduling(LoadScopeScheduling):
    """``loadscope`` where the scope of a test is the Slurm group for a Slurm test, else the test itself."""

    _slurm: frozenset[str] = frozenset()

    def schedule(self) -> None:
        if self.collection is None and self.nodes:  # the first call: every worker has collected
            path = _ids_file(self.nodes[0].workerinput["testrunuid"])
            try:
                self._slurm = frozenset(path.read_text().splitlines())
            except FileNotFoundError:  # no worker wrote one: no test of this run uses the cluster
                self._slurm = frozenset()
            else:
                path.unlink(missing_ok=True)
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        return GROUP if nodeid in self._slurm else nodeid
