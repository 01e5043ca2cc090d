"""Exports carry the run's config (``Checkpointer(config=...)``), and ``--format hf`` writes a Hugging Face
model directory that ``transformers`` loads.

Real checkpoints (a single-process Checkpointer saves into a temporary local root) and the real CLI:
``rslurm export`` as a process (``run_rslurm``, tests marked ``proc``) or its entry point in this process
(``cli.main``, the in-process tier). Checked:

* every format writes the step's config beside the weights (``model.pt`` -> ``model.config.json``,
  ``OUT/config.json`` in a directory), byte for byte the canonical JSON whose sha256 the manifest records,
  and the summary and ``--json`` say where it went;
* a step saved without config writes no config file and says so; ``--format hf`` refuses it;
* a config altered in the manifest (sha256 mismatch) exits 1 naming the step and the manifest, and
  writes nothing;
* the config file follows OUT's rules: refused when it exists without ``--force``, replaced (or, for a
  step without config, removed) with it, never a directory, never inside or above a tier (a link to one),
  never written through a link; a failed install leaves the earlier export and its config as they were;
* ``--format hf --only model`` of a trained GPT-2 (built from a config, nothing downloaded) loads with
  ``AutoModelForCausalLM.from_pretrained`` with every parameter bitwise equal and the same logits; a
  config that is not an object, a key that is not a module's weights, a missing ``--only`` are clear errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_rslurm

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint.provenance import canonical_json
from resilient_slurm.cli import main as rslurm_main
from resilient_slurm.errors import ConfigError
from resilient_slurm.manifest import read_manifest_file, step_dirname

CONFIG = {"lr": 0.001, "layers": [32, 8], "name": "run-é", "data": {"path": "/data/x", "shuffle": True}, "z": None}
STEP = 3


def _save(root: Path, run: str, config: Any = None, *, state: dict[str, Any] | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    if state is None:
        model = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        state = {"model": model, "opt": opt, "note": "n", "scale": torch.tensor(2.0)}
    kw = {} if config is None else {"config": config}
    with Checkpointer(local_dir=str(root), run_id=run, **kw) as ck:
        ck.save(STEP, state)
        ck.wait()
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run ``cfg`` saved with CONFIG, run ``plain`` without one, run ``listcfg`` with a list as config,
    run ``notype`` with an object without model_type; all step 3, in one local root."""
    root = tmp_path_factory.mktemp("saved") / "nvme"
    _save(root, "cfg", CONFIG)
    _save(root, "plain")
    _save(root, "listcfg", [1, "two"])
    _save(root, "notype", {"hidden": 8})
    return root


@pytest.fixture
def root(saved: Path, tmp_path: Path) -> Path:
    """This test's own copy of the saved root (tests alter manifests, plant links)."""
    shutil.copytree(saved, tmp_path / "nvme", symlinks=True)
    return tmp_path / "nvme"


def _manifest(root: Path, run: str) -> Path:
    return root / run / step_dirname(STEP) / "manifest.json"


