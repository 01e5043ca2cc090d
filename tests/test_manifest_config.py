"""Manifest schema (round trip, validation that names the field) and settings resolution
(argument > RSLURM_* environment > config file > default, unknown keys and bad values rejected)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from resilient_slurm import Checkpointer, ConfigError, CorruptCheckpointError, IncompatibleCheckpointError
from resilient_slurm import config as cfgmod
from resilient_slurm.manifest import (
    SCHEMA_VERSION,
    ChunkEntry,
    Manifest,
    ShardEntry,
    is_tmp_dirname,
    parse_step_dirname,
    step_dirname,
    tmp_dirname,
)


# ---------------------------------------------------------------------------------------- manifest
def sample_manifest() -> Manifest:
    shards = tuple(
        ShardEntry(
            path=f"__{r}_0.distcp",
            rank=r,
            node="n1" if r < 2 else "n2",
            size=8192 + r,
            checksum=f"{r:016x}",
            chunks=(ChunkEntry(0, 4096, "aa" * 8), ChunkEntry(4096, 4096 + r, "bb" * 8)),
        )
        for r in range(4)
    )
    return Manifest(
        run_id="1234_5",
        step=42,
        world_size=4,
        created_at=1700000000.25,
        reason="emergency",
        torch_version="2.13.0",
        library_version="0.1.0",
        shards=shards,
        nodes={"n1": (0, 1), "n2": (2, 3)},
        node="n1",
        dcp_metadata=ChunkEntry(0, 777, "cc" * 8),
        extra={"note": "x", "n": [1, 2]},
    )


def test_manifest_round_trip_and_stable_bytes() -> None:
    m = sample_manifest()
    text = m.to_json()
    back = Manifest.from_json(text)
    assert back == m
    assert back.to_json() == text
    assert Manifest.from_json(text.encode()) == m
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION
    assert [s.path for s in back.shards_of_node("n2")] == ["__2_0.distcp", "__3_0.distcp"]
    assert back.total_bytes == sum(8192 + r for r in range(4))


def _doc() -> dict[str, Any]:
    return json.loads(sample_manifest().to_json())


def _set(path: str, value: Any, *, delete: bool = False) -> dict[str, Any]:
    d = _doc()
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    cur: Any = d
    for k in keys[:-1]:
        cur = cur[k]
    if delete:
        del cur[keys[-1]]
    else:
        cur[keys[-1]] = value
    return d


MALFORMED = [
    # (id, document, text that the error must contain)
    ("schema_missing", _set("schema_version", None, delete=True), "schema_version"),
    ("schema_string", _set("schema_version", "1"), "schema_version"),
    ("schema_bool", _set("schema_version", True), "schema_version"),
    ("run_id_int", _set("run_id", 5), "run_id"),
    ("step_string", _set("step", "42"), "step"),
    ("step_bool", _set("step", True), "step"),
    ("world_size_missing", _set("world_size", None, delete=True), "world_size"),
    ("world_size_float", _set("world_size", 4.0), "world_size"),
    ("reason_unknown", _set("reason", "because"), "reason"),
    ("node_list", _set("node", ["n1"]), "node"),
    ("format_int", _set("format", 3), "format"),
    ("shard_path_int", _set("shards.0.path", 7), "path"),
    ("shard_rank_missing", _set("shards.1.rank", None, delete=True), "rank"),
    ("shard_size_string", _set("shards.2.size", "8192"), "size"),
    ("shard_checksum_null", _set("shards.0.checksum", None), "checksum"),
    ("created_at_text", _set("created_at", "yesterday"), "created_at"),
    ("created_at_list", _set("created_at", [1]), "created_at"),
    ("nodes_list", _set("nodes", ["n1", "n2"]), "nodes"),
    ("nodes_rank_text", _set("nodes.n1", ["zero", 1]), "nodes"),
    ("dcp_metadata_length_text", _set("dcp_metadata.length", "777"), "dcp_metadata"),
    ("dcp_metadata_missing_checksum", _set("dcp_metadata.checksum", None, delete=True), "dcp_metadata"),
    ("chunk_offset_text", _set("shards.0.chunks.1.offset", "4096"), "chunks"),
    ("chunk_extra_field", _set("shards.0.chunks.0.bogus", 1), "chunks"),
]


@pytest.mark.parametrize("doc,field", [(d, f) for _, d, f in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_malformed_manifest_names_file_and_field(doc: dict[str, Any], field: str) -> None:
    src = "/nvme/run/step_000000000042/manifest.json"
    with pytest.raises(CorruptCheckpointError) as ei:
        Manifest.from_json(json.dumps(doc), source=src)
    msg = str(ei.value)
    assert src in msg
    assert field in msg, f"error does not name {field!r}: {msg}"


@pytest.mark.parametrize("text", [b"", b"\xff\xfe\x00", b"{not json", b"[1, 2]", b"null", b'"manifest"'])
def test_garbage_manifest_is_corrupt(text: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="m.json"):
        Manifest.from_json(text, source="m.json")


def test_newer_schema_is_incompatible_not_corrupt() -> None:
    d = _doc()
    d["schema_version"] = SCHEMA_VERSION + 1
    d["some_future_field"] = {"x": 1}
    with pytest.raises(IncompatibleCheckpointError, match="upgrade"):
        Manifest.from_json(json.dumps(d), source="m.json")


@pytest.mark.parametrize("bad", ["../__0_0.distcp", "/etc/passwd", "a/../../b", ".."])
def test_shard_path_escaping_the_step_directory_is_rejected(bad: str) -> None:
    d = _set("shards.0.path", bad)
    with pytest.raises(CorruptCheckpointError, match="escapes"):
        Manifest.from_json(json.dumps(d), source="m.json")


def test_nested_relative_shard_path_is_fine() -> None:
    d = _set("shards.0.path", "sub/__0_0.distcp")
    assert Manifest.from_json(json.dumps(d)).shards[0].path == "sub/__0_0.distcp"


def test_layout_names() -> None:
    assert step_dirname(42) == "step_000000000042"
    assert parse_step_dirname("step_000000000042") == 42
    t = tmp_dirname(42, "abc-1")
    assert t == "step_000000000042.tmp-abc-1"
    assert parse_step_dirname(t) is None and is_tmp_dirname(t)
    for name in ("step_42", "step_000000000042x", "manifest.json", "step_000000000042.tmp-", "x.tmp-1"):
        assert parse_step_dirname(name) is None
        assert not is_tmp_dirname(name) or name.startswith("step_")
    assert not is_tmp_dirname("step_000000000042")
    with pytest.raises(ValueError):
        step_dirname(-1)


# ---------------------------------------------------------------------------------------- config
def write_toml(tmp_path: Path, body: str, name: str = "rslurm.toml") -> str:
    p = tmp_path / name
    p.write_text(body)
    return str(p)


NAMES = ["keep_last", "every_seconds", "local_dir", "capture_rng", "keep_every"]


def test_precedence_argument_env_file_default(home: Path, tmp_path: Path) -> None:
    cfg = write_toml(tmp_path, 'keep_last = 7\nevery_seconds = 30.5\nlocal_dir = "/file/%n"\n')
    env = {"RSLURM_CONFIG": cfg, "RSLURM_KEEP_LAST": "4", "RSLURM_EVERY_SECONDS": "12"}
    # argument wins over everything
    out = cfgmod.resolve(NAMES, {"keep_last": 5, "every_seconds": 1.5}, env)
    assert out["keep_last"] == 5 and out["every_seconds"] == 1.5
    # then the environment
    out = cfgmod.resolve(NAMES, {"keep_last": None}, env)
    assert out["keep_last"] == 4 and out["every_seconds"] == 12.0
    # then the file
    out = cfgmod.resolve(NAMES, {}, {"RSLURM_CONFIG": cfg})
    assert out["keep_last"] == 7 and out["every_seconds"] == 30.5 and out["local_dir"] == "/file/%n"
    # an empty variable counts as unset
    out = cfgmod.resolve(NAMES, {}, {"RSLURM_CONFIG": cfg, "RSLURM_KEEP_LAST": ""})
    assert out["keep_last"] == 7
    # then the defaults
    out = cfgmod.resolve(NAMES, {}, {})
    assert out == {"keep_last": 3, "every_seconds": None, "local_dir": None, "capture_rng": True, "keep_every": None}


def test_explicit_config_path_and_rslurm_table(home: Path, tmp_path: Path) -> None:
    cfg = write_toml(tmp_path, "[rslurm]\nkeep_every = 100\ncapture_rng = false\n")
    out = cfgmod.resolve(NAMES, {}, {}, config_path=cfg)
    assert out["keep_every"] == 100 and out["capture_rng"] is False


def test_per_user_default_config_file(home: Path) -> None:
    p = home / ".config" / "rslurm" / "config.toml"
    p.parent.mkdir(parents=True)
    p.write_text("keep_last = 9\n")
    assert cfgmod.resolve(["keep_last"], {}, {})["keep_last"] == 9
    assert cfgmod.resolve(["keep_last"], {}, {"RSLURM_KEEP_LAST": "2"})["keep_last"] == 2


def test_env_parsing_of_types(home: Path) -> None:
    env = {"RSLURM_CAPTURE_RNG": "off", "RSLURM_KEEP_EVERY": "none", "RSLURM_EVERY_SECONDS": "0"}
    out = cfgmod.resolve(NAMES, {}, env)
    assert out["capture_rng"] is False and out["keep_every"] is None and out["every_seconds"] is None


def test_unknown_env_var_is_an_error_with_suggestion(home: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve(NAMES, {}, {"RSLURM_KEEP_LSAT": "2"})
    msg = str(ei.value)
    assert "RSLURM_KEEP_LSAT" in msg and "did you mean 'RSLURM_KEEP_LAST'" in msg
    # variables outside our namespace and our reserved ones are fine
    cfgmod.resolve(NAMES, {}, {"KEEP_LSAT": "2", "RSLURM_FAILPOINTS": ""})


def test_unknown_config_key_is_an_error_with_suggestion(home: Path, tmp_path: Path) -> None:
    cfg = write_toml(tmp_path, "keep_lats = 2\n")
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve(NAMES, {}, {"RSLURM_CONFIG": cfg})
    msg = str(ei.value)
    assert cfg in msg and "keep_lats" in msg and "did you mean 'keep_last'" in msg


@pytest.mark.parametrize(
    "var,value",
    [
        ("RSLURM_KEEP_LAST", "three"),
        ("RSLURM_EVERY_SECONDS", "10min"),
        ("RSLURM_CAPTURE_RNG", "maybe"),
        ("RSLURM_IO_THREADS", "4.5"),
        ("RSLURM_FREE_SPACE_MARGIN", "1G"),
    ],
)
def test_bad_env_value_names_the_variable(home: Path, var: str, value: str) -> None:
    name = var[len("RSLURM_") :].lower()
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve([name], {}, {var: value})
    assert var in str(ei.value) and value in str(ei.value)


@pytest.mark.parametrize(
    "body,key",
    [('keep_last = "three"', "keep_last"), ("keep_last = 2.5", "keep_last"), ('capture_rng = "maybe"', "capture_rng")],
    ids=["text_for_int", "float_for_int", "text_for_bool"],
)
def test_bad_config_file_value_names_the_key(home: Path, tmp_path: Path, body: str, key: str) -> None:
    cfg = write_toml(tmp_path, body + "\n")
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve([key], {}, {"RSLURM_CONFIG": cfg})
    assert key in str(ei.value)


def test_missing_or_broken_config_file(home: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="nope.toml"):
        cfgmod.resolve(NAMES, {}, {"RSLURM_CONFIG": missing})
    broken = write_toml(tmp_path, "keep_last = = 3\n", "broken.toml")
    with pytest.raises(ConfigError, match="broken.toml"):
        cfgmod.resolve(NAMES, {}, {"RSLURM_CONFIG": broken})


def test_checkpointer_reads_the_same_settings(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_toml(tmp_path, "keep_last = 6\nkeep_every = 50\nevery_steps = 10\n")
    monkeypatch.setenv("RSLURM_CONFIG", cfg)
    monkeypatch.setenv("RSLURM_KEEP_EVERY", "25")
    ck = Checkpointer(local_dir=str(tmp_path / "nvme"), run_id="cfg", keep_last=2)
    try:
        assert ck.retention.keep_last == 2  # argument
        assert ck.retention.keep_every == 25  # environment
        assert ck.cadence.every_steps == 10  # file
        assert ck.cadence.every_seconds is None  # default
    finally:
        ck.close()
    monkeypatch.setenv("RSLURM_EVERY_STPES", "5")
    with pytest.raises(ConfigError, match="RSLURM_EVERY_STEPS"):
        Checkpointer(local_dir=str(tmp_path / "nvme"), run_id="cfg")



def test_checkpointer_refuses_world_size_without_process_group(tmp_path: Path, monkeypatch: Any) -> None:
    """Ranks that forgot init_distributed() must not overwrite each other's rank-0 shard."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="init_distributed"):
        Checkpointer(local_dir=str(tmp_path), run_id="r")
