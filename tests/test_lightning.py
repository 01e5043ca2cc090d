"""PyTorch Lightning through ``Trainer(..., callbacks=[ResilientSlurm()])`` (resilient_slurm/integrations/lightning.py).

* The sampler fixes Lightning needs, in one process: replicas resolved once the process group exists,
  ``length="epoch"`` (the length Lightning measures once) and its rollover at an epoch's end.
* The Lightning internals the integration relies on, pinned: an upgrade that changes them fails here.
* In one process (one rank, a real Trainer): a run stopped by an emergency save mid-epoch, on an epoch's
  last batch and on the next epoch's first batch, with and without dataloaders reloaded every epoch,
  resumed by a new Trainer, gives every step's loss and batch and the final weights, optimizer and
  scheduler bitwise as a run that never stopped.
* End to end (tests/workers/lightning_worker.py, 2 ranks under ``rslurm launch -n 2``, DDP over gloo,
  dropout, several epochs): a real SIGTERM to the launcher mid-epoch, and at an epoch's last step with
  DataLoader workers and per-epoch reloads; the requeue exit (75), a second launch, and a bitwise
  comparison with an uninterrupted run. ``rslurm rehearse`` passes on the same program. On the Slurm test
  cluster: a real preemption of an ``sbatch`` job, a real requeue, the same comparison.
* Unsupported set-ups are refused with errors that say what to do.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, assert_same, clean_env, read_jsonl
from slurm_cluster import SlurmCluster

from resilient_slurm import ConfigError
from resilient_slurm.checkpoint.sampler import ResumableSampler

L = pytest.importorskip("lightning", reason="lightning is in the test extra: pip install -e '.[test]'")

from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector  # noqa: E402
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector  # noqa: E402
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector  # noqa: E402

from resilient_slurm.integrations.lightning import ResilientSlurm  # noqa: E402

WORKER = REPO / "tests" / "workers" / "lightning_worker.py"
STEPS = 18  # 44 samples, 2 ranks, batches of 4: 6 steps per epoch (the last batch of 2), 3 epochs


# ------------------------------------------------------------------------------------------ the sampler
def test_a_sampler_built_before_the_process_group_takes_its_replicas_when_used(caplog: pytest.LogCaptureFixture,
                                                                              monkeypatch: pytest.MonkeyPatch):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setenv("WORLD_SIZE", "2")
    early = ResumableSampler(23, seed=3)  # as a framework builds it, before fit() creates the group
    assert (early.num_replicas, early.rank) == (1, 0)
    with caplog.at_level(logging.WARNING, "resilient_slurm.checkpoint.sampler"):
        len(early)
    assert "without a process group while WORLD_SIZE=2: every rank reads every sample" in caplog.text
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        with caplog.at_level(logging.INFO, "resilient_slurm.checkpoint.sampler"):
            got = list(early)
        assert (early.num_replicas, early.rank) == (2, 1)
        assert "built before the process group existed; it now samples for rank 1 of 2" in caplog.text
        assert got == list(ResumableSampler(23, num_replicas=2, rank=1, seed=3)) and len(got) == 12
        explicit = ResumableSampler(23, num_replicas=1, rank=0)  # what the program asked for stays
        assert len(list(explicit)) == 23 and explicit.num_replicas == 1
    finally:
        torch.distributed.destroy_process_group()


def test_length_epoch_is_the_epoch_and_an_ended_epoch_iterates_the_next():
    rest = ResumableSampler(23, num_replicas=2, rank=0, seed=3)
    whole = ResumableSampler(23, num_replicas=2, rank=0, seed=3, length="epoch")
    for s in (rest, whole):
        s.advance(5)
    assert len(rest) == 7 and len(whole) == 12  # DistributedSampler's num_samples: Lightning measures it once
    assert list(whole) == list(rest)  # iteration is the same: the rest of the epoch
    whole.advance(7)
    assert (whole.epoch, len(whole)) == (0, 12)  # an ended epoch still has its length (asked before set_epoch)
    nxt = list(whole)  # a loop that creates its iterator before setting the epoch gets the next epoch
    assert (whole.epoch, whole.consumed) == (1, 0)
    fresh = ResumableSampler(23, num_replicas=2, rank=0, seed=3)
    fresh.set_epoch(1)
    assert nxt == list(fresh)
    whole.set_epoch(1)  # and setting it then keeps the position
    assert (whole.epoch, whole.consumed) == (1, 0)
    with pytest.raises(ConfigError, match="length must be one of remaining, epoch"):
        ResumableSampler(23, length="all")


# ------------------------------------------------------------------------------- Lightning internals
def test_the_lightning_internals_the_integration_uses_are_there():
    """Each is used by resilient_slurm/integrations/lightning.py; a Lightning that changes one fails here."""
    run = inspect.getsource(L.Trainer._run)
    # the restore hand-over: on_fit_start runs before restore_training_state, which reads _loaded_checkpoint
    assert run.index('"on_fit_start"') < run.index("restore_training_state()") < run.index("register_signal_handlers()")
    assert "self._loaded_checkpoint" in inspect.getsource(_CheckpointConnector.restore_training_state)
    assert "fit_loop.load_state_dict" in inspect.getsource(_CheckpointConnector.restore_loops)
    assert list(inspect.signature(_DataConnector._prepare_dataloader).parameters) == ["self", "dataloader", "shuffle",
                                                                                      "mode"]
    assert callable(_SignalConnector.register_signal_handlers)
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.utilities.data import _update_dataloader

    assert list(inspect.signature(_update_dataloader).parameters)[:3] == ["dataloader", "sampler", "mode"]
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn

    assert list(inspect.signature(_auto_add_worker_init_fn).parameters) == ["dataloader", "rank"]
    # the train loader's state travels in the fit loop's state when the loader has state_dict/load_state_dict
    assert "_load_combined_loader_states()" in inspect.getsource(_FitLoop.setup_data)
    # the emergency stop ends fit() through the tuner's exit: teardown, status finished, nothing raised
    from lightning.pytorch.trainer import call
    from lightning.pytorch.utilities.exceptions import _TunerExitException  # noqa: F401

    handler = inspect.getsource(call._call_and_handle_interrupt)
    assert "except _TunerExitException:" in handler and "trainer._teardown()" in handler
    assert callable(call._call_callbacks_state_dict) and callable(call._call_callbacks_load_state_dict)


def _rank_steps(work: Path, rank: int) -> list[dict]:
    return [e for e in read_jsonl(work / f"log.{rank}.jsonl") if "loss" in e]


# ------------------------------------------------------------------------------------- in one process
sys.path.insert(0, str(REPO / "tests" / "workers"))
import lightning_worker  # noqa: E402


class _StopAt(L.Callback):
    """Asks for an emergency save during step ``at`` (what the signal handler does)."""

    def __init__(self, plugin: ResilientSlurm, at: int) -> None:
        self.plugin, self.at = plugin, at

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step + 1 == self.at and self.plugin.ckpt is not None:
            self.plugin.ckpt.request_emergency_save()


def _fit(root: Path, log: Path, *, stop_at: int = -1, reload: bool = False, workers: int = 0,
         steps: int = 30, random_data: bool = False) -> tuple[Any, Any]:
    L.seed_everything(0, verbose=False)
    model = lightning_worker.Model(44, 4, workers, random_data)  # one rank: 11 steps per epoch, the last batch of 4
    plugin = ResilientSlurm(local_dir=str(root), run_id="inproc")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        reload_dataloaders_every_n_epochs=1 if reload else 0,
                        callbacks=[plugin, lightning_worker.StepLog(str(log), 0.0, -1), _StopAt(plugin, stop_at)])
    trainer.fit(model)
    return trainer, plugin


def _final(trainer: Any) -> dict[str, Any]:
    return {"model": trainer.lightning_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(), "rng": torch.get_rng_state()}


def _steps(log: Path) -> dict[int, tuple[Any, ...]]:
    """step -> (epoch, batch ids, loss); a step trained twice must repeat itself exactly."""
    out: dict[int, tuple[Any, ...]] = {}
    for e in read_jsonl(log):
        if "loss" in e:
            now = (e["epoch"], e["batch"], e["loss"])
            assert out.setdefault(e["step"], now) == now, f"step {e['step']} differs when trained again"
    return out


@pytest.fixture(scope="module")
def in_process_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], tuple[dict, dict]]:
    """The uninterrupted run's steps and final state, with or without random reads (built once each)."""
    runs: dict[bool, tuple[dict, dict]] = {}

    def reference(random_data: bool) -> tuple[dict, dict]:
        if random_data not in runs:
            work = tmp_path_factory.mktemp("lightning-inproc-ref")
            trainer, _ = _fit(work / "nvme", work / "log.jsonl", random_data=random_data)
            runs[random_data] = (_steps(work / "log.jsonl"), _final(trainer))
        return runs[random_data]

    return reference


