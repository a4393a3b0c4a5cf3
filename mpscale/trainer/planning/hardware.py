"""Hardware profiles: what one accelerator and its interconnect can do, as data files.

A profile describes one device (a GPU, a TPU chip) in the system it usually sits in,
for estimating a layout's step time from its FLOPs, bytes and collectives (issue #34):

- ``peak_flops``: the dense peak in FLOP/s by dtype name: ``bfloat16``, ``float16``,
  ``float32`` (plain FP32, no tensor cores) and ``tf32`` (NVIDIA's TensorFloat-32
  tensor-core rate, what a float32 matmul gets when TF32 is allowed). Dense means
  without 2:4 structured sparsity: a datasheet's "with sparsity" figure is twice it.
  A profile lists only the dtypes its sources give (`Hardware.peak` refuses others).
- ``hbm_bandwidth`` in bytes/s and ``hbm_bytes`` in bytes (1 GB = 1e9 bytes,
  1 GiB = 2**30 bytes, 1 Gb/s = 1e9 bits/s = 1.25e8 bytes/s).
- ``devices_per_node``: the devices of one node (a DGX, a TPU host).
- ``host_bandwidth`` (optional): bytes/s each way between a device and its host's
  memory (a GPU's PCIe link), what host offload's copies move at
  (`mpscale.trainer.planning.step_time`); a profile without it leaves them unpriced.
- ``links``: the interconnect's levels, fastest first (`Link`). A link's
  ``bandwidth`` is what one device can send at that level at once, in one direction,
  in bytes/s (a link quoted "600 GB/s bidirectional" is ``300e9``); its ``latency``
  is the fixed cost in seconds of one message (one step of a ring) over it; its
  ``span`` says how far it reaches (`SPANS`). How much of a level a collective uses
  depends on the topology (one axis of a TPU torus uses 2 of a chip's 6 ICI links):
  that is the estimator's concern, not the profile's.

The built-in profiles (`builtin_names`) are ``mpscale/trainer/planning/profiles/<name>.yaml``.
In them every number carries its origin, either sources (keys of the file's
``sources:`` mapping, each a document's title and URL) or ``assumed: true`` with a
``reason``; ``note`` says how a figure was derived::

  name: a100-80g
  description: NVIDIA A100 80GB SXM in a DGX A100
  peak_flops:
    bfloat16: {value: 312.0e12, sources: [a100_datasheet]}
  hbm_bandwidth: {value: 2.039e12, sources: [a100_datasheet]}
  hbm_bytes: {value: 80.0e9, sources: [a100_datasheet]}
  devices_per_node: {value: 8, sources: [hgx_a100]}
  links:
    - name: nvlink3
      span: node
      bandwidth: {value: 300.0e9, sources: [hgx_a100], note: 600 GB/s both ways}
      latency: {value: 3.4e-6, sources: [nccl_tuning]}
  sources:
    a100_datasheet: {title: NVIDIA A100 Tensor Core GPU Datasheet, url: https://...}

A user adds a profile by writing a file of the same form and passing its path
(``--hardware my-gpu.yaml``, ``load_hardware("my-gpu.yaml")``). There a number may
also be bare (``hbm_bandwidth: 2.0e12``), and ``name`` (default: the file's name),
``description`` and ``sources`` may be left out. A new built-in profile goes in the
folder above, every number cited or marked assumed; tests/trainer/planning/test_hardware.py loads it.

References:
  Each figure's source is cited in its file. A link's latency and bandwidth are the
  two terms of the usual cost model of a collective step (time = latency + bytes /
  bandwidth): Thakur, Rabenseifner and Gropp, "Optimization of Collective
  Communication Operations in MPICH", Int. J. High Perform. Comput. Appl. 19(1),
  2005.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from mpscale import validation
from mpscale.trainer.config import schema
from mpscale.trainer.planning import targets
from mpscale.trainer.config.schema import ConfigError, ConfigTypeError, parse_yaml

SPANS = {
    "node": "the devices of one node (devices_per_node of them)",
    "nodes": "devices in different nodes, over the cluster network",
    "slice": "the chips of one TPU slice, over ICI (a slice spans hosts)",
    "slices": "chips in different TPU slices, over the data-centre network",
}
"""What a `Link` reaches, by its ``span``."""

_PACKAGE = "mpscale.trainer.planning"
_FOLDER = "profiles"
_SUFFIX = ".yaml"
_TOP_KEYS = ("name", "description", "compile_target", "peak_flops", "hbm_bandwidth",
             "hbm_bytes", "host_bandwidth",
             "devices_per_node", "links", "matmul_efficiency", "memory_efficiency",
             "sources")
_REQUIRED_TOP = ("peak_flops", "hbm_bandwidth", "hbm_bytes", "devices_per_node",
                 "links")
_LINK_KEYS = ("name", "span", "bandwidth", "latency")
_NUMBER_KEYS = ("value", "sources", "assumed", "reason", "note")
_SOURCE_KEYS = ("title", "url")

DEFAULT_EFFICIENCY = {"matmul_efficiency": 0.8, "memory_efficiency": 0.8}
"""What a profile without ``matmul_efficiency`` or ``memory_efficiency`` gets: a
round figure below what large matrix products and streaming kernels reach on recent
GPUs (the built-in profiles cite theirs); `Hardware.assumed` then names the field."""


def _set(obj: Any, field: str, value: Any) -> None:
  object.__setattr__(obj, field, value)  # a frozen dataclass normalizing a field


def _text(name: str, value: Any, *, empty: bool = False) -> str:
  """``value`` if a str (non-empty unless ``empty``), else an `ArgumentError`."""
  if not isinstance(value, str):
    raise validation.fail(name, f" must be a string; got {type(value).__name__}",
                          validation.ArgumentTypeError)
  if not empty and not value.strip():
    raise validation.fail(name, " must not be empty")
  return value


@dataclasses.dataclass(frozen=True)
class Link:
  """One level of the interconnect, as one device sees it."""

  name: str
  """What the level is, e.g. ``nvlink3``, ``infiniband-hdr``, ``ici``."""
  bandwidth: float
  """Bytes/s one device can send at this level at once, in one direction."""
  latency: float
  """Seconds: the fixed cost of one message (one step of a ring) over it."""
  span: str
  """How far it reaches: a key of `SPANS` (``node``, ``nodes``, ``slice``,
  ``slices``)."""

  def __post_init__(self):
    _text("name", self.name)
    _set(self, "bandwidth", validation.positive_float("bandwidth", self.bandwidth))
    _set(self, "latency", validation.non_negative_float("latency", self.latency))
    validation.one_of("span", self.span, tuple(SPANS))


@dataclasses.dataclass(frozen=True)
class Hardware:
  """A device and its interconnect: peaks, memory and links (units: module doc).

  Raises (on construction):
    ArgumentError: a value out of range (a ``ValueError`` naming the field, e.g.
      ``links[1].bandwidth``); `validation.ArgumentTypeError` (also a
      ``TypeError``) for a value of the wrong type.
  """

  name: str
  """The profile's name (a built-in's is its file's name, e.g. ``a100-80g``)."""
  description: str
  """The device and the system it sits in, in words."""
  peak_flops: dict[str, float]
  """Dense peak FLOP/s by dtype name (``bfloat16``, ``float16``, ``float32``,
  ``tf32``); only those the sources give. Read it through `peak`."""
  hbm_bandwidth: float
  """Bytes/s between the device and its memory (HBM)."""
  hbm_bytes: float
  """Bytes of device memory (HBM)."""
  devices_per_node: int
  """Devices in one node (a DGX, a TPU host)."""
  links: tuple[Link, ...]
  """The interconnect's levels, fastest first."""
  matmul_efficiency: float = DEFAULT_EFFICIENCY["matmul_efficiency"]
  """The share of `peak` a large matrix product reaches, in (0, 1]: measured peaks
  fall short of the datasheet's (clocks, tiling); the step-time estimate
  (`mpscale.trainer.planning.step_time`) runs matrix products at ``peak * matmul_efficiency``."""
  memory_efficiency: float = DEFAULT_EFFICIENCY["memory_efficiency"]
  """The share of `hbm_bandwidth` a streaming (memory-bound) kernel reaches, in
  (0, 1]."""
  sources: tuple[str, ...] = ()
  """The documents the figures come from, ``"title <url>"``."""
  assumed: tuple[str, ...] = ()
  """The fields whose figure is assumed, not sourced (e.g. ``links[0].latency``)."""
  host_bandwidth: Optional[float] = None
  """Bytes/s each way between a device and its host's memory (a GPU's PCIe link):
  what host offload (``train.offload``) moves at; ``None``: not given."""
  compile_target: Optional[str] = None
  """The compiler a plan for this hardware reads (`mpscale.trainer.planning.targets`):
  ``"cuda/<spec>"`` (XLA's CUDA compiler for the GPU a spec of ``target_specs/``
  describes, e.g. ``cuda/h100_sxm``) or ``"tpu/<chip>"``; ``None``: the CPU's."""

  def __post_init__(self):
    _text("name", self.name)
    _text("description", self.description, empty=True)
    if not isinstance(self.peak_flops, Mapping):
      raise validation.fail("peak_flops", " must be a mapping of dtype name to "
                            f"FLOP/s; got {type(self.peak_flops).__name__}",
                            validation.ArgumentTypeError)
    if not self.peak_flops:
      raise validation.fail("peak_flops", " must name at least one dtype")
    peaks = {}
    for dtype, flops in self.peak_flops.items():
      if not isinstance(dtype, str):
        raise validation.fail(f"peak_flops.{dtype}", ": a dtype name must be a "
                              f"string; got {type(dtype).__name__}",
                              validation.ArgumentTypeError)
      peaks[dtype] = validation.positive_float(f"peak_flops.{dtype}", flops)
    _set(self, "peak_flops", peaks)
    _set(self, "hbm_bandwidth",
         validation.positive_float("hbm_bandwidth", self.hbm_bandwidth))
    _set(self, "hbm_bytes", validation.positive_float("hbm_bytes", self.hbm_bytes))
    if self.host_bandwidth is not None:
      _set(self, "host_bandwidth",
           validation.positive_float("host_bandwidth", self.host_bandwidth))
    _set(self, "devices_per_node",
         validation.positive_int("devices_per_node", self.devices_per_node))
    _set(self, "links", _links(self.links))
    for field in DEFAULT_EFFICIENCY:
      value = validation.positive_float(field, getattr(self, field))
      if value > 1:
        raise validation.fail(field, f" must be in (0, 1]; got {value:g}")
      _set(self, field, value)
    for field in ("sources", "assumed"):
      values = getattr(self, field)
      if isinstance(values, str) or not isinstance(values, Sequence):
        raise validation.fail(field, " must be a tuple of strings; got "
                              f"{type(values).__name__}", validation.ArgumentTypeError)
      _set(self, field, tuple(_text(f"{field}[{i}]", v) for i, v in enumerate(values)))

  def peak(self, dtype: Any) -> float:
    """The dense peak FLOP/s for ``dtype``.

    Args:
      dtype: a dtype name (``"bfloat16"``, ``"tf32"``) or a NumPy/JAX dtype
        (``jnp.bfloat16``, ``np.float32``).

    Returns:
      FLOP/s, from `peak_flops`.

    Raises:
      ArgumentError: naming ``dtype`` and the dtypes this profile lists, when it
        lists no peak for ``dtype``.
    """
    if isinstance(dtype, str):
      name = dtype
    else:
      try:
        name = np.dtype(dtype).name
      except TypeError:
        raise validation.fail("dtype", " must be a dtype or a dtype name; got "
                              f"{dtype!r}", validation.ArgumentTypeError) from None
    if name not in self.peak_flops:
      raise validation.fail("dtype", f": {self.name} lists no peak for {name!r}; it "
                            f"lists {', '.join(self.peak_flops)}")
    return self.peak_flops[name]


