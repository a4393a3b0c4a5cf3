"""Peak host memory of loading a sharded Hugging Face checkpoint into FSDP 8.

A random Llama checkpoint (float32, sharded at 100 MB) is written with
`mpscale.trainer.hf.save`; a fresh process (8 fake CPU devices, so the devices'
arrays are host memory too) then loads it with ``hf.load(path, mesh=fsdp 8)``. The
ratio printed is the process's peak resident memory over its resident memory before
the load, both minus nothing else, against the checkpoint's bytes: 1.0 is the
parameters alone; the target is <= 1.25 (no host holding the model twice).

  python benchmarks/bench_hf_load.py            # ~0.4 GB checkpoint, ~1 min on 2 cores
  python benchmarks/bench_hf_load.py --layers 16
"""

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import os, resource, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from mpscale.trainer import hf

def rss():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

def peak():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
jax.numpy.zeros(8).block_until_ready()
with open("/proc/self/clear_refs", "w") as f:  # reset the peak to the current size
  f.write("5")
before = rss()
model, params = hf.load(sys.argv[1], seq_len=256, mesh=mesh)
jax.block_until_ready(params)
print(before, peak(), rss())
"""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=1024)
  args = parser.parse_args()

  import jax  # noqa: PLC0415
  from mpscale.trainer import hf  # noqa: PLC0415
  from mpscale.trainer.models.lm import TinyLM  # noqa: PLC0415

  d = args.width
  model = TinyLM(vocab_size=32000, d_model=d, num_heads=d // 64, num_kv_heads=d // 256,
                 num_layers=args.layers, d_ff=4 * d, seq_len=256, family="llama")
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "ckpt")
    params = model.init(jax.random.key(0))
    hf.save(model, params, path, shard_bytes=100 * 2**20)
    del params
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(path, f)) for f in shards)
    out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True,
                         text=True, check=True).stdout.split()
    before, peak, after = map(int, out[-3:])
  print(f"checkpoint {size / 1e9:.2f} GB in {len(shards)} shards; resident before "
        f"the load {before / 1e9:.2f} GB")
  print(f"peak growth / checkpoint bytes: {(peak - before) / size:.2f} "
        f"(target <= 1.25); after the load: {(after - before) / size:.2f}")


if __name__ == "__main__":
  main()
