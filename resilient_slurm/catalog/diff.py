"""``rslurm diff A B``: what differs between two steps: state keys, shapes, dtypes and provenance.

Who calls what: ``resilient_slurm/diff.py`` (the command) opens a :class:`~.source.StepSource` for each
step and calls :func:`step_facts` on each (the manifest's provenance and every key of the DCP metadata,
read with the restricted unpickler; no shard is read), then :func:`compare`, and prints
:func:`format_diff` or the JSON document. Keys are DCP's flattened keys (``model.0.weight``,
``opt.state.0.exp_avg``), as ``restore(allow_missing=...)`` names them. The RNG state and DDP's bucket
layout are left out of the key comparison (they differ with the world size and are not the model's);
the world size is compared as part of the provenance and the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..checkpoint.state import RESERVED_KEYS
from .source import StepSource


def step_facts(src: StepSource) -> dict[str, Any]:
    """One step's side of a diff: run, step, world size, provenance and ``keys`` (key -> kind, shape, dtype)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = src.metadata()
    keys: dict[str, dict[str, Any]] = {}
    for fqn, smd in md.state_dict_metadata.items():
        if fqn.split(".", 1)[0] in RESERVED_KEYS:
            continue
        if isinstance(smd, TensorStorageMetadata):
            keys[fqn] = {"kind": "tensor", "shape": list(smd.size),
                         "dtype": str(smd.properties.dtype).removeprefix("torch.")}
        else:
            keys[fqn] = {"kind": "value", "shape": None, "dtype": None}
    m = src.manifest
    return {"run_id": m.run_id, "step": m.step, "tier": src.tier, "where": src.where, "world_size": m.world_size,
            "reason": m.reason, "provenance": m.provenance, "keys": keys}


def _flat(v: Any, prefix: str = "") -> dict[str, Any]:
    """A provenance document as ``{"code.git_commit": ..., "config": ...}`` (the config compared whole)."""
    if isinstance(v, Mapping) and prefix != "config":
        out: dict[str, Any] = {}
        for k, x in v.items():
            out.update(_flat(x, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: v}


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The diff document of two :func:`step_facts`: ``only_in_a`` / ``only_in_b`` (keys), ``shape`` and
    ``dtype`` (``{key, a, b}``, a tensor on one side and a plain value on the other counts as a shape
    change), ``provenance`` (``{field, a, b}``; ``null`` when a step has none) and ``equal``."""
    ka, kb = a["keys"], b["keys"]
    shape, dtype = [], []
    for key in sorted(set(ka) & set(kb)):
        x, y = ka[key], kb[key]
        if x["kind"] != y["kind"] or x["shape"] != y["shape"]:
            shape.append({"key": key, "a": x["shape"] if x["kind"] == "tensor" else "value",
                          "b": y["shape"] if y["kind"] == "tensor" else "value"})
        elif x["dtype"] != y["dtype"]:
            dtype.append({"key": key, "a": x["dtype"], "b": y["dtype"]})
    pa, pb = _flat(a.get("provenance") or {}), _flat(b.get("provenance") or {})
    prov = [{"field": f, "a": pa.get(f), "b": pb.get(f)} for f in sorted(set(pa) | set(pb)) if pa.get(f) != pb.get(f)]
    if a.get("world_size") != b.get("world_size") and not any(p["field"] == "world_size" for p in prov):
        prov.append({"field": "world_size", "a": a.get("world_size"), "b": b.get("world_size")})
    doc: dict[str, Any] = {
        "a": {k: a[k] for k in ("run_id", "step", "tier", "where", "world_size", "reason")},
        "b": {k: b[k] for k in ("run_id", "step", "tier", "where", "world_size", "reason")},
        "only_in_a": sorted(set(ka) - set(kb)),
        "only_in_b": sorted(set(kb) - set(ka)),
        "shape": shape,
        "dtype": dtype,
        "provenance": prov,
        "provenance_recorded": {"a": a.get("provenance") is not None, "b": b.get("provenance") is not None},
    }
    doc["equal"] = not (doc["only_in_a"] or doc["only_in_b"] or shape or dtype or prov)
    return doc


def _short(v: Any, n: int = 160) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters; --json has it all)"


def format_diff(doc: Mapping[str, Any]) -> list[str]:
    """The text of ``rslurm diff`` (every difference, one per line)."""
    a, b = doc["a"], doc["b"]
    out = [f"A: run {a['run_id']} step {a['step']} ({a['tier']} tier: {a['where']})",
           f"B: run {b['run_id']} step {b['step']} ({b['tier']} tier: {b['where']})"]
    if doc["equal"]:
        out.append("no difference in keys, shapes, dtypes or provenance")
        return out
    for key in doc["only_in_a"]:
        out.append(f"- {key}  (only in A)")
    for key in doc["only_in_b"]:
        out.append(f"+ {key}  (only in B)")
    for d in doc["shape"]:
        out.append(f"~ {d['key']}  shape {d['a']} -> {d['b']}")
    for d in doc["dtype"]:
        out.append(f"~ {d['key']}  dtype {d['a']} -> {d['b']}")
    for side in ("a", "b"):
        if not doc["provenance_recorded"][side]:
            out.append(f"provenance: none usable in {side.upper()} (saved before provenance existed, or a damaged field: a warning names the manifest)")
    for d in doc["provenance"]:
        out.append(f"provenance {d['field']}: {_short(d['a'])} -> {_short(d['b'])}")
    n_keys = len(doc["only_in_a"]) + len(doc["only_in_b"]) + len(doc["shape"]) + len(doc["dtype"])
    out.append(f"{n_keys} key difference(s), {len(doc['provenance'])} provenance difference(s)")
    return out


__all__ = ["compare", "format_diff", "step_facts"]
