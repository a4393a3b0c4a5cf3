"""Tests for mpscale.validation: every check names the argument it was given."""

import math
import pickle

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
from mpscale import validation


@pytest.mark.parametrize("check, args, value, error", [
    (validation.real, (), "1", TypeError),
    (validation.real, (), True, TypeError),
    (validation.real, (), math.nan, ValueError),
    (validation.positive_float, (), 0.0, ValueError),
    (validation.positive_float, (), math.inf, ValueError),
    (validation.non_negative_float, (), -1e-9, ValueError),
    (validation.float_in, (0.0, 1.0), 1.5, ValueError),
    (validation.integer, (0,), -1, ValueError),
    (validation.integer, (0,), 2.0, TypeError),
    (validation.positive_int, (), 0, ValueError),
    (validation.positive_int, (), True, TypeError),
    (validation.boolean, (), 1, TypeError),
    (validation.one_of, (("a", "b"),), "c", ValueError),
    (validation.norm_groups, (), 0, ValueError),
    (validation.norm_groups, (), "layer", TypeError),
    (validation.axis_name, (), 3, TypeError),
    (validation.transformation, (), "adam", TypeError),
    (validation.function, (), 3, TypeError),
])
def test_bad_values_raise_naming_the_argument(check, args, value, error):
  with pytest.raises(error, match=r"^the_arg"):
    check("the_arg", value, *args)


def test_good_values_come_back_converted():
  assert validation.real("x", np.float32(0.5)) == 0.5
  assert isinstance(validation.positive_float("x", 2), float)
  assert validation.positive_float("x", math.inf, allow_inf=True) == math.inf
  assert validation.integer("x", np.int64(3), 0) == 3
  assert validation.boolean("x", np.bool_(True)) is True
  assert validation.norm_groups("x", np.int32(2)) == 2
  assert validation.axis_name("x", ("data", "fsdp")) == ("data", "fsdp")
  assert validation.floats("eps", [1, 2, 3], 3, validation.positive_float) == (1.0, 2.0,
                                                                              3.0)


def test_intervals_respect_open_and_closed_ends():
  assert validation.float_in("x", 0.0, 0.0, 1.0) == 0.0
  with pytest.raises(ValueError, match=r"x must be finite and in \(0, 1\)"):
    validation.float_in("x", 0.0, 0.0, 1.0, low_open=True, high_open=True)
  with pytest.raises(ValueError, match=r"x must be finite and > 1"):
    validation.float_in("x", 1.0, 1.0, low_open=True)


def test_floats_names_the_element_at_fault():
  with pytest.raises(ValueError, match=r"eps\[1\]"):
    validation.floats("eps", (1.0, 0.0, 1.0), 3, validation.positive_float)
  with pytest.raises(ValueError, match="eps must be 3 floats"):
    validation.floats("eps", (1.0,), 3)


def test_scalar_or_schedule_takes_schedules_and_injected_arrays_unchecked():
  schedule = optax.constant_schedule(0.1)
  assert validation.scalar_or_schedule("lr", schedule, validation.positive_float) is (
      schedule)
  injected = jnp.asarray(-1.0)  # a traced value cannot be checked, so none is
  assert validation.scalar_or_schedule("lr", injected,
                                       validation.positive_float) is injected
  with pytest.raises(TypeError, match="lr"):
    validation.scalar_or_schedule("lr", jnp.ones(3), validation.positive_float)
  with pytest.raises(ValueError, match="lr"):
    validation.scalar_or_schedule("lr", -1.0, validation.positive_float)


def test_transformation_adds_extra_args_support():
  tx = validation.transformation("inner", optax.sgd(0.1))
  assert isinstance(tx, optax.GradientTransformationExtraArgs)


def test_errors_hold_the_names_they_speak_of_apart_from_the_text():
  with pytest.raises(validation.ArgumentTypeError) as err:
    validation.floats("eps", (1e-30, "x", 1.0), 3, validation.positive_float)
  e = err.value
  assert isinstance(e, TypeError) and isinstance(e, ValueError)
  assert e.names == ("eps[1]",) and e.name == "eps[1]"
  renamed = e.renamed(lambda n: "optimizer.came." + n)
  assert type(renamed) is validation.ArgumentTypeError
  assert str(renamed) == "optimizer.came.eps[1] must be a float; got str"


def test_renaming_rewrites_the_names_only_never_the_text():
  # The text repeats the name and holds braces; only the {0}/{1} slots change.
  e = validation.ArgumentError(("x", "y"), "{0} must differ from {1}; x is " +
                               validation.literal("{x}"))
  assert str(e) == "x must differ from y; x is {x}"
  renamed = e.renamed({"x": "a.x", "y": "b.y"}.get)
  assert str(renamed) == "a.x must differ from b.y; x is {x}"
  assert renamed.names == ("a.x", "b.y") and renamed.template == e.template
  back = pickle.loads(pickle.dumps(renamed))
  assert type(back) is validation.ArgumentError and back.names == renamed.names
  assert str(back) == str(renamed)


@pytest.mark.parametrize("build, names", [
    (lambda: mpscale.dynamic_loss_scale(optax.sgd(0.1), min_scale=8.0, max_scale=4.0),
     ("min_scale", "max_scale")),
    (lambda: mpscale.came(1e-3, relative_step=True), ("learning_rate", "relative_step")),
    (lambda: mpscale.came(None), ("learning_rate", "relative_step")),
    (lambda: mpscale.came(1e-3, warmup_init=True), ("warmup_init", "relative_step")),
    (lambda: mpscale.scale_by_came(decay_rate=None), ("decay_rate", "beta2")),
    (lambda: mpscale.lr_schedule(1.0, warmup_steps=10, decay_steps=10),
     ("warmup_steps", "decay_steps")),
    (lambda: mpscale.lr_schedule(1.0, warmup_steps=1, warmup_fraction=0.1,
                                 decay_steps=10), ("warmup_steps", "warmup_fraction")),
    (lambda: mpscale.weight_decay_schedule(0.1, 0.2, 10, style="constant"),
     ("style", "start", "end")),
])
def test_constructors_name_every_argument_a_rule_spans(build, names):
  with pytest.raises(mpscale.ArgumentError) as err:
    build()
  assert err.value.names == names
  for name in names:
    assert name in str(err.value)
