"""Hardware profiles (`mpscale.trainer.planning.hardware`): the built-ins load, cite every
number and match their datasheets; a user's file loads; mistakes name the field."""

import math
import pathlib
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from mpscale import validation
from mpscale.trainer.planning import hardware
from mpscale.trainer.planning.hardware import Hardware, Link, builtin_names, load_hardware
from mpscale.trainer.config.schema import ConfigError, ConfigTypeError

USER_FILE = """\
name: my-gpu
description: a made-up accelerator
peak_flops:
  bfloat16: 1.0e15
  float32: 5e13
hbm_bandwidth: 3e12
hbm_bytes: 96e9
devices_per_node: 4
links:
  - {name: fast, span: node, bandwidth: 4e11, latency: 2e-6}
  - name: slow
    span: nodes
    bandwidth: {value: 5e10, sources: [spec]}
    latency: {value: 1e-5, assumed: true, reason: a guess}
sources:
  spec: {title: My GPU datasheet, url: https://example.com/my-gpu.pdf}
"""


def _write(tmp_path, text, name="gpu.yaml"):
  path = tmp_path / name
  path.write_text(textwrap.dedent(text))
  return str(path)


def _numbers(raw, key=""):
  """Every number entry of a parsed profile: ``(key, entry)``, where a number is
  written as a mapping with a ``value``."""
  if isinstance(raw, dict) and "value" in raw:
    yield key, raw
  elif isinstance(raw, dict):
    for k, v in raw.items():
      if k != "sources" or key:
        yield from _numbers(v, f"{key}.{k}" if key else k)
  elif isinstance(raw, list):
    for i, v in enumerate(raw):
      yield from _numbers(v, f"{key}[{i}]")


# ------------------------------------------------------------------ the built-ins


def test_the_builtin_profiles_are_found():
  assert {"a100-80g", "h100-80g", "tpu-v4"} <= set(builtin_names())
  assert builtin_names() == sorted(builtin_names())


@pytest.mark.parametrize("name", builtin_names())
def test_every_builtin_loads_with_positive_fields_and_links_fastest_first(name):
  hw = load_hardware(name)
  assert hw.name == name and hw.description
  assert hw.peak_flops and all(v > 0 and math.isfinite(v)
                               for v in hw.peak_flops.values())
  assert hw.hbm_bandwidth > 0 and hw.hbm_bytes > 0 and hw.devices_per_node >= 1
  assert hw.links and all(isinstance(link, Link) for link in hw.links)
  assert all(link.bandwidth > 0 and link.latency > 0 for link in hw.links)
  bandwidths = [link.bandwidth for link in hw.links]
  assert bandwidths == sorted(bandwidths, reverse=True)
  assert all(link.span in hardware.SPANS for link in hw.links)
  assert hw.sources and all("<https://" in s for s in hw.sources)
  # Memory is the fastest level; every link is slower than it.
  assert hw.hbm_bandwidth > hw.links[0].bandwidth


@pytest.mark.parametrize("name", builtin_names())
def test_every_builtin_number_is_cited_or_assumed_with_a_reason(name):
  path = hardware._folder().joinpath(name + ".yaml")
  text = path.read_text()
  assert text.startswith("# "), "a comment header explaining the units"
  raw = yaml.safe_load(text)
  entries = dict(_numbers(raw))
  expected = ({f"peak_flops.{k}" for k in raw["peak_flops"]}
              | {"hbm_bandwidth", "hbm_bytes", "devices_per_node",
                 "matmul_efficiency", "memory_efficiency"}
              | ({"host_bandwidth"} if "host_bandwidth" in raw else set())
              | {f"links[{i}].{f}" for i in range(len(raw["links"]))
                 for f in ("bandwidth", "latency")})
  assert set(entries) == expected
  for key, entry in entries.items():
    assert entry.get("sources") or (entry.get("assumed") and entry.get("reason")), key
    assert set(entry.get("sources", ())) <= set(raw["sources"]), key
  assert all(set(s) == {"title", "url"} and s["url"].startswith("https://")
             for s in raw["sources"].values())
  assumed = {k for k, e in entries.items() if e.get("assumed")}
  assert set(load_hardware(name).assumed) == assumed


def test_the_a100_matches_its_datasheet():
  # NVIDIA A100 datasheet, 80GB SXM: BF16/FP16 Tensor Core 312 TFLOPS, TF32 156,
  # FP32 19.5, 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s (both ways); DGX A100: 8
  # GPUs, 200 Gb/s HDR InfiniBand per GPU.
  hw = load_hardware("a100-80g")
  assert hw.peak("bfloat16") == 312e12 == hw.peak("float16")
  assert hw.peak("tf32") == 156e12 and hw.peak("float32") == 19.5e12
  assert hw.hbm_bandwidth == 2.039e12
  assert 79e9 <= hw.hbm_bytes <= 80 * 2**30
  assert hw.devices_per_node == 8
  assert [link.bandwidth for link in hw.links] == [600e9 / 2, 200e9 / 8]
  assert [link.span for link in hw.links] == ["node", "nodes"]
  assert hw.assumed == ("memory_efficiency",)
  assert hw.matmul_efficiency == pytest.approx(271.2 / 312, abs=1e-3)  # MAMF


