"""How the ``rslurm`` command line ends on an interruption: one line and the shell's code, no traceback.
(Errors of usage, settings and data are tested with each command; this file runs ``cli.main`` in process.)"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from resilient_slurm import cli


@pytest.mark.parametrize("command", ["verify", "export", "doctor"])
def test_ctrl_c_ends_a_command_with_one_line_and_exit_130(command: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    # The parser takes each command's function when it is built, inside main: the stand-in is what runs.
    if command == "doctor":
        monkeypatch.setattr(cli.doctor, "cmd_doctor", interrupted)
        argv = ["doctor"]
    else:
        monkeypatch.setattr(cli, f"cmd_{command}", interrupted)
        argv = [command, "--local-dir", str(tmp_path)] + (["1", str(tmp_path / "out"), "--format", "torch"] if command == "export" else [])
    assert cli.main(argv) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert err.strip() == f"rslurm {command}: interrupted", err
