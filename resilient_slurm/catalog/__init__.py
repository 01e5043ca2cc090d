"""The logic behind ``rslurm ls``, ``show``, ``verify``, ``gc`` and ``export``: the on-disk contract
(``manifest.py``) read across the node-local tier and the durable tier (POSIX or S3).

Who calls what: ``cli.py`` parses arguments and resolves settings, opens a
:class:`~.inventory.Catalog` and calls, per command: :meth:`~.inventory.Catalog.steps` (ls),
:func:`~.source.open_source` then :func:`~.describe.describe` (show),
:func:`~.checks.verify_view` (verify: which copies, then
:mod:`resilient_slurm.checkpoint.verify`), :func:`~.gc.plan_gc` then :func:`~.gc.run_gc` (gc),
:func:`~.export.export_torch` / ``export_safetensors`` / ``export_dcp`` / ``export_hf`` (export, each with the
step's config); it prints what they return.
Nothing in this package imports torch at import time, and nothing but ``gc`` and ``export`` writes.
"""

from .inventory import (
    Catalog,
    DurableCopy,
    LocalCopy,
    ReplicaSet,
    ReplicaStep,
    StepView,
    local_roots,
    scan_replicas,
)

__all__ = ["Catalog", "DurableCopy", "LocalCopy", "ReplicaSet", "ReplicaStep", "StepView", "local_roots",
           "scan_replicas"]