def test_the_h100_matches_its_datasheet():
  # NVIDIA H100 SXM: BF16 1,979 TFLOPS with sparsity (989.4 dense), TF32 989 with
  # sparsity, FP32 67; 80 GB at 3.35 TB/s; NVLink 900 GB/s; NDR 400 Gb/s per GPU.
  hw = load_hardware("h100-80g")
  assert hw.peak("bfloat16") == pytest.approx(1979e12 / 2, rel=1e-3)
  assert hw.peak("tf32") == pytest.approx(989e12 / 2, rel=1e-3)
  assert hw.peak("float32") == pytest.approx(67e12, rel=1e-2)
  assert hw.hbm_bandwidth == 3.35e12 and hw.hbm_bytes == 80e9
  assert [link.bandwidth for link in hw.links] == [900e9 / 2, 400e9 / 8]


def test_the_tpu_v4_matches_the_cloud_docs():
  # Cloud TPU v4: 275 TFLOPS bf16, 32 GiB HBM2 at 1200 GBps, 4 chips a host.
  hw = load_hardware("tpu-v4")
  assert hw.peak_flops == {"bfloat16": 275e12}
  assert hw.hbm_bytes == 32 * 2**30 and hw.hbm_bandwidth == 1.2e12
  assert hw.devices_per_node == 4
  assert [link.span for link in hw.links] == ["slice", "slices"]
  assert "links[0].latency" in hw.assumed


def test_peak_takes_a_name_or_a_dtype_and_names_what_it_lacks():
  hw = load_hardware("a100-80g")
  assert hw.peak(jnp.bfloat16) == hw.peak("bfloat16")
  assert hw.peak(np.float32) == hw.peak("float32") == hw.peak(jnp.dtype("float32"))
  with pytest.raises(validation.ArgumentError, match=r"dtype: a100-80g lists no "
                     r"peak for 'float64'; it lists bfloat16, float16, tf32"):
    hw.peak("float64")
  with pytest.raises(validation.ArgumentError, match="lists no peak for 'float32'"):
    load_hardware("tpu-v4").peak(jnp.float32)
  with pytest.raises(TypeError, match="dtype must be a dtype"):
    hw.peak(object())


# ------------------------------------------------------------------ a user's file


def test_a_users_file_loads(tmp_path):
  hw = load_hardware(_write(tmp_path, USER_FILE))
  assert hw == Hardware(
      name="my-gpu", description="a made-up accelerator",
      peak_flops={"bfloat16": 1e15, "float32": 5e13}, hbm_bandwidth=3e12,
      hbm_bytes=96e9, devices_per_node=4,
      links=(Link("fast", 4e11, 2e-6, "node"), Link("slow", 5e10, 1e-5, "nodes")),
      sources=("My GPU datasheet <https://example.com/my-gpu.pdf>",),
      assumed=("links[1].latency", "matmul_efficiency", "memory_efficiency"))
  # without efficiencies of its own, a profile gets the defaults, named as assumed
  assert (hw.matmul_efficiency, hw.memory_efficiency) == (0.8, 0.8)


def test_a_users_file_takes_its_name_from_the_file_and_a_path_object(tmp_path):
  text = USER_FILE.replace("name: my-gpu\n", "").replace(
      "description: a made-up accelerator\n", "")
  hw = load_hardware(pathlib.Path(_write(tmp_path, text, "cluster-b.yaml")))
  assert hw.name == "cluster-b" and hw.description == ""


# ------------------------------------------------------------------ mistakes


def test_an_unknown_name_names_the_flag_and_lists_the_builtins():
  with pytest.raises(ValueError) as info:
    load_hardware("a100")
  err = info.value
  assert isinstance(err, validation.ArgumentError) and err.name == "--hardware"
  message = str(err)
  assert message.startswith("--hardware: unknown hardware profile 'a100'")
  assert "did you mean 'a100-80g'?" in message
  for name in builtin_names():
    assert name in message
  with pytest.raises(validation.ArgumentError, match="--hardware: no such file "
                     "'missing.yaml'.*a100-80g, h100-80g, tpu-v4"):
    load_hardware("missing.yaml")


