"""Signal handlers take no lock (resilient_slurm/sigsafe.py): a flood of signals, each handled while the
main thread is inside the same flag's set / wait / clear, never hangs a process.

With threading.Event in place of WakeFlag the first program below never finishes (the handler's set()
waits for the Condition lock that the interrupted set() of its own thread holds; each later signal nests
another handler in that wait until the recursion limit ends the process): that is how a rank whose
launcher died hung in its handlers. Each program runs in a process of its own, with a timeout, so a
regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import clean_env

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)



def _flood(sig: str) -> str:
    """Program lines that start a shell sending signal ``sig`` to the program every few milliseconds until it is
    killed (pending signals coalesce: the program counts the ones its handler ran for). Not as fast as a
    shell can: a handler is itself interrupted by the next signal, and a flood without pause nests handlers
    until Python's recursion limit, whatever they do."""
    return ("import os, subprocess\n"
            f"killer = subprocess.Popen(['bash', '-c', 'while kill -{sig} %d; do sleep 0.002; done' % os.getpid()])\n")


def _run(*parts: str, timeout: float = 120) -> str:
    """The program made of ``parts`` (each dedented) in a process of its own; its stdout."""
    program = "".join(textwrap.dedent(p) for p in parts)
    r = subprocess.run([sys.executable, "-c", program], env=clean_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_a_wake_flag_set_by_a_flood_of_signals_while_its_thread_uses_it_never_hangs() -> None:
    out = _run("""
        import signal
        from resilient_slurm.sigsafe import WakeFlag
        flag = WakeFlag()
        handled = [0]
        def handler(s, f):
            handled[0] += 1
            flag.set()
        signal.signal(signal.SIGUSR1, handler)
    """, _flood("USR1"), """
        loops = 0
        while handled[0] < 300:
            flag.set(); flag.wait(0); flag.clear(); flag.is_set(); loops += 1
        killer.kill()
        killer.wait()
        import time
        time.sleep(0.2)  # the last signals handled
        flag.clear()
        assert flag.wait(0.0) is False  # cleared and no signal pending: not set
        flag.set()
        assert flag.wait(5) is True
        print(handled[0], loops)
    """)
    handled, loops = map(int, out.split())
    assert handled >= 300 and loops > 0, out  # the handler ran inside the loop's calls, 300 times


def test_the_launchers_trap_under_a_flood_of_signals_records_them_and_never_hangs() -> None:
    out = _run("""
        from resilient_slurm.launcher.signals import SignalTrap
        trap = SignalTrap().install()
    """, _flood("USR2"), """
        seen = 0
        while seen < 300:
            trap.wait(0.001)
            seen += len(trap.pop())
        killer.kill()
        killer.wait()
        trap.wait(0.5)
        seen += len(trap.pop())
        trap.restore()
        print(seen)
    """)
    assert int(out) >= 300, out


def test_a_wake_flag_wakes_a_waiting_thread_and_survives_close() -> None:
    _run("""
        import threading, time
        from resilient_slurm.sigsafe import WakeFlag
        flag = WakeFlag()
        got = []
        t = threading.Thread(target=lambda: got.append(flag.wait(30)))
        t.start()
        time.sleep(0.2)
        flag.set()
        t.join(10)
        assert got == [True], got  # woken, not left to its 30 s
        flag.clear()
        assert not flag.is_set() and flag.wait(0.01) is False
        flag.close()
        flag.set()
        assert flag.is_set() and flag.wait(0) is True  # still a flag once closed
        flag.clear()
        assert flag.wait(0.01) is False
    """)


def test_a_ranks_save_signal_flood_while_it_asks_for_a_save_itself_never_hangs(tmp_path: Path) -> None:
    """The rank's side: SIGTERM after SIGTERM (Slurm's, the launcher's, PR_SET_PDEATHSIG's) while the training
    thread itself asks for an emergency save (as the launcher watch and the control socket do): every
    handler sets the Checkpointer's request without a lock, and the step after it saves."""
    out = _run(f"""
        import torch
        from resilient_slurm import Checkpointer
        ckpt = Checkpointer(local_dir={str(tmp_path / "nvme")!r}, run_id="flood")
        seen = ckpt._link.signals_seen
    """, _flood("TERM"), """
        while len(ckpt._link.signals_seen) < 300:
            ckpt.request_emergency_save()
        killer.kill()
        killer.wait()
        ckpt.step(1, {"w": torch.ones(2)})
        print(len(ckpt._link.signals_seen), ckpt.should_stop)
        ckpt.close()
    """)
    handled, stop = out.split()
    assert int(handled) >= 300 and stop == "True", out
