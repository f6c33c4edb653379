"""The progress bar is drawn only where it can be redrawn (a terminal, with "auto"), and log
lines never run into it: in a log file there is no bar, in a terminal each line clears it."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import sys
import termios
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TextIO

import pytest

from tessera.config import load_config
from tessera.engine import LogHook, ProgressBarHook
from tessera.engine.hooks import bar_wanted
from tessera.errors import ConfigError

LOG_LINES = ["step=1 loss=1", "step=2 loss=0.5", "step=4 loss=0.25"]


@pytest.fixture
def terminal() -> Iterator[tuple[TextIO, int]]:
    """A pseudo-terminal 100 columns wide: ``(stream writing to it, fd to read it back)``."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    stream = open(slave, "w", buffering=1)
    try:
        yield stream, master
    finally:
        stream.close()
        os.close(master)


def read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks, idle = [], 0
    while idle < 5:
        try:
            chunks.append(os.read(fd, 1 << 16))
            idle = 0
        except BlockingIOError:
            idle += 1
            time.sleep(0.02)
    return b"".join(chunks).decode()


def as_shown(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: a carriage return goes back to the start of the
    line, where the next characters overwrite the old ones."""
    shown = []
    for raw in text.replace("\r\n", "\n").split("\n"):
        line = ""
        for segment in raw.split("\r"):
            line = segment + line[len(segment) :]
        shown.append(line.rstrip())
    return shown[:-1] if shown and shown[-1] == "" else shown


def fit(hooks: list, steps: int = 4) -> None:
    """The hook events of a Trainer.fit over ``steps`` steps, on rank 0."""
    trainer = SimpleNamespace(engine=SimpleNamespace(ctx=SimpleNamespace(rank=0)), step=0, max_steps=steps, metrics={})
    for hook in hooks:
        hook.before_fit(trainer)
    for step in range(1, steps + 1):
        trainer.step, trainer.metrics = step, {"step": step, "loss": 1.0 / step}
        for hook in hooks:
            hook.after_step(trainer)
    for hook in hooks:
        hook.after_fit(trainer)


def test_auto_draws_a_bar_only_on_a_terminal(terminal):
    stream, _ = terminal
    assert bar_wanted("auto", stream) and not bar_wanted("auto", io.StringIO())
    assert bar_wanted(True, io.StringIO()) and not bar_wanted(False, stream)


def test_in_a_log_file_the_log_lines_stand_alone(monkeypatch):
    log_file = io.StringIO()  # stderr redirected to a file: not a terminal
    monkeypatch.setattr(sys, "stderr", log_file)
    fit([LogHook(every=2), ProgressBarHook()])
    assert log_file.getvalue() == "".join(line + "\n" for line in LOG_LINES)


def test_on_a_terminal_the_bar_is_drawn_and_each_log_line_clears_it(monkeypatch, terminal):
    stream, master = terminal
    monkeypatch.setattr(sys, "stderr", stream)
    fit([LogHook(every=2), ProgressBarHook()])
    stream.flush()
    shown = as_shown(read_all(master))
    assert shown[:-1] == LOG_LINES, shown
    assert shown[-1].startswith("train: 100%") and "4/4" in shown[-1], shown


def test_a_bar_asked_for_is_drawn_even_in_a_file():
    out = io.StringIO()
    fit([ProgressBarHook(enabled=True, stream=out)])
    assert "train: 100%" in out.getvalue()


def test_enabled_takes_true_false_or_auto():
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        ProgressBarHook(enabled="yes")  # type: ignore[arg-type]


def test_the_config_option_is_auto_by_default():
    assert load_config(None).trainer.progress_bar == "auto"
    for text, value in (("auto", "auto"), ("true", True), ("false", False)):
        assert load_config(None, [f"trainer.progress_bar={text}"]).trainer.progress_bar == value
    with pytest.raises(ConfigError, match="trainer.progress_bar"):
        load_config(None, ["trainer.progress_bar=sometimes"])
