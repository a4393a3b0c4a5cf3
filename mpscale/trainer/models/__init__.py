"""The models a run trains.

- `lm`: the built-in `TinyLM` (GPT-2's block, or the Llama block of Llama,
  Mistral and Qwen; initialization and loss);
- `families`: what each family changes (RoPE and its scaling, RMSNorm, Qwen's
  biases and q/k norms, Mistral's window);
- `user`: a user's Flax NNX, linen or plain model as a `Model`, and the
  ``"module:attribute"`` names a config gives for them.

May import: nothing of the trainer.
"""
