"""The coupling to transformers and torch: every private name the package touches, the version gate, the self-test.

The package's bottom floor. Its modules import nothing of the package outside `upstream/`, and no module outside it
names a private torch or transformers name (`tests/generation/test_imports.py` checks both). Import the module you
need (`from ..upstream import torch_api`); nothing is re-exported here.

- `versions.py`: the installed transformers and torch versions, the ranges CI tests (`TESTED_TRANSFORMERS`,
  `TESTED_TORCH`), and the behaviours that change with the version.
- `transformers_api.py`: every private transformers name the package reads or changes (the hooked `generate`'s
  helpers, static caches and their layers, masking, tensor parallelism, the output-capture registry).
- `candidates.py`: upstream's candidate generators (assisted, prompt-lookup and other speculative decoding): which
  drafters padding would change, and the assistant's processor merge.
- `transformers_serve.py`: `transformers serve`'s command, and where it loads the models it serves.
- `torch_api.py`: every private torch name (dynamo's configuration and caches, the objects `torch.compile` makes,
  inductor, the ahead-of-time compile).
- `checks.py`: what the package needs of both, checked: `upstream_problems` (the hook targets, the private names),
  `torch_problems`, `aot_compile_problem`, `sliding_layer_problem`, and `CACHED_CHECKS`, those cached per process.
- `gate.py`: the version gate, `check_upstream`: the checks' verdict per model class, and outside the tested ranges
  (`is_tested_range`) the self-test's, once per process.
- `selftest.py`: `self_test`, bucketed `generate` against upstream's on a tiny model.
"""
