#!/usr/bin/env bash
# Reproduce benchmarks/README.md's GPU table in one command: every benchmark on the
# first accelerator, each log (and the compiled HLO of the optimizer steps) under DIR.
#
#   bash benchmarks/run_gpu.sh [DIR]          # DIR defaults to gpu_results/
#
# Needs jax with its CUDA (or TPU) plugin, optax, flax, chex, PyYAML and orbax; torch is
# optional (came-pytorch comparisons run on the CPU, so they are skipped here). Each
# benchmark has its own time limit (seconds, env T_<NAME>), so one that hangs cannot
# take the others down; ONLY="came precision" runs just those. About 6 minutes on one H100.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mkdir -p "${1:-gpu_results}" && cd "${1:-gpu_results}" && pwd)"
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$here"

python - <<'EOF' 2>&1 | tee "$out/env.txt"
import jax, jaxlib, optax, flax, chex, platform
d = jax.devices()[0]
print(f"device {d.platform} {d.device_kind} x{jax.device_count()}; jax {jax.__version__} "
      f"jaxlib {jaxlib.__version__} optax {optax.__version__} flax {flax.__version__} "
      f"chex {chex.__version__} python {platform.python_version()}")
EOF

bench() {  # bench NAME DEFAULT_LIMIT_S SCRIPT ARGS...
  local name=$1 limit=$2; shift 2
  local var="T_${name^^}"
  [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]] && return 0
  echo "== $name: python $* (limit ${!var:-$limit} s)"
  timeout "${!var:-$limit}" python "$@" 2>&1 | tee "$out/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]}"
}

bench loss_scale 130 bench_loss_scale.py --hlo --dump-hlo "$out/hlo" --rounds 15 --reps 5
bench came 100 bench_came.py --no-torch --hlo --dump-hlo "$out/hlo" --rounds 10 --reps 5
bench train_step 100 bench_train_step.py
bench train_step_large 100 bench_train_step.py --width 4096 --batch 2048 --rounds 8
bench precision 150 bench_precision.py
bench pipeline 60 bench_pipeline.py --stages 1