@pytest.mark.parametrize(("stop_at", "reload", "workers"), [(15, False, 0), (11, False, 0), (12, True, 0),
                                                       pytest.param(22, True, 2, marks=pytest.mark.proc)],
                         ids=["mid-epoch", "last-batch-of-epoch", "first-batch-of-epoch-reload",
                              "epoch-end-reload-workers"])
def test_in_process_stop_and_resume_is_bitwise(tmp_path: Path, in_process_reference: Callable[[bool], tuple[dict, dict]],
                                               stop_at: int, reload: bool, workers: int):
    """DataLoader workers and per-epoch reloads change nothing computed. Workers make the loader draw its
    indices when Lightning creates the iterator, before Lightning sets the epoch. Without workers, reading a
    batch draws from the global RNGs in the main process (the dataset's augmentation, the collator's noise):
    Lightning reads a sized loader without looking ahead, so the saved RNG state is from before the next read."""
    random_data = workers == 0  # in worker processes the draws follow each worker's seed, not the steps
    want_steps, want_final = in_process_reference(random_data)
    log = tmp_path / "log.jsonl"
    first, plugin = _fit(tmp_path / "nvme", log, stop_at=stop_at, reload=reload, workers=workers,
                         random_data=random_data)
    assert plugin.should_stop and first.global_step == stop_at
    second, plugin2 = _fit(tmp_path / "nvme", log, reload=reload, workers=workers, random_data=random_data)
    assert plugin2.restored_step == stop_at and not plugin2.should_stop
    got = _steps(log)
    assert sorted(got) == sorted(want_steps) == list(range(1, 31))
    for s in want_steps:
        assert got[s] == want_steps[s], f"step {s}: {got[s]} != {want_steps[s]}"
    assert_same(_final(second), want_final, "final")


