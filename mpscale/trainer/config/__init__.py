"""A run's config: from YAML to typed values, checked, and built into the run's pieces.

- `errors`: `ConfigError`, which names the keys at fault, and the one place where a
  constructor's error is renamed to the config keys that fed it (`errors.keyed`);
- `schema`: the typed config (`RunConfig` and its sections) and its YAML reader;
- `build`: from a config to the policy, optimizer, mesh, model and train step; the
  same code checks a config, run on shapes;
- `load`: `load_config` reads a file (with overrides) and checks it.

May import: `models`, `data`. `errors` and `schema` import nothing else of the
trainer, and every room may import them.
"""
