"""The oldest releases mpscale works with, checked when it is imported.

These are pyproject.toml's lower bounds; CI runs the tests on exactly these releases
(.ci/floors.txt) as well as on the newest ones. A pip that honours the bounds never
installs older ones, but a cluster image or a ``--no-deps`` install can: importing
mpscale then fails at once, naming the package and the version needed, instead of
deep inside a trace.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional

FLOORS = {
    "jax": "0.7.1",
    "jaxlib": "0.7.1",
    "optax": "0.2.7",
    "flax": "0.10.7",
    "chex": "0.1.89",
}


def _release(version: str) -> tuple[int, ...]:
  """The numeric release of a version string: ``"0.7.0rc1"`` -> ``(0, 7, 0)``."""
  parts = []
  for piece in version.split("."):
    m = re.match(r"\d+", piece)
    if not m:
      break
    parts.append(int(m.group()))
    if m.end() < len(piece):
      break
  return tuple(parts)


def at_least(version: str, floor: str) -> bool:
  """Whether release ``version`` is ``floor`` or newer (``"0.10.2"``, ``"0.7.0rc1"``)."""
  return _release(version) >= _release(floor)


def installed(name: str) -> Optional[str]:
  """The installed distribution's version of ``name``, or None."""
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def check(installed_versions: Optional[dict[str, str]] = None) -> None:
  """Raises ``ImportError`` naming every package older than its floor.

  Args:
    installed_versions: ``name -> version`` to check instead of the installed
      distributions (for tests).
  """
  too_old = []
  for name, floor in FLOORS.items():
    version = (installed_versions.get(name) if installed_versions is not None
               else installed(name))
    if version is None:
      continue  # not installed as a distribution (e.g. a source tree): nothing to say
    if _release(version) < _release(floor):
      too_old.append(f"{name} {version} (needs >= {floor})")
  if too_old:
    raise ImportError("mpscale needs newer releases: " + ", ".join(too_old) +
                      "; upgrade with: pip install -U " +
                      " ".join(t.split()[0] for t in too_old))
