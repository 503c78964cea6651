"""The call path: one bucketed `generate` call (`generation.generate`), a module per step, in the order it runs.

Resolve (`resolved.py`), check support (`hooks.check_upstream`), decide the padding (`decision.py`, over the facts of
`padding_side.py` and the model assumptions of `side_assumptions.py`), plan it (`plan.py`), run upstream `generate`
hooked (`hooks.py`, declared with `hook_registry.py`; `views.py`, `prefill_right.py`; the graphs, `budget.py`), and
strip the padding (`views.strip_output`). The cache's length, windows and record are `kvcache/`, below this subpackage.
"""
