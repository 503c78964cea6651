"""The coupling to transformers and torch: every private name the package touches, the version gate, the self-test.

The package's bottom floor: it imports nothing of the package outside `upstream/`, and no module outside it names a
private torch or transformers name (`tests/generation/test_imports.py` checks both). Nothing is re-exported here:
import the module you need (`versions`, `transformers_api`, `candidates`, `transformers_serve`, `torch_api`,
`checks`, `gate`, `selftest`), each of which says what it holds.
"""
