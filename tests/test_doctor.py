"""``rslurm doctor`` as a real subprocess, against real things: batch scripts on disk, directories on real
filesystems (ext4, a tmpfs, a read-only tmpfs mounted by the test), a POSIX durable tier, S3 on moto
over HTTP and a closed port, and the private two-node Slurm cluster, where doctor runs inside jobs: it
reads the job's own script, the cluster's preemption settings, and signals a probe step on n1 and n2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import s3_support
from conftest import REPO, clean_env, free_port
from s3_support import FAKE_ENV, MotoServer
from slurm_cluster import SlurmCluster

from resilient_slurm.doctor.script import launcher_calls, parse_script, parse_signal
from resilient_slurm.doctor.storage import mount_of

moto_server = s3_support.moto_server
s3_bucket = s3_support.s3_bucket

PY = sys.executable
VENV_BIN = Path(sys.executable).parent
MiB = 1 << 20
GOOD = """\
    #!/bin/bash
    #SBATCH --nodes=2 --ntasks-per-node=1   # two nodes
    #SBATCH --requeue
    #SBATCH --signal=B:USR1@120
    #SBATCH --open-mode=append
    export RSLURM_LOCAL_DIR=/local/nvme/$USER/%n
    exec rslurm launch -- srun python train.py
    """


def doctor(*args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "resilient_slurm.cli", "doctor", *args], capture_output=True, text=True,
                          env=clean_env(env), cwd=cwd, timeout=timeout)


def report(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        pytest.fail(f"--json output does not parse (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
    assert doc["summary"]["exit_code"] == r.returncode, (doc["summary"], r.stderr)
    return doc


def rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["check"]: c for c in doc["checks"]}


def script(tmp: Path, text: str, name: str = "job.sh") -> Path:
    p = tmp / name
    p.write_text(textwrap.dedent(text))
    return p


def check_script(tmp: Path, text: str, *extra: str, env: Mapping[str, str] | None = None) -> tuple[int, dict]:
    """Doctor on a script only (the node's storage and the cluster are other tests' business)."""
    r = doctor("--script", str(script(tmp, text)), "--skip", "local,durable,signals", "--json", *extra, env=env)
    doc = report(r)
    return r.returncode, rows(doc)


# ------------------------------------------------------------------------------------------ directives
@pytest.mark.proc
def test_signal_without_b_fails_and_names_the_directive(tmp_path: Path) -> None:
    code, r = check_script(tmp_path, GOOD.replace("B:USR1@120", "USR1@60"))
    assert code == 1
    sig = r["script.signal"]
    assert sig["status"] == "FAIL"
    assert "`--signal=USR1@60`" in sig["finding"] and f"{tmp_path / 'job.sh'}:4" in sig["finding"], sig
    assert "B:" in sig["finding"] and "--signal=B:USR1@60" in sig["fix"]


@pytest.mark.proc
def test_good_script_has_no_fail_in_its_directives(tmp_path: Path) -> None:
    code, r = check_script(tmp_path, GOOD)
    script_rows = {k: v for k, v in r.items() if k.startswith("script.")}
    assert set(script_rows) == {"script.signal", "script.grace", "script.requeue", "script.open-mode",
                                "script.exec", "script.nccl"}
    assert all(v["status"] == "OK" for v in script_rows.values()), script_rows
    assert r["script.signal"]["details"] == {"directive": "--signal=B:USR1@120", "at": f"{tmp_path / 'job.sh'}:4",
                                             "batch": True, "signal": "USR1", "seconds": 120,
                                             "source": f"file {tmp_path / 'job.sh'}"}
    assert r["script.exec"]["details"]["line"] == 7
    # No Slurm controller for this process: the cluster checks say so, without failing the run.
    assert r["cluster"]["status"] == "WARN" and code == 0


@pytest.mark.proc
def test_usr1_to_the_ranks_under_nccl_fails(tmp_path: Path) -> None:
    gpu = GOOD.replace("#SBATCH --requeue", "#SBATCH --requeue --gres=gpu:1")
    code, r = check_script(tmp_path, gpu.replace("B:USR1@120", "USR1@60"))
    assert code == 1
    nccl = r["script.nccl"]
    assert nccl["status"] == "FAIL" and "--gres=gpu:1" in nccl["finding"] and "NCCL" in nccl["finding"], nccl
    assert nccl["details"]["nccl"] is True
    # B:USR1 reaches only the launcher (no NCCL there): fine under NCCL.
    code, r = check_script(tmp_path, gpu)
    assert r["script.nccl"]["status"] == "OK" and code == 0, r["script.nccl"]
    # ... but a save signal of USR1, which the launcher sends to every rank, is not.
    code, r = check_script(tmp_path, gpu, env={"RSLURM_SAVE_SIGNAL": "USR1"})
    assert r["script.nccl"]["status"] == "FAIL" and "save_signal=USR1" in r["script.nccl"]["finding"]
    code, r = check_script(tmp_path, gpu.replace("exec rslurm launch --", "exec rslurm launch --save-signal USR1 --"))
    assert r["script.nccl"]["status"] == "FAIL" and "job.sh:7" in r["script.nccl"]["finding"], r["script.nccl"]
    # Without GPUs it is only a warning, unless --nccl says the job uses NCCL anyway.
    cpu = GOOD.replace("B:USR1@120", "USR1@60")
    assert check_script(tmp_path, cpu)[1]["script.nccl"]["status"] == "WARN"
    assert check_script(tmp_path, cpu, "--nccl")[1]["script.nccl"]["status"] == "FAIL"
    assert check_script(tmp_path, gpu.replace("B:USR1@120", "USR1@60"), "--no-nccl")[1]["script.nccl"]["status"] \
        == "WARN"


@pytest.mark.parametrize(("line", "status", "words"), [
    ("exec rslurm launch -- srun python train.py", "OK", ""),
    ("exec rsrun python train.py", "OK", ""),
    ("cd $SLURM_SUBMIT_DIR && exec env OMP_NUM_THREADS=4 rsrun python train.py", "OK", ""),
    ("rsrun python train.py", "FAIL", "without exec"),
    ("rslurm launch -- srun python train.py", "FAIL", "without exec"),
    ("exec rslurm launch -- srun python train.py | tee train.log", "FAIL", "pipeline"),
    ("rslurm launch -- srun python train.py &", "FAIL", "background"),
    ("srun rslurm launch -- python train.py", "FAIL", "inside srun"),
    ("exec timeout 3600 rsrun python train.py", "WARN", "timeout"),
    ("srun python train.py", "WARN", "does not run under the launcher"),
], ids=["exec", "exec-rsrun", "exec-env", "rsrun", "launch", "pipe", "background", "in-step", "wrapper", "none"])
@pytest.mark.proc
def test_how_the_launcher_is_started(tmp_path: Path, line: str, status: str, words: str) -> None:
    code, r = check_script(tmp_path, GOOD.replace("exec rslurm launch -- srun python train.py", line))
    ex = r["script.exec"]
    assert ex["status"] == status, ex
    assert words in ex["finding"]
    assert code == (1 if status == "FAIL" else 0)


@pytest.mark.proc
def test_missing_signal_requeue_and_append(tmp_path: Path) -> None:
    code, r = check_script(tmp_path, "#!/bin/bash\n#SBATCH -N1\nexec rsrun python train.py\n")
    assert code == 1
    assert r["script.signal"]["status"] == "FAIL" and "no --signal" in r["script.signal"]["finding"]
    assert r["script.grace"]["status"] == "SKIP"
    assert r["script.requeue"]["status"] == "WARN"  # JobRequeue unknown here
    assert r["script.open-mode"]["status"] == "WARN" and "truncates" in r["script.open-mode"]["finding"]
    code, r = check_script(tmp_path, GOOD.replace("--requeue", "--no-requeue"))
    assert r["script.requeue"]["status"] == "FAIL" and code == 1


@pytest.mark.proc
def test_sbatch_command_line_and_environment_count(tmp_path: Path) -> None:
    bare = "#!/bin/bash\n#SBATCH --signal=USR1@60\nexec rsrun python train.py\n"
    code, r = check_script(tmp_path, bare, "--", "--signal=B:USR1@180", "--requeue", "--open-mode", "append")
    assert code == 0, r
    assert r["script.signal"]["details"]["at"] == "sbatch command line"
    assert r["script.requeue"]["status"] == "OK" and r["script.open-mode"]["status"] == "OK"
    code, r = check_script(tmp_path, bare, env={"SBATCH_SIGNAL": "B:USR2@300"})
    assert r["script.signal"]["status"] == "OK" and r["script.signal"]["details"]["at"] == "$SBATCH_SIGNAL"


def test_directive_parsing() -> None:
    s = parse_script("#!/bin/bash\n#SBATCH --signal B:USR1@40 -p gpu  # short\n\n# comment\n#SBATCH -N 2\n"
                     "#SBATCH --requeue\necho hi\n#SBATCH --time=1\n", "s.sh")
    # sbatch stops at `echo hi`: the last #SBATCH line is a comment to it.
    assert [(d.option, d.value, d.source) for d in s.directives] == [
        ("signal", "B:USR1@40", "s.sh:2"), ("partition", "gpu", "s.sh:2"), ("nodes", "2", "s.sh:5"),
        ("requeue", None, "s.sh:6")]
    assert parse_signal("B:USR1@40").seconds == 40 and parse_signal("RB:10").signal == "USR1"
    assert parse_signal("TERM").batch is False and parse_signal("TERM").seconds == 60
    with pytest.raises(ValueError):
        parse_signal("X:USR1@10")
    calls = launcher_calls(parse_script("#!/bin/bash\nexec \\\n  rsrun python t.py\n", "c.sh"))
    assert [(c.line, c.exec_) for c in calls] == [(2, True)]


@pytest.mark.proc
def test_grace_too_short_is_reported(tmp_path: Path) -> None:
    code, r = check_script(tmp_path, GOOD.replace("B:USR1@120", "B:USR1@45"))
    g = r["script.grace"]
    assert g["status"] == "WARN" and g["details"]["save_window"] == 45 - 30 - 3.0, g
    code, r = check_script(tmp_path, GOOD.replace("B:USR1@120", "B:USR1@20"))
    assert r["script.grace"]["status"] == "FAIL" and code == 1


@pytest.mark.proc
def test_table_output_and_exit_codes(tmp_path: Path) -> None:
    bad = script(tmp_path, GOOD.replace("B:USR1@120", "USR1@60"))
    r = doctor("--script", str(bad), "--skip", "local,durable,signals")
    assert r.returncode == 1, r.stderr
    assert "script.signal" in r.stdout and "FAIL" in r.stdout and "--signal=USR1@60" in r.stdout
    assert "1 FAIL" in r.stdout.splitlines()[-1] and "(exit 1)" in r.stdout
    # Bad usage or settings: exit 2 with the reason, before any check runs.
    for args, env, words in [
        (["--skip", "script.sigal"], {}, "--skip script.sigal: no such check"),
        (["--script", str(tmp_path / "missing.sh")], {}, "missing.sh"),
        ([], {"RSLURM_DURABLE": "ftp://host/x"}, "unknown scheme 'ftp'"),
        ([], {"RSLURM_LOCAL_DIRR": "/x"}, "RSLURM_LOCAL_DIR"),
        (["--bandwidth-size", "lots"], {}, "--bandwidth-size"),
        (["job.sh"], {}, "sbatch options go after --"),
    ]:
        r = doctor(*args, env=env)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)


# ------------------------------------------------------------------------------------------ local dir
def _device_written_bytes(path: Path) -> int | None:
    """Bytes written so far to the block device holding ``path`` (/proc/diskstats), None if unknown."""
    m = mount_of(str(path))
    if m is None or not m.source.startswith("/dev/"):
        return None
    dev = os.path.basename(os.path.realpath(m.source))
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if len(f) > 9 and f[2] == dev:
            return int(f[9]) * 512
    return None


def local(tmp: Path, *extra: str, env: Mapping[str, str] | None = None) -> tuple[int, dict]:
    r = doctor("--skip", "script,cluster,durable,signals", "--json", *extra, env=env)
    return r.returncode, rows(report(r))


@pytest.mark.proc
def test_bandwidth_is_measured_and_the_probe_file_removed(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "keep.txt").write_text("user data")
    before = _device_written_bytes(nvme)
    code, r = local(tmp_path, "--local-dir", str(nvme), "--bandwidth-size", "64M", "--checkpoint-size", "1G")
    after = _device_written_bytes(nvme)
    bw = r["local.bandwidth"]
    assert code == 0 and bw["status"] == "OK", bw
    assert bw["details"]["bytes"] == 64 * MiB and bw["details"]["mib_per_s"] > 0 and bw["details"]["seconds"] > 0
    assert bw["details"]["checkpoint_seconds"] > 0 and "1.0 GiB checkpoint takes about" in bw["finding"]
    print(f"local dir write bandwidth: {bw['finding']}")
    if before is not None and after is not None and bw["details"]["o_direct"]:
        assert after - before >= 64 * MiB, "the probe's 64 MiB never reached the device"
    assert sorted(p.name for p in nvme.iterdir()) == ["keep.txt"]  # probe files gone, user data kept
    assert r["local.dir"]["status"] == "OK" and r["local.space"]["status"] == "OK"
    assert r["local.filesystem"]["details"]["fstype"] == mount_of(str(nvme)).fstype  # type: ignore[union-attr]


@pytest.mark.proc
def test_a_missing_local_dir_is_created_then_removed(tmp_path: Path) -> None:
    code, r = local(tmp_path, "--local-dir", str(tmp_path / "a" / "b" / "%n"), "--bandwidth-size", "4M")
    assert code == 0 and r["local.dir"]["status"] == "OK" and r["local.dir"]["details"]["created"] is True
    assert r["local.bandwidth"]["status"] == "OK"
    assert not (tmp_path / "a").exists()


@pytest.mark.proc
def test_a_file_where_the_local_dir_should_be_fails(tmp_path: Path) -> None:
    (tmp_path / "nvme").write_text("not a directory")
    code, r = local(tmp_path, "--local-dir", str(tmp_path / "nvme" / "%n"))
    assert code == 1
    d = r["local.dir"]
    assert d["status"] == "FAIL" and "Not a directory" in d["finding"] and str(tmp_path / "nvme") in d["finding"]
    assert r["local.bandwidth"]["status"] == "SKIP"


@pytest.mark.proc
def test_a_read_only_local_dir_fails(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        # Root writes through any permission bits: a read-only mount is what stops it.
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True,
                                 text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
        words = "Read-only file system"
    else:
        ro.chmod(0o500)
        words = "Permission denied"
    try:
        code, r = local(tmp_path, "--local-dir", str(ro))
        assert code == 1 and r["local.dir"]["status"] == "FAIL" and words in r["local.dir"]["finding"], r["local.dir"]
        assert r["local.bandwidth"]["status"] == "SKIP"
        code, r = local(tmp_path, "--local-dir", str(ro / "sub"))
        assert code == 1 and words in r["local.dir"]["finding"]
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)], check=False)
        else:
            ro.chmod(0o700)


@pytest.mark.proc
def test_space_and_filesystem_findings(tmp_path: Path) -> None:
    code, r = local(tmp_path, "--local-dir", str(tmp_path), "--bandwidth-size", "0", "--checkpoint-size", "100T")
    assert code == 1 and r["local.space"]["status"] == "FAIL" and "does not fit" in r["local.space"]["finding"]
    assert r["local.bandwidth"]["status"] == "SKIP"
    shm = Path("/dev/shm")
    if not shm.is_dir() or mount_of(str(shm)) is None or mount_of(str(shm)).fstype != "tmpfs":  # type: ignore[union-attr]
        pytest.skip("no tmpfs at /dev/shm")
    code, r = local(tmp_path, "--local-dir", str(shm / f"rslurm-doctor-test-{os.getpid()}"), "--bandwidth-size", "4M")
    assert r["local.filesystem"]["status"] == "WARN" and "RAM" in r["local.filesystem"]["finding"]
    assert r["local.bandwidth"]["status"] == "OK"  # O_DIRECT or not: tmpfs takes it since Linux 6.6
    assert not (shm / f"rslurm-doctor-test-{os.getpid()}").exists()


# ------------------------------------------------------------------------------------------ durable tier
def durable(*extra: str, env: Mapping[str, str]) -> tuple[int, dict[str, Any], float]:
    t0 = time.monotonic()
    r = doctor("--skip", "script,cluster,local,signals", "--json", *extra, env=env, timeout=120)
    return r.returncode, rows(report(r))["durable"], time.monotonic() - t0


@pytest.mark.proc
def test_durable_posix_round_trip(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem at /dev/shm")
    dur = shm / f"rslurm-doctor-durable-{os.getpid()}"
    try:
        code, d, _ = durable("--durable", str(dur), "--local-dir", str(tmp_path / "nvme"), env={})
        assert code == 0 and d["status"] == "OK", d
        assert set(d["details"]["latency_ms"]) == {"put", "get", "delete"}
        assert list(dur.iterdir()) == []  # the probe object and its directories are gone
    finally:
        subprocess.run(["rm", "-rf", str(dur)], check=False)
    # The same filesystem as the local dir does not survive the loss of the node's disk.
    code, d, _ = durable("--durable", f"file://{tmp_path / 'lustre'}", "--local-dir", str(tmp_path / "nvme"), env={})
    assert code == 0 and d["status"] == "WARN" and "same filesystem" in d["finding"], d


@pytest.mark.proc
def test_no_durable_tier_warns(tmp_path: Path) -> None:
    code, d, _ = durable(env={})
    assert code == 0 and d["status"] == "WARN" and "no durable tier" in d["finding"]


@pytest.mark.proc
def test_durable_s3_on_moto(moto_server: MotoServer, s3_bucket: str) -> None:
    env = {**FAKE_ENV, "RSLURM_S3_ENDPOINT_URL": moto_server.endpoint}
    code, d, _ = durable("--durable", f"s3://{s3_bucket}/ckpt", env=env)
    assert code == 0 and d["status"] == "OK", d
    assert d["details"]["endpoint"] == moto_server.endpoint and d["details"]["latency_ms"]["get"] > 0
    assert moto_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    code, d, _ = durable("--durable", "s3://no-such-bucket-here/ckpt", env=env)
    assert code == 1 and d["status"] == "FAIL" and "no-such-bucket-here" in d["finding"] and "does not exist" in \
        d["finding"], d


@pytest.mark.proc
def test_dead_s3_endpoint_fails_quickly() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {**FAKE_ENV, "RSLURM_S3_ENDPOINT_URL": endpoint, "RSLURM_S3_MAX_ATTEMPTS": "2"}
    code, d, took = durable("--durable", "s3://bucket/ckpt", env=env)
    assert code == 1 and d["status"] == "FAIL", d
    assert endpoint in d["finding"] and "after 2 attempt(s)" in d["finding"], d
    print(f"dead endpoint reported in {took:.1f} s")
    # Default attempts are capped for a diagnosis: 3, not the 8 the daemon uses.
    code, d, _ = durable("--durable", "s3://bucket/ckpt", env={**env, "RSLURM_S3_MAX_ATTEMPTS": "8"})
    assert "after 3 attempt(s)" in d["finding"], d


# ------------------------------------------------------------------------------------------ on the cluster
# Nothing of the probe may outlive doctor: within 10 s (a killed step is torn down, not instantly) the job
# has only its batch step and no probe process. Run in the job right after doctor.
NO_PROBE_LEFT = """\
for i in $(seq 50); do
  squeue -h -s -j $SLURM_JOB_ID -o %j > {work}/steps.txt
  pgrep -af resilient_slurm.doctor.probe > {work}/probes.txt
  [ "$(cat {work}/steps.txt)" = batch ] && [ ! -s {work}/probes.txt ] && break
  sleep 0.2
