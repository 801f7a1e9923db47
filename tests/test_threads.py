"""The automatic thread count: the physical cores other programs leave free, said where it matters, and the
bench's warning when the load during its runs made its numbers doubtful. Load values are faked: a test must not
depend on how busy the machine running it is."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from localspec import config, machine
from localspec.models import doctor, memory
from localspec.sessions.bench import contention
from localspec.sessions.session import ModelFiles, open_session
from localspec.status import Status


@pytest.mark.parametrize(
    ("cores", "load", "busy_now", "threads"),
    [
        (2, 0.1, 0.0, 2),  # idle: every core
        (2, 0.6, 0.1, 1),  # about one core busy for the last minute
        (2, 2.0, 2.0, 1),  # two busy loops beside us: still one thread, never zero
        (2, 9.7, 2.0, 1),  # a very busy box
        (2, 0.2, 1.9, 1),  # a program that started a moment ago: the average has not seen it yet
        (2, 1.9, 0.0, 1),  # the average still counts a run that just ended: one thread too few costs little
        (16, 3.4, 1.0, 13),
        (8, None, None, 8),  # nothing measurable on this system: every core, and the line says so
        (0, 0.0, 0.0, 1),  # psutil could not count the cores
    ],
)
def test_threads_are_the_free_physical_cores_at_least_one(cores: int, load: float | None, busy_now: float | None,
                                                          threads: int) -> None:
    choice = machine.choose_threads(cores, load, busy_now)
    assert choice.threads == threads
    text = choice.describe()
    assert text.startswith(f"{threads} of {max(cores, 1)} physical cores")
    if threads < cores:
        assert f"load average {load:.1f}" in text and "busy elsewhere" in text
    if load is None:
        assert "load average unknown" in text


def test_thread_choice_reads_the_load_average_and_the_cpu_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "physical_cores", lambda: 2)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 3.0)
    monkeypatch.setattr(psutil, "getloadavg", lambda: (2.3, 1.0, 0.5))
    busy = machine.thread_choice()
    assert (busy.threads, busy.load, busy.busy_now) == (1, 2.3, pytest.approx(0.06))
    monkeypatch.setattr(psutil, "getloadavg", lambda: (0.2, 1.0, 0.5))  # only the 1-minute average counts
    assert machine.thread_choice().threads == 2
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 97.0)  # two busy loops, just started
    assert machine.thread_choice().threads == 1

    def refused() -> tuple[float, float, float]:
        raise OSError("no /proc/loadavg here")

    monkeypatch.setattr(psutil, "getloadavg", refused)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 0.0)
    assert machine.thread_choice() == machine.ThreadChoice(threads=2, cores=2, load=None, busy_now=0.0)


@pytest.mark.slow
def test_a_session_takes_the_free_cores_and_keeps_a_set_count(tiny_pair: tuple[Path, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "physical_cores", lambda: 4)
    monkeypatch.setattr(psutil, "getloadavg", lambda: (2.8, 2.0, 1.0))  # three of four cores are busy
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 10.0)
    target, draft = tiny_pair
    files = ModelFiles(target=target, draft=draft, name="custom")
    preset = config.load_preset().with_overrides(n_ctx=256)
    with open_session(files, preset) as session:
        assert session.threads is not None and session.threads.threads == 1
        assert session.target.n_threads == session.draft.n_threads == 1
    with open_session(files, preset.with_overrides(threads=3)) as session:  # set: used as given
        assert session.threads is None and session.target.n_threads == session.draft.n_threads == 3


def test_doctor_says_how_many_threads_and_warns_when_a_set_count_exceeds_the_free_cores() -> None:
    busy = machine.choose_threads(2, 1.9, 1.2)
    auto = doctor.threads_check(0, busy)
    assert auto.status == Status.OK
    assert auto.detail == ("auto: 1 of 2 physical cores: load average 1.9, 1.2 cores in use just now, so about 2 "
                           "are busy elsewhere")
    too_many = doctor.threads_check(2, busy)
    assert too_many.status == Status.WARN and too_many.fix.startswith("--threads 1")
    assert doctor.threads_check(1, busy).status == Status.OK
    checks = doctor.run_checks(None, None, config.load_preset(), missing="no files", threads=busy,
                               devices=memory.Devices(ram_available=1 << 30))
    assert [c for c in checks if c.name == "CPU threads"] == [auto]


def test_bench_warns_when_the_load_made_its_numbers_doubtful() -> None:
    # 1 thread of ours on 2 cores, two busy loops beside it: the load average after the runs is about 3.
    busy = contention(1, 2, 2.1, 3.0, [10.0, 10.5, 9.8])
    assert len(busy) == 1 and "load average was 3.0 on 2 physical cores with 1 thread of ours" in busy[0]
    assert "--threads" not in busy[0]  # one thread is already the fewest
    # 2 threads chosen on an idle box, then another program started: fewer threads would have been better.
    rose = contention(2, 2, 0.2, 3.1, [10.0, 10.1])
    assert "(from 0.2)" in rose[0] and rose[0].endswith("or with --threads 1")
    # the box was ours alone: the load is our own threads
    assert contention(2, 2, 0.1, 2.2, [10.0, 10.3, 9.9]) == []
    # plain decoding does the same work each run: a wide spread means something else ran
    noisy = contention(1, 2, None, None, [12.0, 4.0, 11.0])
    assert len(noisy) == 1 and "between 4.0 and 12.0 tok/s" in noisy[0]
