"""A run: its loop, its folder, what it shows, and the processes it spans.

- `loop`: prepare, restore, train (log, evaluate, checkpoint), finish;
- `interrupts`: a Ctrl-C held until the run can stop cleanly;
- `checkpoints`, `metrics_log`, `plots`: what a run writes in its folder;
- `throughput`: the step's FLOPs from its compiled program, and the peak of
  ``train.hardware`` its MFU is taken against;
- `progress`: the progress bar and number formats (imports nothing of the trainer);
- `devices`, `distributed`: one run across devices and processes (hosts);
- `compare`: runs side by side.

May import: `config`, `data`, `models`, and of `planning` its `hlo` and `hardware`
modules (``throughput`` counts FLOPs and reads peaks as a plan does; neither imports
`runs`).
"""