done
"""
def _job_script(slurm: SlurmCluster, work: Path, signal: str, doctor_args: str = "") -> str:
    # Test clusters that run at the same time may number jobs alike: keep their control sockets apart.
    # Nothing rendezvous-related: n1 and n2 are names only Slurm knows; rslurm derives MASTER_ADDR.
    env = {"PATH": f"{VENV_BIN}:$PATH", "PYTHONPATH": str(REPO), "RSLURM_LOCAL_DIR": str(work / "nvme" / "%n"),
           "RSLURM_CONTROL_DIR": str(slurm.root / "ctl")}
    exports = "".join(f'export {k}="{v}"\n' for k, v in env.items())
    return (f"#!/bin/bash\n#SBATCH -N2 --ntasks-per-node=1\n#SBATCH --signal={signal}\n#SBATCH --requeue\n"
            f"#SBATCH --open-mode=append\n{exports}"
            f"rslurm doctor --json --bandwidth-size 8M {doctor_args} > {work}/doctor.json 2> {work}/doctor.err\n"
            f"echo $? > {work}/doctor.rc\n"
            f"{NO_PROBE_LEFT.format(work=work)}"
            "exec rslurm launch -- srun -N2 -n2 true\n")


def _run_job(slurm: SlurmCluster, work: Path, text: str) -> tuple[int, int, dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    job = slurm.sbatch(text, "-o", str(work / "job.out"))
    try:
        slurm.wait_state(job, "COMPLETED", timeout=120)
    except BaseException:
        out = work / "job.out"
        print(out.read_text()[-4000:] if out.exists() else "(no job output)")
        err = work / "doctor.err"
        print(err.read_text()[-4000:] if err.exists() else "(no doctor stderr)")
        raise
    rc = int((work / "doctor.rc").read_text())
    doc = json.loads((work / "doctor.json").read_text())
    assert doc["summary"]["exit_code"] == rc
    return job, rc, doc


@pytest.mark.proc
def test_inside_a_job_reads_its_script_and_signals_both_nodes(slurm: SlurmCluster) -> None:
    work = slurm.work_dir / "doctor-good"
    job, rc, doc = _run_job(slurm, work, _job_script(slurm, work, "B:USR1@60"))
    r = rows(doc)
    assert doc["in_allocation"] is True and doc["job_id"] == str(job)
    assert rc == 0, [c for c in doc["checks"] if c["status"] == "FAIL"]
    # The directives came from the job's own script, as Slurm stored it.
    sig = r["script.signal"]
    assert sig["status"] == "OK" and sig["details"]["source"] == f"the batch script of job {job} (scontrol write " \
        "batch_script)" and sig["details"]["at"] == f"job {job} script:3", sig
    assert r["script.requeue"]["status"] == "OK" and "Requeue=1" in r["script.requeue"]["finding"]
    assert r["script.open-mode"]["status"] == "OK" and "SLURM_OPEN_MODE=a" in r["script.open-mode"]["finding"]
    assert r["script.exec"]["status"] == "OK" and r["script.grace"]["status"] == "WARN"  # @60 leaves 27 s
    # The cluster's preemption settings, as tests/slurm_cluster.py configures them.
    pre = r["cluster.preemption"]["details"]
    assert (pre["partition"], pre["preempt_mode"], pre["grace_time"], pre["preempt_type"]) == \
        ("low", "REQUEUE", slurm.grace_time, "preempt/partition_prio")
    assert r["cluster.user-signal"]["status"] == "OK"
    assert r["cluster.kill-wait"]["details"]["kill_wait"] == slurm.kill_wait
    # The save signal went through Slurm to a probe task on each node.
    d = r["signals.delivery"]
    assert d["status"] == "OK", d
    assert sorted(d["details"]["received_s"]) == ["n1", "n2"] and d["details"]["signal"] == "USR2"
    assert {v["inherited"] for v in d["details"]["ready"].values()} == {"default"}
    assert r["signals.control-dir"]["status"] == "OK" and r["local.bandwidth"]["status"] == "OK"
    assert_no_probe_left(work)


def assert_no_probe_left(work: Path) -> None:
    """What the job saw right after the probe: its steps (only the batch step) and probe processes (none)."""
    assert (work / "steps.txt").read_text().split() == ["batch"], (work / "steps.txt").read_text()
    assert (work / "probes.txt").read_text().strip() == "", (work / "probes.txt").read_text()


@pytest.mark.proc
def test_inside_a_job_without_b_the_signal_directive_fails(slurm: SlurmCluster) -> None:
    work = slurm.work_dir / "doctor-no-b"
    job, rc, doc = _run_job(slurm, work, _job_script(slurm, work, "USR1@60", "--skip local"))
    r = rows(doc)
    assert rc == 1
    fails = [c["check"] for c in doc["checks"] if c["status"] == "FAIL"]
    assert fails == ["script.signal"], fails
    assert "`--signal=USR1@60`" in r["script.signal"]["finding"] and f"job {job} script:3" in \
        r["script.signal"]["finding"]
    assert r["signals.delivery"]["status"] == "OK"  # the save signal itself still gets through


@pytest.mark.proc
def test_a_signal_that_never_arrives_fails_and_leaves_no_probe(slurm: SlurmCluster) -> None:
    """The probe driver with a Slurm client whose signal is lost on the way (the real step, real srun)."""
    work = slurm.work_dir / "doctor-lost"
    work.mkdir(parents=True, exist_ok=True)
    code = textwrap.dedent(f"""\
        import json, os
        from resilient_slurm.doctor.probe import probe_signal_delivery
        from resilient_slurm.slurm import CliSlurmClient

        class LostSignal(CliSlurmClient):
            def signal(self, job_id, sig, **kw):
                if sig != "KILL":
                    return  # the signal is lost; KILL (the teardown) goes through
                super().signal(job_id, sig, **kw)

        res = probe_signal_delivery(LostSignal(), os.environ["SLURM_JOB_ID"], ["n1", "n2"], "USR2",
                                    signal_timeout=2)
        json.dump({{"missing": res.missing, "ready": sorted(res.ready), "step": res.step, "error": res.error}},
                  open("{work}/probe.json", "w"))
        """)
    after = NO_PROBE_LEFT.format(work=work)
    (work / "probe.py").write_text(code)
    text = f"#!/bin/bash\n#SBATCH -N2\nexport PYTHONPATH={REPO}\n{PY} {work}/probe.py\n{after}"
    job = slurm.sbatch(text, "-o", str(work / "job.out"))
    slurm.wait_state(job, "COMPLETED", timeout=120)
    res = json.loads((work / "probe.json").read_text())
    assert res["ready"] == ["n1", "n2"] and res["missing"] == ["n1", "n2"] and res["error"] is None, res
    assert_no_probe_left(work)


@pytest.mark.proc
def test_login_node_script_and_submitted_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    env = {k: v for k, v in slurm.env().items() if k in ("SLURM_CONF", "PATH")}
    # A script without --requeue: the cluster's JobRequeue=1 makes it requeueable, doctor says it relies on that.
    p = script(tmp_path, GOOD.replace("    #SBATCH --requeue\n", ""))
    r = doctor("--script", str(p), "--skip", "local,durable", "--json", env=env)
    doc = rows(report(r))
    assert doc["script.requeue"]["status"] == "WARN" and "JobRequeue=1" in doc["script.requeue"]["finding"]
    assert doc["cluster.preemption"]["details"]["partition"] == "low"  # the default partition
    assert doc["signals.delivery"]["status"] == "SKIP" and r.returncode == 0, [c for c in doc.values() if c["status"] == "FAIL"]
    # --job: a submitted job's own script and partition, read from Slurm.
    job = slurm.sbatch("#!/bin/bash\n#SBATCH --signal=USR2@90\nsleep 30\n", "-p", "high", "-o", "/dev/null")
    r = doctor("--job", str(job), "--skip", "local,durable", "--json", env=env)
    doc = rows(report(r))
    assert r.returncode == 1 and doc["script.signal"]["status"] == "FAIL" and "USR2@90" in doc["script.signal"][
        "finding"]
    assert doc["cluster.preemption"]["details"]["partition"] == "high"
    assert doc["script.exec"]["status"] == "WARN"
    slurm.scancel(job)


@pytest.mark.proc
def test_in_salloc_there_is_no_script_but_signals_are_checked(slurm: SlurmCluster, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(REPO), "RSLURM_CONTROL_DIR": str(slurm.root / "ctl")}
    cp = slurm.run(["salloc", "-N2", PY, "-m", "resilient_slurm.cli", "doctor", "--json", "--skip", "local,durable"],
                   env=env, timeout=120, check=False)
    doc = json.loads(cp.stdout)
    r = rows(doc)
    assert doc["in_allocation"] is True and cp.returncode == 0, cp.stderr[-3000:]
    assert r["script"]["status"] == "SKIP" and "interactive allocation" in r["script"]["finding"], r["script"]
    assert r["signals.delivery"]["status"] == "OK" and sorted(r["signals.delivery"]["details"]["received_s"]) == \
        ["n1", "n2"]