# ---------------------------------------------------------------------------------- errors, set-up
def test_unsupported_strategies_are_refused_naming_what_to_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from lightning.pytorch.strategies import FSDPStrategy

    model = lightning_worker.Model(44, 4, 0)
    fsdp = L.Trainer(accelerator="cpu", devices=1, logger=False)
    # Lightning builds FSDP only with a GPU: the strategy a GPU machine would have, on this CPU trainer
    monkeypatch.setattr(fsdp._accelerator_connector, "strategy", FSDPStrategy())
    with pytest.raises(ConfigError, match="DDP and single-device strategies, not FSDPStrategy"):
        ResilientSlurm(local_dir=str(tmp_path)).setup(fsdp, model, "fit")
    with pytest.raises(ConfigError, match="'every_step': not a Checkpointer argument"):
        ResilientSlurm(every_step=10)
    with pytest.raises(ConfigError, match="every_steps"):  # a bad value, at once rather than inside fit()
        ResilientSlurm(every_steps=-1)
    spawn = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False)
    with pytest.raises(ConfigError, match=r"starting its own 2 processes .* `rslurm launch -n N"):
        ResilientSlurm(local_dir=str(tmp_path)).setup(spawn, model, "fit")


def test_without_lightning_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # what `import` sees when it is not installed
    path = REPO / "resilient_slurm" / "integrations" / "lightning.py"
    spec = importlib.util.spec_from_file_location("resilient_slurm.integrations._lightning_missing", path)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError, match=r"pip install 'resilient_slurm\[lightning\]'"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# ---------------------------------------------------------------------------------------- end to end
