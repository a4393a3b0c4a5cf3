"""Ctrl-C during a run: acted on where the run can stop cleanly, never lost.

Python raises a Ctrl-C (SIGINT) as a KeyboardInterrupt wherever the main thread
happens to be. Inside a run that may be:

- a garbage-collection callback (JAX registers one): Python prints "Exception
  ignored in _xla_gc_callback" and drops the interrupt, and the run trains on to the
  end and exits 0 (issue #64);
- JAX compiling or dispatching a step, or a module being imported: the process can
  end in a crash at exit after the message that it was interrupted;
- a step that has donated its state and not yet bound the new one (issue #42).

`Interrupts` holds the signal instead: its handler records it, and `Interrupts.check`
raises the KeyboardInterrupt at the points the run places it, before anything is
written and at each step boundary, where the state is whole and can be saved. A
second Ctrl-C raises at once, as Python's own handler would.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Optional

__all__ = ["InterruptedBeforeStart", "Interrupts"]


class InterruptedBeforeStart(KeyboardInterrupt):
  """A Ctrl-C acted on before the run wrote anything: there is nothing to resume."""


class Interrupts:
  """A context in which Ctrl-C is held until `check` (the main thread only).

  Inside it a first SIGINT is recorded and a line says the run stops at its next
  step boundary; `check` then raises KeyboardInterrupt, or calls the handler that
  was installed before, if that was a program's own. A second SIGINT raises at once.
  Where SIGINT was ignored (``SIG_IGN``), or off the main thread (where Python runs
  no handlers), nothing is installed and `check` never raises. Entered inside
  another (the command's, then the run's), it shares the outer one's record.

  Args:
    say: prints the line of the first Ctrl-C (default: to stderr); None for quiet.
  """

  def __init__(self, say: Optional[Any] = print):
    self.say = say
    self.caught = 0
    self.previous: Any = None
    self.installed = False
    self.outer: Optional[Interrupts] = None

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is threading.main_thread():
      previous = signal.getsignal(signal.SIGINT)
      outer = getattr(previous, "__self__", None)
      if isinstance(outer, Interrupts):
        self.outer = outer
      elif previous is not signal.SIG_IGN:
        self.previous = previous
        signal.signal(signal.SIGINT, self._handler)
        self.installed = True
    return self

  def __exit__(self, *exc_info: Any) -> None:
    if self.installed:
      signal.signal(signal.SIGINT, self.previous)
      self.installed = False

  def _handler(self, signum: int, frame: Any) -> None:
    self.caught += 1
    if self.caught > 1:
      raise KeyboardInterrupt
    if self.say is not None:
      self.say("Ctrl-C: stopping at the next step boundary (Ctrl-C again stops at "
               "once)", file=sys.stderr)

  def check(self, started: bool = True) -> None:
    """Raises the held interrupt, if one arrived: KeyboardInterrupt, or whatever the
    handler found at `__enter__` does (a program's own handler may not raise).

    Args:
      started: whether the run has written anything; if not, the interrupt is an
        `InterruptedBeforeStart`.
    """
    if self.outer is not None:
      self.outer.check(started)
      return
    if not self.caught:
      return
    self.caught = 0
    if callable(self.previous) and self.previous is not signal.default_int_handler:
      self.previous(signal.SIGINT, None)
      return
    raise KeyboardInterrupt if started else InterruptedBeforeStart
