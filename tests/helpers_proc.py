"""Child processes that a test stops with a signal, as a user would."""

from __future__ import annotations

import signal
import subprocess


def as_from_a_terminal() -> None:
    """`preexec_fn` for a child that a test stops with Ctrl-C (SIGINT): a child started from a background job or a
    script (`pytest ... &`) inherits SIGINT ignored, and localspec's commands keep it so (cli/app.py), as a shell's
    background jobs expect; from a terminal it is not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, grace: float = 30) -> tuple[str, str]:
    """Send `sig`, then reap the child and return its output. One still running `grace` seconds later is killed and
    reaped before the test fails: no server outlives the test run."""
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        raise AssertionError(f"still running {grace:g} s after {signal.Signals(sig).name}, killed; its stderr: "
                             f"{(stderr or '')[-2000:]!r}") from None
