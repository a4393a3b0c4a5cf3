"""What a run reads: text, token corpora, and the loader that batches them.

- `text`: the embedded corpus or a text file, as byte tokens (`TextData`);
- `batch_sizes`: the global batch size of each step (Megatron's ramp-up), counted
  in samples;
- `loader`: a `grain` loader whose position is checkpointed;
- `token_files`: token files on disk (Megatron's indexed datasets, flat token files);
- `token_datasets`: GPT samples and blends drawn from them;
- `tokenizing`: ``mpscale tokenize``, and the cached corpus a config may name;
- `corpora`: the token corpus a ``data:`` section names, as a run's data.

May import: `config.schema`, `runs.progress`.
"""
