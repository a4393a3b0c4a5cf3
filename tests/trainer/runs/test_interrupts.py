"""Ctrl-C during a run (mpscale.trainer.runs.interrupts): held until the run can stop
cleanly, never lost, and a command interrupted before it started writes nothing.

Issue #64: a Ctrl-C 2.5-3.5 s into ``mpscale train`` was raised inside JAX's
garbage-collection callback, which Python prints and drops, and the run trained all
its steps and exited 0; one raised while a module imported printed a traceback."""

import gc
import os
import signal
import subprocess
import sys

import pytest

from mpscale.trainer import cli
from mpscale.trainer.runs import interrupts as interrupts_lib
from mpscale.trainer.runs import loop as loop_lib
from tests.trainer.test_cli import FP16, SMALL, rows, train_args


def _sigint():
  os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def python_sigint():
  """SIGINT as a terminal's Python process handles it, for the test."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def test_a_held_ctrl_c_is_raised_at_the_check_and_a_second_at_once(python_sigint):
  with interrupts_lib.Interrupts(say=None) as held:
    held.check()  # nothing arrived
    _sigint()  # held: no exception here
    with pytest.raises(KeyboardInterrupt) as e:
      held.check()
    assert not isinstance(e.value, interrupts_lib.InterruptedBeforeStart)
    held.check()  # raised once
    _sigint()
    with pytest.raises(interrupts_lib.InterruptedBeforeStart):
      held.check(started=False)
    _sigint()
    with pytest.raises(KeyboardInterrupt):
      _sigint()  # the second Ctrl-C before a check: at once
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_inside_a_gc_callback_is_not_lost(python_sigint):
  """Python drops an exception raised in a gc callback: held, it is still there."""
  def callback(phase, info):
    if phase == "start":
      _sigint()
      sum(range(10))  # Python code: where the interrupt would be raised and dropped

  with interrupts_lib.Interrupts(say=None) as held:
    gc.callbacks.append(callback)
    try:
      gc.collect()
    finally:
      gc.callbacks.remove(callback)
    with pytest.raises(KeyboardInterrupt):
      held.check()


def test_nested_holds_share_one_record_and_ignored_sigint_stays_ignored(python_sigint):
  with interrupts_lib.Interrupts(say=None) as outer:
    with interrupts_lib.Interrupts(say=None) as inner:
      _sigint()
      with pytest.raises(KeyboardInterrupt):
        inner.check()
      outer.check()  # the same interrupt, raised once
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  with interrupts_lib.Interrupts(say=None) as held:
    _sigint()
    held.check()
  assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_ctrl_c_in_jaxs_gc_callback_during_the_first_step_stops_the_run(
    tmp_path, monkeypatch, python_sigint):
  """The first step's compile collects garbage; a Ctrl-C that lands in the collection's
  callback stops the run after that step, saved and logged, and --resume finishes it."""
  from jax import core as jax_core

  from mpscale.trainer.config import build as builders
  real_build = builders.build

  def build(*args, **kwargs):
    setup = real_build(*args, **kwargs)
    if kwargs.get("abstract"):
      return setup
    sent = []

    def callback(phase, info):
      if phase == "start" and not sent:
        sent.append(1)
        _sigint()
        sum(range(10))

    def step(state, batch):
      if isinstance(state.step, jax_core.Tracer):  # a trace of the step, not a step
        return setup.step(state, batch)
      gc.callbacks.append(callback)
      try:
        gc.collect()
        return setup.step(state, batch)
      finally:
        gc.callbacks.remove(callback)
    return setup._replace(step=step)

  monkeypatch.setattr(builders, "build", build)
  out = tmp_path / "run"
  assert cli.main(train_args(FP16, out)) == 130
  assert [int(r["step"]) for r in rows(out)] == [1]
  assert sorted(int(d) for d in os.listdir(out / "checkpoints") if d.isdigit()) == [1]
  monkeypatch.setattr(builders, "build", real_build)
  assert cli.main(train_args(FP16, out, "--resume")) == 0
  assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4]


def test_a_ctrl_c_while_the_run_is_prepared_writes_nothing(tmp_path, monkeypatch,
                                                           capsys, python_sigint):
  real = loop_lib._prepare

  def prepare(*args, **kwargs):
    _sigint()  # held: the model and step are still built
    return real(*args, **kwargs)

  monkeypatch.setattr(loop_lib, "_prepare", prepare)
  out = tmp_path / "run"
  assert cli.main(train_args(FP16, out)) == 130
  assert "before the run wrote anything" in capsys.readouterr().err
  assert not out.exists()


def test_a_ctrl_c_while_the_command_imports_ends_it_before_it_starts(tmp_path):
  """`mpscale` (mpscale.__main__) holds a Ctrl-C while the trainer imports."""
  out = tmp_path / "run"
  code = f"""
import builtins, os, signal, sys
import mpscale.__main__ as entry
real = builtins.__import__
def importing(name, *args, **kwargs):
  if name == "mpscale.trainer":
    os.kill(os.getpid(), signal.SIGINT)
  return real(name, *args, **kwargs)
builtins.__import__ = importing
sys.exit(entry.main({train_args(FP16, out, overrides=SMALL)!r}))
"""
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, cwd=os.path.dirname(FP16) + "/..")
  assert done.returncode == 130, done.stderr[-2000:]
  assert "interrupted before it started anything" in done.stderr
  assert "Traceback" not in done.stderr and not out.exists()
