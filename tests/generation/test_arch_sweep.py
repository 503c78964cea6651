# The architecture sweeps (`utils/arch_sweep.py`, `utils/chat_sweep.py`'s second turn, `utils/compiled_sweep.py`):
# bucketed `generate` against upstream on tiny models of the transformers causal-LM architectures. CI runs a fixed
# sample that covers every cache and attention kind; `RUN_SLOW=1` runs every `model_type` of the auto mapping. The
# target: no row where upstream runs and the bucketed call crashes or returns other tokens.

import argparse
import importlib.util
import unittest
from pathlib import Path

import torch
import transformers
from packaging import version
from parameterized import parameterized
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.testing_utils import slow

from .tiny_models import CACHE


_SWEEP = Path(__file__).resolve().parents[2] / "utils" / "arch_sweep.py"
_spec = importlib.util.spec_from_file_location("arch_sweep", _SWEEP)
arch_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arch_sweep)
_spec = importlib.util.spec_from_file_location("compiled_sweep", _SWEEP.with_name("compiled_sweep.py"))
compiled_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled_sweep)

# One architecture per cache and attention kind (each is in both tested transformers versions' mapping).
CI_SAMPLE = {
    "llama": "full attention, grouped-query",
    "gpt2": "learned positions, fused query/key/value",
    "gpt_bigcode": "multi-query: the config's head count is not the cache's",
    "falcon": "multi-query, a config that states more key/value heads than it uses",
    "gpt_neox": "multi-head, fused projection",
    "gpt_neo": "a causal-mask buffer of max_position_embeddings",
    "mistral": "sliding window",
    "gemma2": "alternating sliding and full layers",
    "qwen3_moe": "mixture of experts",
    "mamba": "recurrent state only",
    "jamba": "hybrid: attention and recurrent layers",
    "zamba2": "hybrid, `prepare_inputs_for_generation` takes the mask through **kwargs",
    "falcon_h1": "hybrid, **kwargs override",
    "trocr": "no position_ids, no logits_to_keep: neither side",
    "bart": "a decoder of an encoder-decoder family: positions from the cache length",
    "megatron-bert": "bidirectional attention (is_decoder=False)",
    "ctrl": "an old model, **kwargs override",
    "openai-gpt": "an old model, **kwargs override",
    "xlnet": "its own prepare_inputs_for_generation drops the mask",
    "mpt": "ALiBi, no static cache object from generate",
    "bloom": "ALiBi, no position_ids; its 2D mask padded to every slot (cut to the window on a first call)",
    "recurrent_gemma": "recurrent state on its modules, outside the cache: not right (other logits on 5.17)",
    "deepseek_v4": "compressed attention (transformers 5.24 only)",
    "doge": "a dynamic mask built from the keys: neither side (other tokens on 5.17)",
    "gemma4_unified_text": "per-layer head sizes (the cache's size in the growth warning; transformers 5.24 only)",
    "git": "adds the cache length to its decode positions: not left (other tokens on 5.17); a ragged batch unpadded",
    "glm4_moe_lite": "latent attention; with fewer kv heads, upstream runs only without a mask (transformers 5.24 only)",
}


