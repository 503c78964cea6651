# The one hook registry (`hook_registry.py`): the declarations are what is installed, checked and documented, and a
# hook passes the step's arguments on as upstream passed them, keywords it doesn't know included.

import copy
import re
import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from transformers import GenerationConfig, LlamaForCausalLM, StaticCache

import prefill_buckets
from prefill_buckets.call import hook_registry, hooks
from prefill_buckets.call.hook_registry import _ACTIVE_PLAN, hook, hook_table, make_hooked
from prefill_buckets.call.hooks import HOOKS, hook_targets
from prefill_buckets.state import state_of

from .tiny_models import CACHE, tiny_llama


def run_hooked(target: str, original, model, plan, *args, **kwargs):
    """Calls the hook of `target` around `original`, as if `plan` were the active plan of `model`."""
    token = _ACTIVE_PLAN.set(plan)
    try:
        return make_hooked(HOOKS[target], original, model)(*args, **kwargs)
    finally:
        _ACTIVE_PLAN.reset(token)


class HookRegistryTest(unittest.TestCase):
    def test_docs_list_every_hook(self):
        documented = set()
        for line in hooks.__doc__.splitlines():
            if line.startswith("- "):
                documented.update(re.findall(r"`(\w+)`", line.split(": ")[0]))
        documented -= {"views", "prefill_right"}
        self.assertEqual(documented, set(HOOKS), "hooks.py's docstring lists the declared hooks")

    def test_a_declaration_registers_nothing(self):
        # `@hook` attaches the declaration; only `hook_table` (the one in `hooks.py`) makes a hook installed.
        before = dict(HOOKS)

        @hook("_prepare_generated_length", reads=("generation_config",))
        def another(plan, step):
            return step.call()

        self.assertEqual(HOOKS, before)
        self.assertEqual(another.hook.target, "_prepare_generated_length")
        with self.assertRaisesRegex(RuntimeError, "Two hooks are declared for `_prepare_generated_length`"):
            hook_table(HOOKS["_prepare_generated_length"].body, another)
        with self.assertRaisesRegex(TypeError, "`print` is not declared as a hook"):
            hook_table(print)

    def test_compat_checks_every_declared_target(self):
        # The check reads the declarations: a model class without any one hooked step raises, naming it; one whose
        # step takes none of the parameters its hook declares it reads (and passes none on) raises, naming the first.
        for name, (reads, positional) in hook_targets().items():
            with self.subTest(name):
                missing = type(f"Without{name}", (LlamaForCausalLM,), {name: None})
                with self.assertRaisesRegex(RuntimeError, rf"`Without{name}\.{name}` does not exist"):
                    hooks.check_upstream(missing, generate=prefill_buckets.generate)
                if reads:
                    bare = type(f"Bare{name}", (LlamaForCausalLM,), {name: lambda self: None})
                    with self.assertRaisesRegex(
                        RuntimeError, rf"`Bare{name}\.{name}` takes no parameter `{reads[0]}`"
                    ):
                        hooks.check_upstream(bare, generate=prefill_buckets.generate)

    def test_keywords_the_hook_does_not_know_reach_the_method(self):
        # As if upstream passed `_prepare_generated_length` a new keyword: the hook changes what it reads and passes
        # the rest on, by keyword, as upstream passed them.
        model = tiny_llama()
        seen = {}

        def original(**kwargs):
            seen.update(kwargs)
            return GenerationConfig(max_length=20, min_length=3)

        plan = SimpleNamespace(model=model, added_id_columns=2, added_positions=2)
        config = run_hooked(
            "_prepare_generated_length",
            original,
            model,
            plan,
            generation_config=GenerationConfig(),
            has_default_max_length=True,
            has_default_min_length=True,
            model_input_name="input_ids",
            inputs_tensor=torch.zeros(1, 7, dtype=torch.long),
            input_ids_length=7,
            a_new_keyword="passed on",
        )
        self.assertEqual(seen["a_new_keyword"], "passed on")
        self.assertEqual(seen["input_ids_length"], 5)
        self.assertEqual(tuple(seen["inputs_tensor"].shape), (1, 5))
        self.assertEqual((config.max_length, config.min_length), (22, 5))

    def test_positional_arguments_stay_positional(self):
        model = tiny_llama()
        seen = {}

        def original(*args, **kwargs):
            seen.update(args=args, kwargs=kwargs)
            return model.__call__

        plan = SimpleNamespace(model=model)
        compiled = run_hooked("get_compiled_call", original, model, plan, None, a_new_keyword=1)
        self.assertEqual(seen, {"args": (None,), "kwargs": {"a_new_keyword": 1}})
        self.assertEqual(compiled, model.__call__)

    def test_an_instance_override_raises_before_anything_is_installed(self):
        model = tiny_llama()
        object.__setattr__(model, "_get_logits_processor", model._get_logits_processor)
        with self.assertRaisesRegex(RuntimeError, "has `_get_logits_processor` set on the instance"):
            prefill_buckets.generate(model, torch.ones(1, 5, dtype=torch.long), max_new_tokens=2, prefill_buckets=[8])
        self.assertEqual(state_of(model).calls_in_flight, 0)
        self.assertFalse(any(name in model.__dict__ for name in HOOKS if name != "_get_logits_processor"))


class HookedMethodsTest(unittest.TestCase):
    # The hooked methods are made once per model, and a deep copy of a model (whose state holds its original's) runs
    # its own methods, not its original's.
    def call(self, model):
        prompt = torch.arange(5, 12).unsqueeze(0)
        return prefill_buckets.generate(
            model, prompt, max_new_tokens=4, do_sample=False, prefill_buckets=[16], cache_implementation="static"
        )

    def test_made_once_per_model(self):
        model = tiny_llama()
        self.call(model)
        with mock.patch.object(hook_registry, "make_hooked", wraps=hook_registry.make_hooked) as made:
            self.call(model)
        self.assertEqual(made.call_count, 0)

    def test_a_deep_copy_runs_its_own_methods(self):
        model = tiny_llama()
        original = self.call(model)
        copied = copy.deepcopy(model)
        with torch.no_grad():
            for parameter in copied.parameters():
                parameter.mul_(1.5)
        expected = copied.generate(
            torch.arange(5, 12).unsqueeze(0), max_new_tokens=4, do_sample=False, cache_implementation="static"
        )
        self.assertFalse(torch.equal(expected, original))  # the copy's weights give other tokens
        self.assertEqual(self.call(copied).tolist(), expected.tolist())


class CacheRecordTest(unittest.TestCase):
    def test_a_reset_cache_is_a_fresh_cache(self):
        # A bucketed call leaves its padding recorded on the cache; after `reset()` the cache holds nothing, and a
        # call that fits it unpadded (but not padded) runs as upstream on a fresh cache, not as a continuation.
        model = tiny_llama()
        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        fields = {"prefill_buckets": [8, 16], "prefill_padding_side": "left"}
        cache = StaticCache(config=model.config, max_cache_len=16)
        first = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
        prefill_buckets.generate(model, first, generation_config=config, **{CACHE: cache}, **fields)
        cache.reset()
        prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))  # bucket 16 + 3 > 16
        ours = prefill_buckets.generate(model, prompt, generation_config=config, **{CACHE: cache}, **fields)
        theirs = model.generate(
            prompt, generation_config=config, **{CACHE: StaticCache(config=model.config, max_cache_len=16)}
        )
        self.assertEqual(ours.tolist(), theirs.tolist())


if __name__ == "__main__":
    unittest.main()