_DTYPE_PEAK = {"bfloat16": ("bfloat16",), "float16": ("float16",),
               "float32": ("tf32", "float32")}
"""The peak a compute dtype's matrix products get, first listed first: a float32
product runs on NVIDIA tensor cores as TF32 at XLA's default precision."""


def peak_for(hardware: Hardware, dtype: str) -> float:
  """The peak FLOP/s of ``dtype``'s matrix products on ``hardware`` (a float32 one
  at TF32's where the profile lists it): what a plan's step time
  (`mpscale.trainer.planning.step_time.estimate`) and a run's logged MFU
  (`mpscale.trainer.runs.throughput`) divide by.

  Raises:
    ArgumentError: naming ``dtype`` and the dtypes the profile lists, when it lists
      none for ``dtype``.
  """
  for name in _DTYPE_PEAK.get(dtype, (dtype,)):
    if name in hardware.peak_flops:
      return hardware.peak(name)
  return hardware.peak(dtype)  # raises, naming the dtypes the profile lists


def _links(links: Any) -> tuple[Link, ...]:
  """``links`` as a non-empty tuple of `Link`, fastest first, else an error naming
  the link at fault."""
  if isinstance(links, (str, Mapping)) or not isinstance(links, Sequence):
    raise validation.fail("links", " must be a sequence of Link; got "
                          f"{type(links).__name__}", validation.ArgumentTypeError)
  if not links:
    raise validation.fail("links", " must hold at least one link")
  for i, link in enumerate(links):
    if not isinstance(link, Link):
      raise validation.fail(f"links[{i}]", " must be a Link; got "
                            f"{type(link).__name__}", validation.ArgumentTypeError)
    if i and link.bandwidth > links[i - 1].bandwidth:
      raise validation.ArgumentError(
          (f"links[{i}].bandwidth", f"links[{i - 1}].bandwidth"),
          "{0} must not exceed {1}: links go fastest first; got "
          f"{link.bandwidth:g} > {links[i - 1].bandwidth:g} bytes/s")
  return tuple(links)