class ArchitectureSweepTest(unittest.TestCase):
    def assertNoFailedRow(self, row):
        self.assertFalse(row.failed, f"{row.model_type}: one prompt: {row.one_prompt}; batch of 2: {row.batch_of_2}")

    @parameterized.expand(
        [(model_type,) for model_type in CI_SAMPLE if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    )
    def test_sample(self, model_type):
        row = arch_sweep.sweep_one(model_type, timeout=120)
        self.assertNoFailedRow(row)
        self.assertTrue(row.cache, f"{model_type}: upstream should run on the tiny model: {row.one_prompt}")
        for variant in arch_sweep.variants_of(model_type):
            self.assertNoFailedRow(arch_sweep.sweep_one(model_type, timeout=120, variant=variant))

    def test_cells_say_what_ran(self):
        # A bucketed call that runs unpadded says why; one that is padded names the side.
        bidirectional = arch_sweep.sweep_one("megatron-bert")
        self.assertTrue(bidirectional.one_prompt.startswith("unpadded: "), bidirectional.one_prompt)
        self.assertIn("bidirectional", bidirectional.one_prompt)
        llama = arch_sweep.sweep_one("llama")
        self.assertEqual(llama.cells, ("right", "right", "right"))  # the batch's rows right-padded each after its end

    def test_logits_show_what_tokens_hide(self):
        # Issue 36: on tiny random models a wrong mask or window left the tokens equal (each row repeats one token),
        # and only the logits differed. A difference past the tolerance is a failed cell.
        theirs = (torch.zeros(2, 8), torch.zeros(2, 8))
        self.assertIsNone(arch_sweep.logits_difference(theirs, theirs))
        ours = (theirs[0], theirs[1] + torch.tensor([0.0, 4e-3]).view(2, 1))
        step, difference = arch_sweep.logits_difference(ours, theirs)
        self.assertEqual(step, 1)
        self.assertAlmostEqual(difference, 4e-3, places=6)
        self.assertIsNone(arch_sweep.logits_difference((theirs[0] + 1e-6,), theirs[:1]))  # float rounding

    def test_variants(self):
        # A latent-attention config gets a row with fewer key/value heads than queries, as a shrunken default has.
        self.assertEqual(arch_sweep.variants_of("llama"), [])
        if "deepseek_v3" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            self.assertEqual(arch_sweep.variants_of("deepseek_v3"), ["fewer kv heads"])
            config = arch_sweep.tiny_config("deepseek_v3", "fewer kv heads")
            self.assertLess(config.num_key_value_heads, config.num_attention_heads)
            self.assertEqual(arch_sweep.tiny_config("deepseek_v3").num_key_value_heads, config.num_attention_heads)

    @slow
    def test_every_architecture(self):
        rows = [
            arch_sweep.sweep_one(model_type, variant=variant)
            for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
            for variant in (None, *arch_sweep.variants_of(model_type))
        ]
        failed = [row for row in rows if row.failed]
        self.assertEqual(failed, [], arch_sweep.markdown_table(failed))


class ContinuedConversationTest(unittest.TestCase):
    """
    A second turn that passes the first turn's static cache back, with the conversation so far, against upstream's two
    unpadded turns: tokens of both, and the second turn's logits. The hybrids' linear-attention layers hold no slots
    (continuing their cache raised `AttributeError` reading the cache's length, and RecurrentGemma's a `ValueError`).
    Zamba2 and Inkling hold keys and a state in one layer, which transformers 5.17's `is_linear` counts as linear: the
    second turn ran unpadded on a left-padded cache (other logits). GIT's ragged batch was padded on the right, each
    row after its own end, which a second turn lines up with only on the left, which GIT can't take: it ran unpadded on
    a cache laid out otherwise than upstream's (logits 1.4e-3 off); such a batch now runs unpadded from the first turn.
    """

    @parameterized.expand(
        [("llama",), ("mistral",), ("jamba",), ("recurrent_gemma",), ("zamba2",), ("inkling_text",), ("git",)]
    )
    def test_second_turn(self, model_type):
        import prefill_buckets

        if model_type == "git" and version.parse(transformers.__version__) < version.parse("5.24"):
            self.skipTest("upstream's own GIT conversation on a static cache fails before transformers 5.24")

        model = arch_sweep.build_tiny_model(model_type, arch_sweep.tiny_config(model_type))
        user = torch.randint(3, arch_sweep.VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
        options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
        for name, (ids, mask) in arch_sweep._prompts().items():
            if mask is None:
                continue

            def two_turns(generate, first_options):
                first = generate(ids, attention_mask=mask, **options, **first_options)
                conversation = torch.cat([first.sequences, user[: ids.shape[0]]], 1)
                turn_mask = torch.cat([mask, torch.ones_like(conversation[:, mask.shape[1] :])], 1)
                later = generate(
                    conversation, attention_mask=turn_mask, output_logits=True, **{CACHE: first[CACHE]}, **options
                )
                return first, later

            static = {"cache_implementation": "static", "max_cache_len": 64}
            with self.subTest(name):
                first, later = two_turns(model.generate, static)
                ours_first, ours_later = two_turns(
                    lambda *args, **kwargs: prefill_buckets.generate(model, *args, **kwargs),
                    dict(static, prefill_buckets="pow2"),
                )
                self.assertTrue(torch.equal(ours_first.sequences, first.sequences))
                self.assertTrue(torch.equal(ours_later.sequences, later.sequences))
                self.assertIsNone(arch_sweep.logits_difference(ours_later.logits, later.logits))


class CompiledSweepTest(unittest.TestCase):
    """
    `utils/compiled_sweep.py`: each model compiled as a user compiles it (`model.compile()`, `dynamic=None`, the
    counting backend), five prompt lengths and a ragged batch bucketed with `"pow2-quarters"`, against upstream's
    eager unpadded calls: the same tokens and logits, no warning of eager forwards, and no graph for a call in a bucket
    already used. BLOOM's first call raised in tracing (its 2D mask, padded to every slot, was not cut to a
    shape-generic prefill's own slots); Gemma 3 has sliding layers, Jamba recurrent ones beside attention.
    """

    def assertRowIsOk(self, model_type):
        as_a_user = argparse.Namespace(fullgraph=False, dynamic_false=False, upstream_compiled=False)
        row = compiled_sweep.sweep_one(model_type, 180, as_a_user)
        self.assertTrue(row.cell.startswith("ok ("), f"{model_type}: {row.cell}; {'; '.join(row.notes)}")

    @parameterized.expand([("bloom",), ("gemma3_text",)])
    def test_sample(self, model_type):
        self.assertRowIsOk(model_type)

    @slow
    def test_a_hybrid(self):  # 35 s on the 2-core machine: with `RUN_SLOW=1`
        self.assertRowIsOk("jamba")
