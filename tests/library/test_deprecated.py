"""0.1's module paths and names still work for one release, each with a warning
(mpscale/_deprecated.py), and give the very objects of their new homes."""

import importlib
import json
import subprocess
import sys
import warnings

import jax.numpy as jnp
import optax
import pytest

import mpscale
from mpscale import _deprecated


_CHECK_OLD_PATHS = """
import importlib, json, sys, warnings
import mpscale
out = {}
for old, home in json.loads(sys.argv[1]).items():
  warnings.simplefilter('error')
  try:
    importlib.import_module(old)
  except DeprecationWarning as e:
    message = str(e)
  else:
    out[old] = 'no warning'
    continue
  warnings.simplefilter('ignore')
  m, new = importlib.import_module(old), importlib.import_module(home)
  same = all(getattr(m, n) is getattr(new, n) for n in dir(new) if not n.startswith('__'))
  out[old] = message if same else 'not the objects of ' + home
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def old_paths():
  """``{old module path: its warning's text, or what went wrong}``, each imported
  first under warnings-as-errors in one fresh interpreter: the warning is given once
  per path and process, and no path imports another's deprecated module."""
  homes = {old: _deprecated.homes(old)[0] for old in sorted(_deprecated.MODULES)}
  result = subprocess.run([sys.executable, "-c", _CHECK_OLD_PATHS, json.dumps(homes)],
                          capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(_deprecated.MODULES))
def test_an_old_module_path_imports_with_a_warning(old, old_paths):
  assert f"the module {old} is deprecated" in old_paths[old], old_paths[old]
  assert "use mpscale." in old_paths[old]


def test_from_mpscale_import_an_old_module_warns_and_gives_its_new_home():
  with pytest.warns(DeprecationWarning, match="mpscale.fp8 is deprecated.*mpscale.precision"):
    from mpscale import fp8  # noqa: F401 - the import is the test
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert fp8.merge_stacked is mpscale.precision.merge_stacked
    assert fp8.fp8_recipe is mpscale.make_fp8_recipe  # a renamed name, through the path


@pytest.mark.parametrize("old, new", sorted(_deprecated.NAMES.items()))
def test_an_old_name_warns_and_is_the_new_one(old, new):
  where, name = new
  with pytest.warns(DeprecationWarning, match=f"mpscale.{old} is deprecated"):
    got = getattr(mpscale, old)
  assert got is getattr(importlib.import_module(where), name)


def test_renamed_names_of_old_modules_answer_under_their_old_module():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import mpscale.norms as norms  # noqa: PLC0415
    import mpscale.parameter_groups as parameter_groups  # noqa: PLC0415
  with pytest.warns(DeprecationWarning, match="Groups is deprecated"):
    assert norms.Groups is mpscale.scaling.NormGroups
  with pytest.warns(DeprecationWarning, match="labels is deprecated"):
    assert parameter_groups.labels is mpscale.optim.param_group_labels


def test_the_old_groups_keyword_warns_and_means_norm_groups():
  params = {"a": jnp.ones(3), "b": {"c": jnp.ones(2)}}
  with pytest.warns(DeprecationWarning, match=r"groups=\.\.\.\) is deprecated"):
    old = mpscale.dynamic_loss_scale(optax.sgd(0.1), groups=lambda p: "all")
  new = mpscale.dynamic_loss_scale(optax.sgd(0.1), norm_groups=lambda p: "all")
  assert set(old.init(params).skip_state.group_norms) == {"all"}
  assert set(new.init(params).skip_state.group_norms) == {"all"}
  with pytest.warns(DeprecationWarning):
    norms, _ = mpscale.group_norms(params, groups=2)
  assert set(norms) == {"a", "b/c"}
  with pytest.raises(TypeError, match="both groups= and norm_groups="):
    mpscale.global_norm_clip(1.0, groups=1, norm_groups=1)


def test_an_unknown_name_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'loss_scale_four'"):
    mpscale.loss_scale_four  # noqa: B018 - the lookup is the test
