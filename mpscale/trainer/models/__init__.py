"""The models a run trains.

- `lm`: the built-in `TinyLM` (GPT-2's block, initialization and loss);
- `user`: a user's Flax NNX, linen or plain model as a `Model`, and the
  ``"module:attribute"`` names a config gives for them.

May import: nothing of the trainer.
"""
