"""The XLA flags of the tests' quick CPU compile, in one place (no jax import here:
tests/conftest.py reads them before jax is imported). conftest.py's docstring says
what they do and why; the processes some tests start (``mpscale train``, ``mpscale
plan``) take them too."""

FLAGS = ("--xla_backend_optimization_level=0"
         " --xla_cpu_use_fusion_emitters=false")
"""LLVM's optimizations off and XLA's older, LLVM-IR fusion emitters."""
