"""The call path: one bucketed `generate` call, a module per step, in the order it runs (`generation.generate`).

1. Resolve: `resolved.py` (the call's inputs and its bucket fields, read once into a frozen `ResolvedCall`, and its
   `CallSettings`, read off the generation config upstream's own preparation step makes, once a call), with `kvcache.record.PassedCache` (the cache the call passes).
2. Check support: `hooks.check_upstream` (the version gate, `upstream/gate.py`, given this subpackage's hooks).
3. Decide: `decision.py`, the one decision of how the call is padded (left, right, or unpadded with its reason), one
   table of rows over the call's facts (`padding_side.py`) and what a model's code assumes (`side_assumptions.py`).
4. Plan: `plan.plan_call` makes the frozen `Plan` (`plan.py`): the prompt padded in front, or on the right by the
   `_prefill` hook; the batch padded with dummy rows.
5. Agree across ranks: `distributed.ranks_agree` (above: it is also the user's, for `rank_path`).
6. Run upstream `generate`, hooked: `hooks.py` lists the hooks in one table (`HOOKS`) and installs it; each is
   declared with `hook_registry.hook` where it is written, in `hooks.py`,
   `views.py` (what reads token content sees the ids without padding) and `prefill_right.py` (the right-padded
   prefill); what the call learns as it runs goes to `plan.run` (`plan.CallRun`). The cache (`kvcache/`, below this
   subpackage): its length (`sizing.py`), the windows its layers read (`windows.py`, with `ring.py` for
   sliding-window layers); the graphs it compiles (`budget.py`).
7. Mark the cache: `kvcache.record.record_call`.
8. Strip: `views.strip_output`, with `kvcache/attention_keys.py` (a static cache's attentions laid out as upstream's
   layers lay them).

The compile tooling (`compile/`: `compiled_calls.py` below this subpackage, `precompile.py`, `archive.py`,
`aot_forward.py`, `aot_key.py` above it), the command line (`cli.py`, `benchmark/`) and the user's API (`config.py`,
`buckets.py`, `patch.py`) sit beside this subpackage.
"""