def _cli(capsys: pytest.CaptureFixture[str], root: Path, run: str, *args: str) -> tuple[int, str, str]:
    """``rslurm export`` through the CLI's entry point, in this process."""
    rc = rslurm_main(["export", "--local-dir", str(root), "--run-id", run, *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _files(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (links as their target's text) and its bytes: what a refusal must leave."""
    out: dict[str, bytes] = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_symlink():
            out[rel] = b"-> " + os.readlink(p).encode()
        elif p.is_file():
            out[rel] = p.read_bytes()
        else:
            out[rel] = b"<dir>"
    return out


# ------------------------------------------------------------------------------- every format, as a process
@pytest.mark.proc
def test_every_format_writes_the_config_beside_the_weights(saved: Path, tmp_path: Path) -> None:
    expected = canonical_json(CONFIG).encode()
    sha = read_manifest_file(str(_manifest(saved, "cfg"))).provenance["config_sha256"]  # type: ignore[index]
    assert hashlib.sha256(expected).hexdigest() == sha

    def rslurm(*args: str) -> Any:
        r = run_rslurm("export", "--local-dir", str(saved), "--run-id", "cfg", *args)
        assert r.returncode == 0, r.stderr
        return r

    out = tmp_path / "model.pt"
    r = rslurm(str(STEP), str(out), "--format", "torch", "--only", "model")
    side = tmp_path / "model.config.json"
    assert f"config to {side}" in r.stdout, r.stdout
    assert side.read_bytes() == expected and json.loads(side.read_bytes()) == CONFIG
    assert set(torch.load(out, weights_only=True)) == {"model"}

    st = tmp_path / "weights.safetensors"
    doc = json.loads(rslurm(str(STEP), str(st), "--format", "safetensors", "--json").stdout)
    assert (doc["config"], doc["config_sha256"], doc["config_removed"]) == (str(tmp_path / "weights.config.json"),
                                                                            sha, None)
    assert (tmp_path / "weights.config.json").read_bytes() == expected

    d = tmp_path / "dcp"
    doc = json.loads(rslurm(str(STEP), str(d), "--format", "dcp", "--json").stdout)
    assert doc["config"] == str(d / "config.json") and "config.json" in doc["files"]
    assert (d / "config.json").read_bytes() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "model.config.json", "model.pt",
                                                          "weights.config.json", "weights.safetensors"]


# ------------------------------------------------------------------------------- in this process
def test_a_step_without_config_writes_none_and_says_so(root: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    rc, so, se = _cli(capsys, root, "plain", str(STEP), str(out / "m.pt"), "--format", "torch")
    assert rc == 0, se
    assert "no config (the step was saved without Checkpointer(config=...)), none written" in so, so
    rc, so, se = _cli(capsys, root, "plain", str(STEP), str(out / "d"), "--format", "dcp", "--json")
    assert rc == 0, se
    doc = json.loads(so)
    assert (doc["config"], doc["config_sha256"], doc["config_removed"]) == (None, None, None)
    assert not (out / "d" / "config.json").exists()
    rc, so, se = _cli(capsys, root, "plain", str(STEP), str(out / "hf"), "--format", "hf", "--only", "model")
    assert rc == 2 and "saved without a config" in se and "--format safetensors --only model" in se, se
    assert sorted(p.name for p in out.iterdir()) == ["d", "m.pt"]  # no m.config.json, no hf


@pytest.mark.parametrize("how", ["value", "sha", "no_sha", "nan"])
def test_an_altered_config_is_refused_and_nothing_is_written(root: Path, tmp_path: Path, how: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    mpath = _manifest(root, "cfg")
    doc = json.loads(mpath.read_text())
    prov = doc["provenance"]
    if how == "value":
        prov["config"]["lr"] = 0.1  # the config changed, its sha256 kept
    elif how == "sha":
        prov["config_sha256"] = "0" * 64
    elif how == "no_sha":
        del prov["config_sha256"]
    mpath.write_text(json.dumps(doc).replace("0.001", "NaN") if how == "nan" else json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = _files(out)
    for fmt, target, extra in (("torch", "m.pt", ()), ("safetensors", "m.safetensors", ()), ("dcp", "d", ()),
                               ("hf", "hf", ("--only", "model"))):
        rc, so, se = _cli(capsys, root, "cfg", str(STEP), str(out / target), "--format", fmt, *extra)
        assert rc == 1, (fmt, rc, so, se)
        assert f"run cfg step {STEP}" in se and str(mpath) in se, se
        if how != "nan":  # (NaN: the manifest reader refuses the whole manifest first)
            assert "config" in se and "nothing was written" in se, se
    assert _files(out) == before


def test_the_config_file_follows_the_force_rules_of_out(root: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    expected = canonical_json(CONFIG).encode()
    out = tmp_path / "out"
    out.mkdir()
    side = out / "m.config.json"
    side.write_text("an older config")
    before = _files(out)
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch")
    assert rc == 2 and f"{side} exists" in se and "--force" in se, se
    assert _files(out) == before  # OUT did not exist: still nothing written
    rc, so, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch", "--force")
    assert rc == 0, se
    assert side.read_bytes() == expected
    assert sorted(p.name for p in out.iterdir()) == ["m.config.json", "m.pt"]  # no temp file left

    # A step without config, exported over an export that had one: refused without --force; with it the
    # old config goes, so that what lies beside OUT is never another step's config.
    rc, _, se = _cli(capsys, root, "plain", str(STEP), str(out / "m.pt"), "--format", "torch")
    assert rc == 2
    assert side.read_bytes() == expected
    rc, so, se = _cli(capsys, root, "plain", str(STEP), str(out / "m.pt"), "--format", "torch", "--force")
    assert rc == 0, se
    assert f"removed {side}, an earlier export's config" in so, so
    assert sorted(p.name for p in out.iterdir()) == ["m.pt"]

    # A directory where the config would go: refused even with --force, nothing touched.
    side.mkdir()
    (side / "x").write_text("x")
    before = _files(out)
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch")
    assert rc == 2 and "--force" in se, se
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch", "--force")
    assert rc == 2 and f"{side} is a directory" in se, se
    assert _files(out) == before


def test_a_failed_install_leaves_the_old_export_and_its_config(root: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The config is renamed into place before OUT: when OUT's rename then fails (a full or failing disk),
    the old config is put back, so the pair on disk is still the earlier export's."""
    import resilient_slurm.catalog.export as export_mod

    out = tmp_path / "out"
    out.mkdir()
    (out / "m.pt").write_bytes(b"old weights")
    (out / "m.config.json").write_bytes(b"old config")
    before = _files(out)
    real_replace = os.replace

    def failing_replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        if str(dst) == str(out / "m.pt"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(export_mod.os, "replace", failing_replace)
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch", "--force")
    assert rc == 2 and "No space left on device" in se and "nothing was written" in se, se
    assert _files(out) == before


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_an_empty_out_is_refused_as_empty_not_read_as_the_current_directory(
        root: Path, fmt: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(root)  # "" was the current directory: here, the local tier
    before = _files(root)
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), "", "--format", fmt, "--force")
    assert rc == 2 and "OUT is empty: give the path to write the export to" in se, se
    assert _files(root) == before


def test_the_config_file_never_lands_in_a_tier(root: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # The config's path is a link into the run (to a step's manifest) and to the local root itself.
    for target in (_manifest(root, "cfg"), root):
        side = out / "m.config.json"
        side.symlink_to(target)
        tier_before, out_before = _files(root), _files(out)
        for force in ((), ("--force",)):
            rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch", *force)
            assert rc == 2 and (f"OUT {side} is inside the local tier" in se or f"OUT {side} holds" in se), se
        assert _files(root) == tier_before and _files(out) == out_before
        side.unlink()

    # A link to a file elsewhere is replaced by the config with --force (the link, never its target).
    elsewhere = tmp_path / "precious.json"
    elsewhere.write_text("precious")
    (out / "m.config.json").symlink_to(elsewhere)
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch")
    assert rc == 2 and "exists" in se, se
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out / "m.pt"), "--format", "torch", "--force")
    assert rc == 0, se
    assert elsewhere.read_text() == "precious"
    assert not (out / "m.config.json").is_symlink()
    assert (out / "m.config.json").read_bytes() == canonical_json(CONFIG).encode()


def test_hf_refuses_what_transformers_cannot_read(root: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    hf = str(out / "hf")
    cases = [
        ("listcfg", ("--only", "model"), "its config is an array in JSON, not an object"),
        ("cfg", (), "--format hf needs exactly one --only KEY"),
        ("cfg", ("--only", "model", "--only", "opt"), "--format hf needs exactly one --only KEY"),
        ("cfg", ("--only", "opt"), "--only opt: it is an optimizer's state"),
        ("cfg", ("--only", "note"), "--only note: it holds a str"),
        ("cfg", ("--only", "scale"), "--only scale: it is a single tensor"),
        ("cfg", ("--only", "nosuch"), "--only nosuch: not in run cfg"),
    ]
    for run, only, message in cases:
        rc, _, se = _cli(capsys, root, run, str(STEP), hf, "--format", "hf", *only)
        assert rc == 2 and message in se, (run, only, se)
        if run == "listcfg":
            assert "model_type" in se, se
    assert list(out.iterdir()) == []

    # An object without model_type is written, with a note: Auto classes need it, the model's own class not.
    rc, so, se = _cli(capsys, root, "notype", str(STEP), hf, "--format", "hf", "--only", "model", "--json")
    assert rc == 0, se
    assert "no model_type" in se and json.loads(so)["notes"], se
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "hf" / "config.json").read_text()) == {"hidden": 8}


# ------------------------------------------------------------------------------- Hugging Face, as a process
@pytest.mark.proc
def test_hf_export_loads_with_from_pretrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built from its config
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids).loss.backward()  # one real step: the weights are no longer the initial ones
    opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as GPT-2 is
    root = tmp_path / "nvme"
    with pytest.raises(ConfigError, match="to_json_string"):  # to_dict() keys id2label by int: a clear error
        Checkpointer(local_dir=str(root), run_id="gpt", config=model.config.to_dict())
    config = json.loads(model.config.to_json_string())  # what save_pretrained writes as config.json
    _save(root, "gpt", config, state={"model": model, "optimizer": opt, "step": 1})

    out = tmp_path / "gpt2-hf"
    r = run_rslurm("export", "--local-dir", str(root), "--run-id", "gpt", str(STEP), str(out), "--format", "hf",
                   "--only", "model", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["format"], doc["keys"], doc["config"]) == ("hf", ["model"], str(out / "config.json"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == config

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(loaded) is transformers.GPT2LMHeadModel
    want, got = model.state_dict(), loaded.state_dict()
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_force_replaces_only_an_earlier_export_directory(root: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--force replaces a directory OUT whole: an earlier export's, or an empty one; never a directory that holds
    anything an export does not write (the user's files: refused, nothing touched), nor the current directory."""
    out = tmp_path / "out"
    out.mkdir()
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out), "--format", "dcp", "--force")  # empty: replaced
    assert rc == 0, se
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out), "--format", "dcp", "--force")  # an export: replaced
    assert rc == 0, se
    exported = _files(out)
    (out / "notes.txt").write_text("mine")
    (out / "src").mkdir()
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out), "--format", "dcp", "--force")
    assert rc == 2 and "not an earlier --format dcp export" in se and "notes.txt, src" in se, se
    assert (out / "notes.txt").read_text() == "mine" and (out / "src").is_dir()
    assert {k: v for k, v in _files(out).items() if k in exported} == exported
    # A dcp export is not an hf one.
    (out / "notes.txt").unlink()
    (out / "src").rmdir()
    rc, _, se = _cli(capsys, root, "cfg", str(STEP), str(out), "--format", "hf", "--force", "--only", "model")
    assert rc == 2 and "not an earlier --format hf export" in se and ".metadata" in se, se
    # The current directory, holding the user's files.
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "README").write_text("keep")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        rc, _, se = _cli(capsys, root, "cfg", str(STEP), ".", "--format", "dcp", "--force")
    finally:
        os.chdir(cwd)
    assert rc == 2 and "README, src" in se, se
    assert (work / "README").read_text() == "keep" and (work / "src").is_dir()