def _assert_identical(ref: Path, work: Path) -> None:
    """Every step of every rank (epoch, sample ids, loss) and the final model, optimizer and scheduler."""
    for r in range(2):
        got = _steps(work / f"log.{r}.jsonl")
        want = _steps(ref / f"log.{r}.jsonl")
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
        for s in want:
            assert got[s] == want[s], f"rank {r} step {s}: {got[s]} != {want[s]}"
        assert_same(torch.load(work / f"out.{r}.pt", weights_only=True),
                    torch.load(ref / f"out.{r}.pt", weights_only=True), f"rank{r}")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    """``rslurm rehearse -n 2``: the program once uninterrupted, once stopped by a real SIGTERM to the real
    launcher (exit 75, as a requeue) and run again; each run writes its step logs and final state in its
    own directory ({local}), so the test compares more than the recorded losses rehearse compares."""
    tmp = tmp_path_factory.mktemp("lightning-rehearse")
    out = tmp / "rehearse"
    argv = [sys.executable, "-m", "resilient_slurm.cli", "rehearse", "-n", "2", "--seed", "5", "--steps", str(STEPS),
            "--dir", str(out), "--", sys.executable, str(WORKER), "--workers", "2", "--step-sleep", "0.1",
            "--log", "{local}/log.%r.jsonl",
            "--out", "{local}/out.%r.pt"]
    p = subprocess.run(argv, env=clean_env({"RSLURM_LOG_LEVEL": "WARNING"}), cwd=tmp, capture_output=True,
                       text=True, timeout=600)
    return out, p.stdout + p.stderr, p.returncode