# ------------------------------------------------------------------ loading


def _folder() -> Any:
  """The built-in profiles' folder (a Traversable: a directory, or inside a zip)."""
  return importlib.resources.files(_PACKAGE).joinpath(_FOLDER)


def builtin_names() -> list[str]:
  """The built-in profiles' names, sorted (``load_hardware`` takes each)."""
  return sorted(entry.name[:-len(_SUFFIX)] for entry in _folder().iterdir()
                if entry.name.endswith(_SUFFIX))


def load_hardware(name_or_path: Union[str, os.PathLike]) -> Hardware:
  """A hardware profile: a built-in one by name, or a user's YAML file by path.

  Args:
    name_or_path: a name from `builtin_names` (``"a100-80g"``), or the path of a
      YAML file of the same form (module doc).

  Returns:
    The `Hardware`.

  Raises:
    ArgumentError: naming ``--hardware`` and listing the built-in names, for a name
      that is neither a built-in profile nor an existing file.
    ConfigError: naming the file and the field (``links[1].bandwidth: missing``),
      for a file with a field missing, unknown, out of range or uncited (a built-in
      one), or not YAML; a `ConfigTypeError` (also a ``TypeError``) for a field of
      the wrong type.

  Example:
    >>> from mpscale.trainer.planning.hardware import load_hardware
    >>> a100 = load_hardware("a100-80g")
    >>> a100.peak("bfloat16"), [link.name for link in a100.links]
    (312000000000000.0, ['nvlink3', 'infiniband-hdr'])
    >>> round(a100.peak("bfloat16") / a100.hbm_bandwidth)  # FLOPs a byte to keep up
    153
  """
  text = os.fspath(name_or_path)
  names = builtin_names()
  if text in names:
    entry = _folder().joinpath(text + _SUFFIX)
    source = f"{_PACKAGE.replace('.', '/')}/{_FOLDER}/{text}{_SUFFIX}"
    return _read(entry.read_text(encoding="utf-8"), source, text, cited=True)
  if os.path.isfile(text):
    with open(text, encoding="utf-8") as f:
      content = f.read()
    stem = os.path.splitext(os.path.basename(text))[0]
    return _read(content, text, stem, cited=False)
  close = difflib.get_close_matches(text, names, n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  what = ("no such file" if os.sep in text or text.endswith((".yaml", ".yml"))
          else "unknown hardware profile")
  raise validation.fail("--hardware", f": {what} {text!r}{hint}; the built-in "
                        f"profiles are {', '.join(names)}, or give the path of a "
                        "YAML file of the same form")


def _read(text: str, source: str, stem: str, cited: bool) -> Hardware:
  """The `Hardware` a file's ``text`` describes (``source`` names it in errors)."""
  raw = parse_yaml(text, source)
  reader = _Reader(source, cited)
  try:
    return reader.hardware(raw, stem)
  except validation.ArgumentError as e:
    cls = ConfigTypeError if isinstance(e, TypeError) else ConfigError
    raise cls(f"{source}: {e}", e.names) from None


class _Reader:
  """Reads one file's parsed YAML into a `Hardware`, every error naming the file and
  the field; in a ``cited`` (built-in) file every number must carry its origin."""

  def __init__(self, source: str, cited: bool):
    self.source = source
    self.cited = cited
    self.source_keys: tuple[str, ...] = ()
    self.assumed: list[str] = []

  def fail(self, key: str, message: str, cls: type = ConfigError) -> ConfigError:
    return cls(f"{self.source}: {key}: {message}", (key,))

  def mapping(self, key: str, raw: Any, allowed: Sequence[str],
              required: Sequence[str] = ()) -> Mapping:
    """``raw`` if a mapping with only ``allowed`` keys and every ``required`` one
    (the config schema's reader, `mpscale.trainer.config.schema.read_mapping`)."""
    try:
      return schema.read_mapping(raw, key, allowed, required)
    except ConfigError as e:
      raise type(e)(f"{self.source}: {e}", e.keys) from None

  def hardware(self, raw: Any, stem: str) -> Hardware:
    raw = self.mapping("", raw, _TOP_KEYS, _REQUIRED_TOP)
    sources = self.sources(raw.get("sources"))
    name = raw.get("name", stem)
    if self.cited and name != stem:
      raise self.fail("name", f"{name!r} differs from the file's name {stem!r}")
    peaks = raw["peak_flops"]
    if not isinstance(peaks, Mapping):
      raise self.fail("peak_flops", "expected a mapping of dtype name to FLOP/s, "
                      f"got {type(peaks).__name__}", ConfigTypeError)
    links = raw["links"]
    if not isinstance(links, list):
      raise self.fail("links", f"expected a list of links, got "
                      f"{type(links).__name__}", ConfigTypeError)
    return Hardware(
        name=name, description=raw.get("description", ""),
        peak_flops={k: self.number(f"peak_flops.{k}", v) for k, v in peaks.items()},
        hbm_bandwidth=self.number("hbm_bandwidth", raw["hbm_bandwidth"]),
        hbm_bytes=self.number("hbm_bytes", raw["hbm_bytes"]),
        host_bandwidth=(None if raw.get("host_bandwidth") is None
                        else self.number("host_bandwidth", raw["host_bandwidth"])),
        devices_per_node=self.number("devices_per_node", raw["devices_per_node"]),
        links=tuple(self.link(i, link) for i, link in enumerate(links)),
        **self.efficiencies(raw), sources=sources, assumed=tuple(self.assumed),
        compile_target=self.compile_target(raw.get("compile_target")))

  def compile_target(self, raw: Any) -> Optional[str]:
    """``compile_target``, checked (`mpscale.trainer.planning.targets.parse`)."""
    if raw is None:
      return None
    try:
      targets.parse(raw)
    except targets.CompileTargetError as e:
      raise self.fail("compile_target", e.reason) from None
    return raw

  def efficiencies(self, raw: Mapping) -> dict[str, Any]:
    """``matmul_efficiency`` and ``memory_efficiency``: the file's, else
    `DEFAULT_EFFICIENCY`'s (then listed as assumed)."""
    out = {}
    for field, default in DEFAULT_EFFICIENCY.items():
      if field in raw:
        out[field] = self.number(field, raw[field])
      else:
        out[field] = default
        self.assumed.append(field)
    return out

  def sources(self, raw: Any) -> tuple[str, ...]:
    """The ``sources:`` mapping (key -> title and url) as ``"title <url>"`` strings;
    its keys are what numbers cite."""
    if raw is None:
      return ()
    if not isinstance(raw, Mapping):
      raise self.fail("sources", "expected a mapping of key to {title, url}, got "
                      f"{type(raw).__name__}", ConfigTypeError)
    out = []
    for key, entry in raw.items():
      entry = self.mapping(f"sources.{key}", entry, _SOURCE_KEYS, _SOURCE_KEYS)
      for field in _SOURCE_KEYS:
        if not isinstance(entry[field], str) or not entry[field].strip():
          raise self.fail(f"sources.{key}.{field}", "expected a non-empty string, "
                          f"got {entry[field]!r}", ConfigTypeError)
      out.append(f"{entry['title']} <{entry['url']}>")
    self.source_keys = tuple(map(str, raw))
    return tuple(out)

  def link(self, i: int, raw: Any) -> Link:
    key = f"links[{i}]"
    raw = self.mapping(key, raw, _LINK_KEYS, _LINK_KEYS)
    try:
      return Link(name=raw["name"], span=raw["span"],
                  bandwidth=self.number(f"{key}.bandwidth", raw["bandwidth"]),
                  latency=self.number(f"{key}.latency", raw["latency"]))
    except validation.ArgumentError as e:
      raise e.renamed(lambda n: f"{key}.{n}") from None

  def number(self, key: str, raw: Any) -> Any:
    """A number's value (checked by the dataclass): ``raw`` itself, or its
    ``value`` when it is a mapping that cites ``sources`` or is ``assumed``."""
    if not isinstance(raw, Mapping):
      if self.cited:
        raise self.fail(key, "uncited: write {value: ..., sources: [...]} or "
                        "{value: ..., assumed: true, reason: ...}")
      return raw
    raw = self.mapping(key, raw, _NUMBER_KEYS, ("value",))
    cites = raw.get("sources", [])
    if not isinstance(cites, list):
      raise self.fail(f"{key}.sources", "expected a list of keys of the file's "
                      f"sources, got {type(cites).__name__}", ConfigTypeError)
    for j, cite in enumerate(cites):
      if cite not in self.source_keys:
        known = ", ".join(self.source_keys) or "none"
        raise self.fail(f"{key}.sources[{j}]", f"{cite!r} is not a key of the "
                        f"file's sources ({known})")
    for field in ("reason", "note"):
      if field in raw and not isinstance(raw[field], str):
        raise self.fail(f"{key}.{field}", f"expected a string, got "
                        f"{type(raw[field]).__name__}", ConfigTypeError)
    assumed = raw.get("assumed", False)
    if not isinstance(assumed, bool):
      raise self.fail(f"{key}.assumed", f"expected true or false, got {assumed!r}",
                      ConfigTypeError)
    if assumed and not raw.get("reason", "").strip():
      raise self.fail(f"{key}.reason", "missing: an assumed figure says why")
    if self.cited and not cites and not assumed:
      raise self.fail(key, "uncited: give sources, or assumed: true and a reason")
    if assumed:
      self.assumed.append(key)
    return raw["value"]
