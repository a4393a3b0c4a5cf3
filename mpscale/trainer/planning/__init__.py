"""Planning a run before it starts: memory, time and the layout to choose.

- `hardware`: the hardware profiles (``profiles/*.yaml``: peaks, memory, links);
- `step_time`: a step's time from its FLOPs, bytes and collectives on a profile;
- `compiled`: `plan` compiles the step from shapes and reads its program;
- `search`: ranks the layouts that fit (``mpscale plan --search``).

May import: `config`, `data`, `models`, `runs`.
"""
