"""Planning a run before it starts: memory, time and the layout to choose.

- `hardware`: the hardware profiles (``profiles/*.yaml``: peaks, memory, links, and
  the compiler a plan reads);
- `targets`: that compiler: the target GPU's own (XLA's CUDA compiler, from the
  specs in ``target_specs/``, no GPU needed) when installed, else the CPU's;
- `hlo`: reading a compiled program's HLO text: its collectives with their bytes,
  the FLOPs of its products, kernels, loops by their trip counts (no JAX needed);
- `step_time`: a step's time from its FLOPs, bytes and collectives on a profile;
- `compiled`: `plan` compiles the step from shapes and reads its program;
- `analytic`: a layout's step priced from shapes alone (no compile), which orders
  the search's layouts;
- `search`: ranks the layouts that fit (``mpscale plan --search``): all from
  shapes, the leading ones compiled.

May import: `config`, `data`, `models`, `runs`.
"""