@pytest.mark.parametrize("edit, key, message", [
    # A field missing: the file and the field, fully qualified.
    (("    bandwidth: {value: 5e10, sources: [spec]}\n", ""), "links[1].bandwidth",
     r"links\[1\]\.bandwidth: missing \(links\[1\] needs name, span, bandwidth, "
     r"latency\)"),
    (("hbm_bytes: 96e9\n", ""), "hbm_bytes", "hbm_bytes: missing"),
    (("  - {name: fast, span: node, bandwidth: 4e11, latency: 2e-6}\n",
      "  - {name: fast, span: node, bandwidth: 4e11}\n"), "links[0].latency",
     r"links\[0\]\.latency: missing"),
    # A value out of range.
    (("bandwidth: 4e11", "bandwidth: -4e11"), "links[0].bandwidth",
     r"links\[0\]\.bandwidth must be positive and finite; got -4e\+11"),
    (("value: 5e10", "value: 0"), "links[1].bandwidth",
     r"links\[1\]\.bandwidth must be positive"),
    (("latency: 2e-6", "latency: -1e-6"), "links[0].latency",
     r"links\[0\]\.latency must be finite and >= 0"),
    (("hbm_bandwidth: 3e12", "hbm_bandwidth: -3e12"), "hbm_bandwidth",
     "hbm_bandwidth must be positive"),
    (("  float32: 5e13", "  float32: -5e13"), "peak_flops.float32",
     "peak_flops.float32 must be positive"),
    (("devices_per_node: 4", "devices_per_node: 0"), "devices_per_node",
     "devices_per_node must be >= 1"),
    (("span: node", "span: rack"), "links[0].span",
     r"links\[0\]\.span must be one of 'node', 'nodes', 'slice', 'slices'"),
    # Links out of order.
    (("value: 5e10", "value: 5e11"), "links[1].bandwidth",
     r"links\[1\]\.bandwidth must not exceed links\[0\]\.bandwidth: links go "
     r"fastest first"),
    # Unknown keys, bad citations, an assumption without a reason.
    (("hbm_bytes:", "hbm_byte:"), "hbm_byte", "hbm_byte: unknown key "
     r"\(did you mean 'hbm_bytes'\?\)"),
    (("sources: [spec]", "sources: [spek]"), "links[1].bandwidth.sources[0]",
     r"'spek' is not a key of the file's sources \(spec\)"),
    ((", reason: a guess", ""), "links[1].latency.reason",
     "an assumed figure says why"),
])
def test_a_bad_file_names_the_file_and_the_field(tmp_path, edit, key, message):
  old, new = edit
  assert old in USER_FILE
  path = _write(tmp_path, USER_FILE.replace(old, new))
  with pytest.raises(ConfigError, match=message) as info:
    load_hardware(path)
  assert str(info.value).startswith(f"{path}: ")
  assert info.value.keys[0] == key
  assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize("edit, key, message", [
    (("bandwidth: 4e11", "bandwidth: fast"), "links[0].bandwidth",
     r"links\[0\]\.bandwidth must be a float; got str"),
    (("devices_per_node: 4", "devices_per_node: 4.5"), "devices_per_node",
     "devices_per_node must be an int; got float"),
    (("name: my-gpu", "name: 7"), "name", "name must be a string; got int"),
    (("hbm_bandwidth: 3e12", "hbm_bandwidth: true"), "hbm_bandwidth",
     "hbm_bandwidth must be a float; got bool"),
    (("peak_flops:\n  bfloat16: 1.0e15\n  float32: 5e13",
      "peak_flops: [1.0e15]"), "peak_flops", "expected a mapping"),
])
def test_a_wrong_type_is_a_type_error_naming_the_field(tmp_path, edit, key,
                                                        message):
  old, new = edit
  assert old in USER_FILE
  path = _write(tmp_path, USER_FILE.replace(old, new))
  with pytest.raises(ConfigTypeError, match=message) as info:
    load_hardware(path)
  assert isinstance(info.value, TypeError) and info.value.keys[0] == key
  assert str(info.value).startswith(f"{path}: ")


def test_invalid_yaml_names_the_file(tmp_path):
  path = _write(tmp_path, "links: [\n")
  with pytest.raises(ConfigError, match=f"{path}: invalid YAML"):
    load_hardware(path)


def test_a_builtin_number_without_a_source_is_refused(monkeypatch, tmp_path):
  # A built-in profile must cite every number; a user's file need not.
  (tmp_path / "mine.yaml").write_text(USER_FILE.replace("name: my-gpu", "name: mine"))
  monkeypatch.setattr(hardware, "_folder", lambda: tmp_path)
  assert builtin_names() == ["mine"]
  with pytest.raises(ConfigError, match=r"profiles/mine.yaml: peak_flops.bfloat16: "
                     "uncited"):
    load_hardware("mine")


def test_the_dataclasses_check_their_fields_by_name():
  link = Link("nvlink", 3e11, 1e-6, "node")
  good = dict(name="x", description="", peak_flops={"bfloat16": 1e14},
              hbm_bandwidth=1e12, hbm_bytes=1e10, devices_per_node=1, links=[link])
  assert Hardware(**good).links == (link,)
  with pytest.raises(validation.ArgumentError, match="bandwidth must be positive"):
    Link("nvlink", -1.0, 1e-6, "node")
  with pytest.raises(validation.ArgumentError, match="links must hold at least one"):
    Hardware(**{**good, "links": []})
  with pytest.raises(TypeError, match=r"links\[0\] must be a Link; got dict"):
    Hardware(**{**good, "links": [{"name": "nvlink"}]})
  with pytest.raises(validation.ArgumentError, match="peak_flops must name at least"):
    Hardware(**{**good, "peak_flops": {}})
