# The one decision of how a call is padded (`call/decision.py`): every reason a call runs unpadded is decided there,
# before anything is padded, and is the reason the log names (the table, `DECISION`, and the docs: test_padding_rule.py).

import random
import re
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CompileConfig,
    GenerationConfig,
    PreTrainedTokenizerFast,
    StaticCache,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.call import generation
from prefill_buckets.call.hooks import HOOKS
from prefill_buckets.upstream import candidates

from .tiny_models import (
    BUCKETS,
    CACHE,
    COUNTER_BACKEND,
    EOS,
    PAD,
    VOCAB,
    CompilationTestCase,
    get_model,
    make_config,
    make_model,
    make_prompt,
    make_reference,
    random_batch_ids,
    tiny_llama,
)


class OneDecisionTest(unittest.TestCase):
    """A call that runs unpadded is decided so in `choose_side`: the reason logged is its reason, nothing is planned."""

    def setUp(self):
        self.decisions = []
        original = generation.choose_side

        def spy(*args, **kwargs):
            self.decisions.append(original(*args, **kwargs))
            return self.decisions[-1]

        for patcher in (
            mock.patch.object(generation, "choose_side", spy),
            mock.patch.object(generation, "plan_call", side_effect=AssertionError("an unpadded call is not planned")),
        ):
            patcher.start()
            self.addCleanup(patcher.stop)
        logging.get_logger("prefill_buckets").warning_once.cache_clear()  # each test's reason is logged again

    def assert_unpadded(self, model, prompt, expected, **kwargs) -> None:
        logger = logging.get_logger("prefill_buckets.call.generation")
        with CaptureLogger(logger) as captured:
            tokens = prefill_buckets.generate(model, prompt, **kwargs)
        self.assertEqual(tokens.tolist(), expected.tolist())
        self.assertEqual(self.decisions[-1].side, "unpadded")
        self.assertIn(f"are ignored for this call: {self.decisions[-1].reason}.", captured.out)

    def test_left_padding_in_front_of_an_unpadded_calls_tokens(self):
        model = tiny_llama()
        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        prompt = torch.arange(3, 13).unsqueeze(0)
        expected_cache = StaticCache(config=model.config, max_cache_len=64)
        first = model.generate(prompt, generation_config=config, **{CACHE: expected_cache})
        turn = torch.cat([first, torch.arange(20, 25).unsqueeze(0)], dim=1)
        expected = model.generate(turn, generation_config=config, **{CACHE: expected_cache})

        cache = StaticCache(config=model.config, max_cache_len=64)
        model.generate(prompt, generation_config=config, **{CACHE: cache})  # unpadded: no bucket fields
        fields = {"prefill_buckets": [32], "prefill_padding_side": "left"}
        self.assert_unpadded(model, turn, expected, generation_config=config, **{CACHE: cache}, **fields)
        self.assertIn("already holds tokens from an unpadded call", self.decisions[-1].reason)

    def test_no_room_in_the_cache_passed_in(self):
        model = tiny_llama()
        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        prompt = torch.arange(3, 13).unsqueeze(0)
        expected = model.generate(
            prompt, generation_config=config, **{CACHE: StaticCache(config=model.config, max_cache_len=32)}
        )
        cache = StaticCache(config=model.config, max_cache_len=32)  # fewer than a 64-token bucket needs
        fields = {"prefill_buckets": [64], "prefill_padding_side": "left"}
        self.assert_unpadded(model, prompt, expected, generation_config=config, **{CACHE: cache}, **fields)
        self.assertIn("the cache passed in has 32 slots", self.decisions[-1].reason)

    def test_token_healing(self):
        # Upstream decodes the padded prompt and tokenizes it again: padded, the call raised (`narrow()`) or returned
        # two tokens short, with the tokenizer's pad as the model's.
        model = tiny_llama(pad_token_id=0)
        tokenizer = word_tokenizer({f"w{i}": i for i in range(128)})
        config = GenerationConfig(max_new_tokens=5, do_sample=False, token_healing=True)
        for text in ("w10 w11 w12 w1", "w20 w21 w22 w23 w24 w25 w26"):
            prompt = tokenizer([text], return_tensors="pt").input_ids
            expected = model.generate(prompt, generation_config=config, tokenizer=tokenizer)
            logging.get_logger("prefill_buckets").warning_once.cache_clear()  # the reason is logged for each
            self.assert_unpadded(
                model, prompt, expected, generation_config=config, tokenizer=tokenizer, prefill_buckets=[16]
            )
            self.assertIn("token healing decodes the prompt", self.decisions[-1].reason)

    def test_prompt_lookup_from_inputs_embeds_alone(self):
        # Upstream cuts the mask to the ids (the candidates): padded, the prompt's mask would be lost, and the tokens.
        model = tiny_llama()
        embeds = model.get_input_embeddings()(torch.arange(3, 8).unsqueeze(0)).detach()
        config = GenerationConfig(max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
        expected = model.generate(inputs_embeds=embeds, generation_config=config)
        self.assert_unpadded(
            model, None, expected, inputs_embeds=embeds, generation_config=config, prefill_buckets=[16]
        )
        self.assertIn("decoding from `inputs_embeds` alone", self.decisions[-1].reason)

    def test_assisted_decoding_from_inputs_embeds_alone(self):
        # One new token: upstream's assisted decoding from embeddings runs (it fails past one), on the mask cut to
        # the ids; padded, the pad position would be attended.
        model = tiny_llama()
        embeds = model.get_input_embeddings()(torch.tensor([[47]])).detach()
        config = GenerationConfig(max_new_tokens=1, do_sample=False)
        expected = model.generate(inputs_embeds=embeds, generation_config=config, assistant_model=tiny_llama(seed=1))
        self.assert_unpadded(
            model, None, expected, inputs_embeds=embeds, generation_config=config, assistant_model=tiny_llama(seed=1),
            prefill_buckets=[2],
        )  # fmt: skip
        self.assertIn("assisted and prompt-lookup decoding from `inputs_embeds` alone", self.decisions[-1].reason)

    def test_prompt_lookup_on_a_static_cache_with_sliding_window_layers(self):
        # Unpadded, the cache (2 + 3 slots) fits the window of 8, so upstream can crop it; padded to 10 it would not.
        model = get_model.__wrapped__("mistral_sliding")  # a fresh one: upstream keeps a longer cache a call made
        prompt = torch.arange(20, 22).unsqueeze(0)
        config = GenerationConfig(
            max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=3, cache_implementation="static"
        )
        try:
            expected = model.generate(prompt, generation_config=config)
        except ValueError as error:  # older transformers (5.17): no candidate decoding on a static cache at all
            with self.assertRaisesRegex(ValueError, re.escape(str(error))):
                prefill_buckets.generate(model, prompt, generation_config=config, prefill_pad_to_multiple_of=10)
            return
        self.assert_unpadded(model, prompt, expected, generation_config=config, prefill_pad_to_multiple_of=10)
        self.assertIn("static sliding-window layer allows only", self.decisions[-1].reason)

    def test_candidates_drafted_from_the_targets_outputs(self):
        # A Gemma 4 assistant drafts from the target's hidden and key-value states, at the ids' length and without the
        # mask: padded, its candidates and the sampled tokens differed (upstream's 50, 76, 49, 111, ... against 50, 76, 111, 62, ...).
        target, assistant = gemma4_with_assistant()
        prompt = torch.tensor([[17, 64, 96, 33, 122, 9, 42, 25, 112, 69]])
        config = GenerationConfig(max_new_tokens=6, do_sample=True, cache_implementation="dynamic")
        torch.manual_seed(7)
        expected = target.generate(prompt, generation_config=config, assistant_model=assistant)
        torch.manual_seed(7)
        self.assert_unpadded(
            target, prompt, expected, generation_config=config, assistant_model=assistant, prefill_buckets="pow2"
        )
        self.assertIn("a Gemma4AssistantForCausalLM assistant drafts from the target's", self.decisions[-1].reason)

    def test_an_assistant_with_another_tokenizer(self):
        # Sampled, upstream's universal speculative decoding hands the assistant the target's attention mask and
        # positions, cut to the length of the prompt's text in the assistant's tokens: padded, its leading zeros hid
        # the assistant's first tokens, and the candidates and sampled tokens differed.
        target, tokenizer, assistant, assistant_tokenizer = models_with_other_tokenizers()
        inputs = tokenizer(["w33 w7 w91 w45 w56 w99 w8 w64 w77"], return_tensors="pt")
        config = GenerationConfig(max_new_tokens=8, do_sample=True, num_assistant_tokens=3)
        other = {"assistant_model": assistant, "tokenizer": tokenizer, "assistant_tokenizer": assistant_tokenizer}
        target.generate(**inputs, generation_config=config, **other)  # the first prunes the assistant's head in place
        torch.manual_seed(0)
        expected = target.generate(**inputs, generation_config=config, **other)
        torch.manual_seed(0)
        self.assert_unpadded(target, inputs.input_ids, expected, attention_mask=inputs.attention_mask,
                             generation_config=config, prefill_buckets=[16], **other)  # fmt: skip
        self.assertIn("an assistant with another tokenizer (`assistant_tokenizer`)", self.decisions[-1].reason)

    def test_candidate_decoding_with_hidden_states(self):
        # Upstream's first candidate check returns, for each token it accepts after the first, the hidden states of
        # the sequence's first positions (it slices from 0): padded, those were the padding's. An assistant with the
        # model's own weights drafts the tokens the model picks, so the check accepts them all.
        model, assistant = tiny_llama(), tiny_llama()
        prompt = torch.arange(20, 39).unsqueeze(0)
        config = GenerationConfig(
            max_new_tokens=6, do_sample=False, output_hidden_states=True, return_dict_in_generate=True
        )
        expected = model.generate(prompt, generation_config=config, assistant_model=assistant)
        logger = logging.get_logger("prefill_buckets.call.generation")
        with CaptureLogger(logger) as captured:
            output = prefill_buckets.generate(
                model, prompt, generation_config=config, assistant_model=assistant, prefill_buckets="pow2"
            )
        self.assertEqual(output.sequences.tolist(), expected.sequences.tolist())
        for step, (ours, theirs) in enumerate(zip(output.hidden_states, expected.hidden_states, strict=True)):
            for layer, (got, want) in enumerate(zip(ours, theirs, strict=True)):
                torch.testing.assert_close(got, want, msg=f"step {step}, layer {layer}")
        self.assertEqual(self.decisions[-1].side, "unpadded")
        self.assertIn("`_split_model_outputs` slices from 0", captured.out)


def word_tokenizer(vocab: dict) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w1", bos_token="w2")


def models_with_other_tokenizers():
    """
    A tiny Llama with a word-level tokenizer (`w<id>`), and an assistant whose tokenizer orders the first 100 of those
    words otherwise and adds 10 of its own (`x<i>`): upstream's assisted decoding with another tokenizer.
    """
    order = [0, 1, 2, *random.Random(5).sample(range(3, 100), 97)]
    theirs = {f"w{word}": token for token, word in enumerate(order)} | {f"x{i}": 100 + i for i in range(10)}
    target_tokenizer = word_tokenizer({f"w{i}": i for i in range(128)})
    return (
        target_tokenizer and tiny_llama(),
        target_tokenizer,
        tiny_llama(seed=1, vocab_size=110),
        word_tokenizer(theirs),
    )


def gemma4_with_assistant():
    """A tiny Gemma 4 model and a Gemma 4 assistant that drafts from its shared key-value states; skips before 5.24."""
    try:
        from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig
    except ImportError:
        raise unittest.SkipTest("no Gemma 4 assistant in this transformers")
    sizes = {
        "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 512,
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    }  # fmt: skip
    text_config = Gemma4TextConfig(**sizes)
    text_config._attn_implementation = None
    torch.manual_seed(0)
    target = Gemma4ForCausalLM(text_config).eval()
    drafter_config = Gemma4TextConfig(
        **sizes, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=2
    )
    assistant_config = Gemma4AssistantConfig(
        text_config=drafter_config.to_dict(), backbone_hidden_size=32, num_centroids=16, centroid_intermediate_top_k=4
    )
    torch.manual_seed(1)
    assistant = Gemma4AssistantForCausalLM(assistant_config).eval()
    assistant.generation_config.num_assistant_tokens = 4
    return target, assistant


class DrafterBackstopTest(unittest.TestCase):
    def test_a_padded_call_never_drafts_from_the_targets_outputs(self):
        # Should the decision miss a drafter that reads the target's outputs, the padded call raises, never runs wrong.
        target, assistant = gemma4_with_assistant()
        prompt = torch.tensor([[17, 64, 96, 33, 122, 9, 42, 25, 112, 69]])
        config = GenerationConfig(max_new_tokens=6, do_sample=True, cache_implementation="dynamic")
        with mock.patch.object(candidates, "drafter_padding_changes", return_value=None):
            with self.assertRaisesRegex(
                RuntimeError, "SinglePositionMultiTokenCandidateGenerator, whose drafts padding changes"
            ):
                prefill_buckets.generate(
                    target, prompt, generation_config=config, assistant_model=assistant, prefill_buckets="pow2"
                )


# ---------------------------------------------------------------------------------------------------------------------
# Calls a forward the user compiled can't bound (classifier-free guidance, no cache): decided unpadded, upstream's call
# (the compile tests' model and counting backend, `tiny_models.CompilationTestCase`)
# ---------------------------------------------------------------------------------------------------------------------


class GuidanceTest(CompilationTestCase):
    """
    Classifier-free guidance (`guidance_scale`) runs the model's forward from its logits processor at every step, on
    the last token's view of the sequence (its stride is the sequence's length) with a growing cache: a forward the user
    compiled gets new graphs for those on every call, which no bucket bounds.
    """

    LENGTHS = (5, 6, 7, 9, 11)

    def guided_config(self, **fields) -> GenerationConfig:
        return make_config(guidance_scale=1.5, **fields)

    def test_a_forward_the_user_compiled_runs_upstreams_call(self):
        # Bucketed, the package raised torch's limit for graphs it had not predicted (graph breaks' room, as it reads
        # them), and every call compiled 5 more: 22 graphs after these 5 calls, against upstream's 8 and eager after.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)  # no fullgraph: torch runs past its limit eagerly
        config = self.guided_config(prefill_buckets=BUCKETS)
        with CaptureLogger(logging.get_logger("prefill_buckets.call.generation")) as captured:
            for length in self.LENGTHS:
                got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
                expected = reference.generate(make_prompt(length), generation_config=self.guided_config())
                self.assertEqual(got.tolist(), expected.tolist(), f"prompt {length}")
        self.assertLessEqual(counter.graphs, 8, "torch's own limit: the package raised it for the guidance's graphs")
        self.assertEqual(torch._dynamo.config.recompile_limit, 8)
        self.assertIn("are ignored for this call: classifier-free guidance (`guidance_scale=1.5`)", captured.out)
        self.assertIn("compiled with `model.compile()`", captured.out)

    def test_a_forward_upstream_compiles_is_bucketed(self):
        # With `compile_config`, the processor calls the model's eager module: every forward `generate` runs is
        # compiled, one graph per bucket, and the guidance's forwards compile nothing.
        model = make_model()
        reference = make_reference(model)
        counter = self.registered_counter()
        compile_config = CompileConfig(backend=COUNTER_BACKEND, fullgraph=True, dynamic=False, mode=None)
        config = self.guided_config(prefill_buckets=BUCKETS, compile_config=compile_config)
        for length in self.LENGTHS:
            self.check_call(
                counter,
                lambda ids: prefill_buckets.generate(model, ids, generation_config=config),
                make_prompt(length),
                reference,
                self.guided_config(),
            )
        self.assertEqual(counter.graphs, 2, counter.shapes)  # prefill 16, decode


class NoCacheTest(CompilationTestCase):
    """
    Without a cache (`use_cache=False`) every step's forward runs the whole sequence, a token longer than the last: a
    forward the user compiled gets a graph per step of every call, which no bucket bounds.
    """

    def test_a_forward_the_user_compiled_runs_upstreams_call(self):
        # Bucketed, the package took each step for a decode step on a cache and raised torch's limit for the graphs it
        # predicted, so torch compiled past its own limit (12 graphs here), and then said torch may have run forwards
        # eagerly. Upstream's call compiles up to torch's limit (8), then runs eagerly.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)  # no fullgraph: torch runs past its limit eagerly
        config = make_config(use_cache=False, prefill_buckets=[8, 16, 32])
        with CaptureLogger(logging.get_logger("prefill_buckets.call.generation")) as captured:
            for length in (5, 12, 20):  # 12 lengths of forwards, padded or not: more than torch's limit of 8
                got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
                expected = reference.generate(make_prompt(length), generation_config=make_config(use_cache=False))
                self.assertEqual(got.tolist(), expected.tolist(), f"prompt {length}")
        self.assertEqual(torch._dynamo.config.recompile_limit, 8)
        self.assertLessEqual(counter.graphs, 8, "torch's own limit: the package raised it")
        self.assertIn("are ignored for this call: without a cache (`use_cache=False`)", captured.out)
        self.assertIn("compiled with `model.compile()`", captured.out)

    def test_an_eager_forward_is_bucketed(self):
        # Eager, nothing compiles: the call is padded on the left (`padding_side.RULE`), exact.
        model = make_model()
        reference = make_reference(model)
        config = make_config(use_cache=False, prefill_buckets=BUCKETS)
        sides = []
        choose_side = generation.choose_side
        with mock.patch.object(generation, "choose_side", lambda call: sides.append(choose_side(call)) or sides[-1]):
            for length in (5, 9):
                got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
                expected = reference.generate(make_prompt(length), generation_config=make_config(use_cache=False))
                self.assertEqual(got.tolist(), expected.tolist(), f"prompt {length}")
        self.assertEqual([side.side for side in sides], ["left", "left"])


if __name__ == "__main__":
    unittest.main()


class CacheImplementationTest(unittest.TestCase):
    def test_hybrid_is_the_dynamic_cache_upstream_makes(self):
        # Upstream unsets `cache_implementation="hybrid"` and makes a dynamic cache, though "hybrid" is listed as
        # static: the call was planned on the right for a static cache, and ran its prefill unpadded when none came.
        model = tiny_llama()
        config = GenerationConfig(max_new_tokens=4, do_sample=False, cache_implementation="hybrid")
        sides = []
        choose_side = generation.choose_side
        logger = logging.get_logger("prefill_buckets")
        logger.warning_once.cache_clear()
        with mock.patch.object(generation, "choose_side", lambda call: sides.append(choose_side(call)) or sides[-1]):
            for length in (5, 11):
                prompt = torch.arange(3, 3 + length).unsqueeze(0)
                with CaptureLogger(logger) as captured:
                    tokens = prefill_buckets.generate(model, prompt, generation_config=config, prefill_buckets=[16])
                self.assertEqual(tokens.tolist(), model.generate(prompt, generation_config=config).tolist())
                self.assertNotIn("made no static cache", captured.out)
        self.assertEqual([side.side for side in sides], ["left", "left"])  # a dynamic cache's side


# An encoder-decoder model with bucket fields raises (`decision.py`), and without them runs upstream's call: moved whole
# from test_equivalence.py, with its recorder of the hooks installed at each forward.
class EncoderDecoderTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        config = T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=PAD,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
        torch.manual_seed(0)
        cls.model = T5ForConditionalGeneration(config).eval()

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)

    @parameterized.expand([("buckets", {"prefill_buckets": [8]}), ("multiple", {"prefill_pad_to_multiple_of": 8})])
    def test_raises(self, _, fields):
        with self.assertRaisesRegex(ValueError, "encoder-decoder"):
            prefill_buckets.generate(self.model, random_batch_ids(1, 5), max_new_tokens=2, **fields)
        prefill_buckets.enable()
        with self.assertRaisesRegex(ValueError, "encoder-decoder"):
            self.model.generate(random_batch_ids(1, 5), max_new_tokens=2, **fields)

    def test_without_fields_is_upstream(self):
        input_ids = random_batch_ids(1, 5)
        expected = self.model.generate(input_ids, max_new_tokens=3, do_sample=False)
        hooked_during_call = record_hooks_during_forwards(self, self.model)
        out = prefill_buckets.generate(self.model, input_ids, max_new_tokens=3, do_sample=False)
        self.assertTrue(torch.equal(out, expected))
        # Not only the same ids: the call never went through the bucketed path (no hook at any forward)...
        self.assertTrue(hooked_during_call)
        self.assertEqual(set().union(*hooked_during_call), set())
        # ...which the same recorder does see on a bucketed call (positive control).
        decoder = get_model("llama")
        hooked_during_call = record_hooks_during_forwards(self, decoder)
        prefill_buckets.generate(decoder, input_ids, max_new_tokens=3, do_sample=False, prefill_buckets=[8])
        self.assertEqual(set().union(*hooked_during_call), set(HOOKS))


def record_hooks_during_forwards(test: unittest.TestCase, model) -> list[set[str]]:
    """For every forward of `model` from now on, the names of the bucketed-call hooks installed on the instance."""
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(set(HOOKS) & set(model.__dict__)))
    test.addCleanup(handle.remove)
    return seen