@pytest.mark.proc
@pytest.mark.slow
def test_stopped_mid_epoch_by_sigterm_resumes_bitwise_and_rehearse_passes(rehearsal: tuple[Path, str, int]):
    """Seed 5 sends SIGTERM after step 9: the stop is in the middle of epoch 1 (steps 7-12), and the resumed run
    finishes that epoch and crosses the next epoch end. Each rank has 2 DataLoader workers. The emergency
    save is at step 9 when a rank had not passed step 9's boundary yet as the request came (a busy node),
    else at 10 or 11."""
    out, text, code = rehearsal
    assert code == 0 and "PASS" in text, text[-4000:]
    found = re.search(r"stopped after step (\d+); launcher exit 75", text)
    assert found and 9 <= int(found.group(1)) < 12 and f"resumed from step {found.group(1)}," in text, text[-4000:]
    stopped_at = int(found.group(1))
    straight, stopped = out / "uninterrupted" / "local", out / "interrupted" / "local"
    starts = [e for e in read_jsonl(stopped / "log.0.jsonl") if e.get("event") == "start"]
    assert starts[0]["module_file"] == str(REPO / "resilient_slurm" / "__init__.py")  # this checkout's code
    assert all(s["ddp_found"] for s in starts), starts  # DDP's layout and replication are handled as for plain DDP
    exits = [e for e in read_jsonl(stopped / "log.0.jsonl") if e.get("event") == "exit"]
    assert exits == [{"event": "exit", "step": stopped_at, "stopped": True},
                     {"event": "exit", "step": STEPS, "stopped": False}]
    for r in range(2):
        trained = [e["step"] for e in read_jsonl(stopped / f"log.{r}.jsonl") if "loss" in e]
        assert trained == list(range(1, STEPS + 1)), f"rank {r} trained {trained}"  # nothing twice, nothing skipped
    for epoch in range(STEPS // 6):  # the two ranks share each epoch's samples, as DistributedSampler would
        seen = [i for r in range(2) for e in read_jsonl(stopped / f"log.{r}.jsonl")
                if e.get("epoch") == epoch and "batch" in e for i in e["batch"]]
        assert sorted(seen) == list(range(44)), epoch
    _assert_identical(straight, stopped)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The program once to the end under ``rslurm launch -n 2`` (the Slurm test's reference: under
    ``pytest -n 2`` the Slurm tests run on a worker of their own, which should not repeat the rehearsal)."""
    work = tmp_path_factory.mktemp("lightning-uninterrupted")
    env = clean_env({"RSLURM_LOCAL_DIR": str(work / "nvme"), "RSLURM_RUN_ID": "lt", "RSLURM_LOG_LEVEL": "WARNING"})
    p = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", sys.executable,
                        str(WORKER), "--steps", str(STEPS), "--log", str(work / "log.%r.jsonl"),
                        "--out", str(work / "out.%r.pt")], env=env, cwd=work, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return work


@pytest.mark.proc
@pytest.mark.slow
def test_preempted_on_slurm_requeued_and_resumed_bitwise(slurm: SlurmCluster, uninterrupted: Path):
    """A real sbatch job (2 nodes, a task each: Lightning's SLURMEnvironment) through `rslurm launch -- srun`,
    preempted by a `high` job: Slurm sends SIGTERM to every process of the step, DataLoader workers included
    (the integration shields them); the ranks save, the launcher requeues, the job resumes and ends bitwise
    identical to an uninterrupted local run (the same two ranks, the same computation)."""
    work = slurm.work_dir / "lightning-preempt"
    work.mkdir()
    py = sys.executable
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RSLURM_LOCAL_DIR": str(work / "nvme" / "%n"),
           "RSLURM_RUN_ID": "lt", "RSLURM_LOG_LEVEL": "INFO", "RSLURM_CONTROL_DIR": str(work.parent.parent / "ctl")}
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    program = [py, str(WORKER), "--steps", str(STEPS), "--devices", "1", "--num-nodes", "2", "--step-sleep", "0.2",
               "--workers", "1",
               "--log", str(work / "log.%r.jsonl"), "--out", str(work / "out.%r.pt")]
    # Lightning's SLURMEnvironment refuses --ntasks without --ntasks-per-node (SLURM_NTASKS_PER_NODE)
    srun = f"srun -N2 --ntasks-per-node=1 {' '.join(program)}"
    script = f"#!/bin/bash\n{exports}exec {py} -m resilient_slurm.cli launch -- {srun}\n"
    # `lowlong`: a grace a saved rank's teardown and exit fit in on a loaded runner (slurm_cluster.py); with
    # `low`'s 10 s, CI's runner once saw Slurm's SIGTERM at the grace's end kill rank 0 after its commit
    job = slurm.sbatch(script, "-p", "lowlong", "--requeue", "-N2", "--ntasks-per-node=1", "--exclusive",
                       "--open-mode=append", "-o", str(work / "job.out"))
    deadline = time.monotonic() + 180
    while not ((work / "log.0.jsonl").exists() and any(e["step"] >= 8 for e in _rank_steps(work, 0))):  # epoch 1
        state = (slurm.job_info(job) or {}).get("JobState")
        assert time.monotonic() < deadline and state not in ("FAILED", "COMPLETED", "CANCELLED"), \
            f"job {job} {state}: " + (work / "job.out").read_text(errors="replace")[-4000:]
        time.sleep(0.5)
    high = slurm.high_job(work)
    slurm.wait_state(high, "COMPLETED", timeout=120)
    try:
        info = slurm.wait_state(job, "COMPLETED", timeout=240)
    except BaseException:
        print(slurm.diagnose(job), (work / "job.out").read_text(errors="replace")[-6000:])
        raise
    assert int(info["Restarts"]) == 1, info
    exits = [e for e in read_jsonl(work / "log.0.jsonl") if e.get("event") == "exit"]
    assert [e["stopped"] for e in exits] == [True, False] and 8 <= exits[0]["step"] < STEPS, exits
    for r in range(2):
        trained = [e["step"] for e in _rank_steps(work, r)]
        assert trained == list(range(1, STEPS + 1)), f"rank {r} trained {trained}"
    text = (work / "job.out").read_text(errors="replace")
    assert "Lightning's SIGTERM handler and SLURM auto-requeue are off" in text, text[-4000:]
    _assert_identical(uninterrupted, work)



# ------------------------------------------------------------------------ what a user adds around the line
class _Validated(lightning_worker.Model):
    """The worker's model with a validation loss (``val_loss``) for EarlyStopping and ModelCheckpoint."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(lightning_worker.Points(12), batch_size=4)


def _fit_with_callbacks(root: Path, *, stop_at: int = -1) -> tuple[Any, Any, Any]:
    """Validation every 5 steps, EarlyStopping that stops after two evaluations without a large gain, and a
    ModelCheckpoint keeping the best file: their state must survive a resume as the fit loop's does."""
    L.seed_everything(0, verbose=False)
    model = _Validated(44, 4, 0)
    plugin = ResilientSlurm(local_dir=str(root / "nvme"), run_id="callbacks")
    early = L.pytorch.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=10.0)
    best = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(root / "best"), monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=60, val_check_interval=5, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[plugin, early, best, _StopAt(plugin, stop_at)])
    trainer.fit(model)
    return trainer, plugin, early


def test_early_stopping_and_model_checkpoint_states_survive_a_resume(tmp_path: Path):
    """Lightning saves its callbacks' states in its own checkpoints; the integration saves them too. Without
    them the resumed EarlyStopping forgot its patience and trained on past the step the uninterrupted run
    stopped at, and ModelCheckpoint kept a stale 'best' file beside the real one."""
    ref, _, ref_early = _fit_with_callbacks(tmp_path / "ref")
    assert ref.global_step < 60 and ref_early.stopped_epoch > 0  # the uninterrupted run stopped early
    first, plugin, _ = _fit_with_callbacks(tmp_path / "run", stop_at=7)
    assert plugin.should_stop and first.global_step == 7
    second, plugin2, early = _fit_with_callbacks(tmp_path / "run")
    assert plugin2.restored_step == 7
    assert second.global_step == ref.global_step and early.wait_count == ref_early.wait_count
    assert_same(second.lightning_module.state_dict(), ref.lightning_module.state_dict(), "model")
    assert sorted(p.name for p in (tmp_path / "run" / "best").iterdir()) == sorted(
        p.name for p in (tmp_path / "ref" / "best").iterdir())


class _Curriculum(L.LightningDataModule):
    """A DataModule with a state of its own (what Lightning saves of it in its checkpoints): the inputs are
    scaled by a factor that grows with every batch it has handed to the model."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(lightning_worker.Points(44), batch_size=4, shuffle=True)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y, idx = batch
        self.batches += 1
        return x * (1.0 + 0.05 * self.batches), y, idx

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


def _fit_curriculum(root: Path, *, stop_at: int = -1) -> tuple[Any, Any, _Curriculum]:
    L.seed_everything(0, verbose=False)
    dm = _Curriculum()
    plugin = ResilientSlurm(local_dir=str(root / "nvme"), run_id="datamodule")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=20, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[plugin, _StopAt(plugin, stop_at)])
    trainer.fit(lightning_worker.Model(44, 4, 0), datamodule=dm)
    return trainer, plugin, dm


def test_a_datamodules_own_state_survives_a_resume(tmp_path: Path):
    """A LightningDataModule's ``state_dict`` is saved with every step and loaded before the loops resume, as
    Lightning's own checkpoints do; without it the resumed curriculum started over and the weights differed."""
    ref, _, ref_dm = _fit_curriculum(tmp_path / "ref")
    first, plugin, _ = _fit_curriculum(tmp_path / "run", stop_at=7)
    assert plugin.should_stop and first.global_step == 7
    second, plugin2, dm = _fit_curriculum(tmp_path / "run")
    assert plugin2.restored_step == 7 and second.global_step == ref.global_step == 20
    assert dm.batches == ref_dm.batches == 20
    assert_same(second.lightning_module.state_dict(), ref.lightning_module.state_dict(), "model")


class _Opaque:
    """A value of the program's own class: a checkpoint cannot load it back safely (weights_only)."""


def test_a_datamodule_state_a_resume_could_not_load_is_refused_at_the_save(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """A state a resume would fail to load (torch.load with weights_only refuses a class of the program's
    own) is a ConfigError at the first save, naming the DataModule, not a failed resume hours later."""
    monkeypatch.setattr(_Curriculum, "state_dict", lambda self: {"batches": self.batches, "extra": _Opaque()})
    with pytest.raises(ConfigError, match=r"_Curriculum\.state_dict\(\) holds a value a resume could not load"):
        _fit_curriculum(tmp_path, stop_at=3)


def test_several_train_loaders_and_a_second_fit_on_a_finished_run_are_refused(tmp_path: Path):
    class TwoLoaders(lightning_worker.Model):
        def train_dataloader(self) -> Any:
            return {"a": super().train_dataloader(), "b": super().train_dataloader()}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch["a"], batch_idx)

    def trainer(plugin: ResilientSlurm) -> Any:
        return L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[plugin])

    with pytest.raises(ConfigError, match="one train DataLoader; train_dataloader\\(\\) returned 2"):
        trainer(ResilientSlurm(local_dir=str(tmp_path / "two"))).fit(TwoLoaders(44, 4, 0))
    trainer(ResilientSlurm(local_dir=str(tmp_path), run_id="pretrain")).fit(lightning_worker.Model(44, 4, 0))
    with pytest.raises(ConfigError, match="already ran a fit\\(\\) to its end .*run_id='pretrain-finetune'"):
        trainer(ResilientSlurm(local_dir=str(tmp_path), run_id="pretrain")).fit(lightning_worker.Model(44, 4, 0))
    trainer(ResilientSlurm(local_dir=str(tmp_path), run_id="finetune")).fit(lightning_worker.Model(44, 4, 0))
