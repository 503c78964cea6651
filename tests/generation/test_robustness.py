# Every generation mode a user reaches for, bad input, and faults: with buckets, the output is exactly an unpadded
# run's, or the call raises a clear error. Reference runs are upstream `generate` on the same inputs.

import logging as std_logging
from unittest import mock

import torch
from parameterized import parameterized
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CompileConfig, GenerationConfig, PreTrainedTokenizerFast, StaticCache
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets.call.generation import UPSTREAM_GENERATE
from prefill_buckets.compile.compiled_calls import EagerFallback, GraphCounter
from prefill_buckets.compile.compiled_calls import logger as compilation_logger

from .tiny_models import CACHE, LLAMA_LIKE, SPECIAL_TOKENS, RobustnessTestBase, random_batch_ids, tiny_llama


package_logger = logging.get_logger("prefill_buckets")  # every module of the package logs under it


VOCAB = 128


def clear_warning_once() -> None:
    """Forgets what `logger.warning_once` has logged (transformers caches it per process), so a test sees it again."""
    std_logging.Logger.warning_once.cache_clear()


def word_tokenizer() -> PreTrainedTokenizerFast:
    """
    A word-level tokenizer over the tiny models' 128 ids: `w<id>` is one token (pad w0, eos w1, bos w2), except id 3,
    `abcdef`: stop strings find a token's text by tokenizing that word.
    """
    vocab = {f"w{i}": i for i in range(VOCAB) if i != 3}
    vocab["abcdef"] = 3
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="abcdef"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="w0", eos_token="w1", bos_token="w2", padding_side="left"
    )


class GenerationModesTest(RobustnessTestBase):
    @parameterized.expand(
        [
            (f"{mode}_{'sample' if sample else 'greedy'}_{length}", mode, sample, length)
            for mode in ("assisted", "prompt_lookup")
            for sample in (False, True)
            for length in (5, 11, 16, 17)
        ]
    )
    def test_assisted_and_prompt_lookup(self, _, mode, sample, length):
        input_ids = random_batch_ids(1, length, seed=length)
        input_ids[0, -3:] = input_ids[0, :3].clone()  # an n-gram that prompt lookup finds
        kwargs = {"assistant_model": tiny_llama(seed=1)} if mode == "assisted" else {"prompt_lookup_num_tokens": 2}
        config = GenerationConfig(max_new_tokens=8, do_sample=sample, pad_token_id=0, eos_token_id=1)
        torch.manual_seed(0)
        expected = self.model.generate(input_ids, generation_config=config, **kwargs)
        prefill_buckets.enable()  # the assistant's own `generate` is then bucketed too
        torch.manual_seed(0)
        actual = self.model.generate(input_ids, generation_config=config, prefill_buckets=[16, 32], **kwargs)
        self.assertSameIds(actual, expected)

    @parameterized.expand(
        [
            (f"{kind}_{name}_{length}", kind, processors, length)
            for kind in ("assistant_model", "assistant_early_exit")
            for name, processors in [
                ("sequence_bias", {"sequence_bias": {(88,): 5.0}}),
                # Before transformers 5.23 its penalty is wrapped too (later it skips the padding by the mask).
                ("repetition_penalty", {"repetition_penalty": 3.0}),
            ]
            for length in (5, 17)
        ]
    )
    def test_sampled_assisted_decoding_with_processors(self, _, kind, processors, length):
        # The assistant's `generate` keeps one processor of each type (the call's over the one it builds itself): a
        # processor that strips the padding must count as the type it wraps, or both run (the bias added twice), and
        # the candidates' probabilities, which sampling weighs, change.
        input_ids = random_batch_ids(1, length, seed=length)
        config = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=0, eos_token_id=1, **processors)
        # Early exit drafts with the model's own first layers: its `generate` is the assistant's.
        assistant = tiny_llama(seed=1) if kind == "assistant_model" else self.model
        drafting = {"assistant_model": assistant} if kind == "assistant_model" else {"assistant_early_exit": 1}
        for seed in range(3):
            torch.manual_seed(seed)
            expected = self.model.generate(input_ids, generation_config=config, **drafting)
            torch.manual_seed(seed)
            actual = prefill_buckets.generate(
                self.model, input_ids, generation_config=config, prefill_buckets=[16, 32], **drafting
            )
            self.assertSameIds(actual, expected)
            self.assertNotIn("_merge_criteria_processor_list", assistant.__dict__)  # put back

    @parameterized.expand([("static", "static"), ("dynamic", None)])
    def test_stop_strings(self, _, cache_implementation):
        tokenizer = word_tokenizer()
        input_ids = random_batch_ids(2, 9, seed=3)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, :4] = 0
        input_ids[1, :4] = 0
        free_run = self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
        stop = tokenizer.convert_ids_to_tokens(int(free_run[0, 9 + 3]))  # the 4th new token of row 0
        kwargs = {
            "attention_mask": attention_mask,
            "max_new_tokens": 10,
            "do_sample": False,
            "stop_strings": [stop],
            "tokenizer": tokenizer,
            "cache_implementation": cache_implementation,
        }
        expected = self.model.generate(input_ids, **kwargs)
        actual = prefill_buckets.generate(self.model, input_ids, prefill_buckets=[16, 32], **kwargs)
        self.assertSameIds(actual, expected)
        # The stop string ended row 0 after its 4th new token: it is padded from there on, unlike the free run.
        self.assertTrue(expected[0, 13:].eq(0).all())
        self.assertFalse(torch.equal(expected, free_run[:, : expected.shape[1]]))

    @parameterized.expand(
        [("same_multiple", {"prefill_pad_to_multiple_of": 8}), ("buckets", {"prefill_buckets": [16]})]
    )
    def test_already_padded_by_the_tokenizer(self, _, fields):
        tokenizer = word_tokenizer()
        texts = [" ".join(f"w{i}" for i in random_batch_ids(1, n, seed=n)[0].tolist()) for n in (3, 10, 6)]
        inputs = tokenizer(texts, padding=True, pad_to_multiple_of=8, return_tensors="pt")
        self.assertEqual(inputs["input_ids"].shape[1], 16)
        expected = self.model.generate(**inputs, max_new_tokens=5, do_sample=False)
        actual = prefill_buckets.generate(self.model, **inputs, max_new_tokens=5, do_sample=False, **fields)
        self.assertSameIds(actual, expected)

    def test_output_attentions_with_static_cache(self):
        model = tiny_llama(attn_implementation="eager")
        input_ids = random_batch_ids(1, 6)
        kwargs = {
            "max_new_tokens": 3,
            "do_sample": False,
            "output_attentions": True,
            "return_dict_in_generate": True,
            "cache_implementation": "static",
        }
        expected = model.generate(input_ids, **kwargs)
        actual = prefill_buckets.generate(model, input_ids, prefill_buckets=[8], **kwargs)
        self.assertSameIds(actual.sequences, expected.sequences)
        # Prefill: the query axis is the prompt's 6 tokens. The key axis spans each run's static cache (8 slots
        # upstream, more here), the prompt in slots 0-5 in both (the 2 pad slots taken off), every other slot 0.
        for got, want in zip(actual.attentions[0], expected.attentions[0]):
            self.assertEqual(got.shape[:-1], want.shape[:-1])
            self.assertEqual(got.shape[-1], actual[CACHE].get_max_length())
            torch.testing.assert_close(got[..., :8], want, atol=1e-5, rtol=1e-4)
            self.assertEqual(got[..., 8:].abs().sum().item(), 0.0)

    @parameterized.expand([("left",), ("right",)])
    def test_module_hooks_see_the_padded_prompt(self, side):
        # What the docs say of hooks a user registers: they run on the forwards' inputs, the padded prompt (pads in
        # front on the left, after it on the right), then the decode steps, as upstream's run on its own.
        seen = []
        embeddings = self.model.get_input_embeddings()
        handle = embeddings.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
        self.addCleanup(handle.remove)
        prompt = random_batch_ids(1, 11)
        config = GenerationConfig(cache_implementation="static", max_new_tokens=3, do_sample=False, pad_token_id=0)
        expected = self.model.generate(prompt, generation_config=config)
        upstream_seen, seen[:] = list(seen), []
        actual = prefill_buckets.generate(
            self.model, prompt, generation_config=config, prefill_buckets=[16], prefill_padding_side=side
        )
        self.assertSameIds(actual, expected)
        self.assertEqual([tuple(ids.shape) for ids in upstream_seen], [(1, 11), (1, 1), (1, 1)])
        self.assertEqual([tuple(ids.shape) for ids in seen], [(1, 16), (1, 1), (1, 1)])
        prompt_at = slice(5, 16) if side == "left" else slice(0, 11)
        self.assertSameIds(seen[0][:, prompt_at], prompt)

    def test_custom_generate_runs_unbucketed(self):
        def loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
            seen.append(input_ids.shape[1])
            return GenerationMixin._sample(
                model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs
            )

        seen = []
        input_ids = random_batch_ids(1, 5)
        expected = self.model.generate(input_ids, max_new_tokens=3, do_sample=False)
        with CaptureLogger(package_logger) as logs:
            actual = prefill_buckets.generate(
                self.model, input_ids, max_new_tokens=3, do_sample=False, custom_generate=loop, prefill_buckets=[8]
            )
        self.assertSameIds(actual, expected)
        self.assertEqual(seen, [5])  # the loop got the prompt as passed
        self.assertIn("`custom_generate` replaces the generation loop", logs.out)

    def test_paged_cache_runs_unbucketed_and_names_the_intervals(self):
        # Continuous batching pads by its own intervals: the call goes to upstream untouched, and the warning names
        # the setting to use instead. Upstream's continuous batching itself is not run (slow to set up on CPU).
        received = []
        input_ids = random_batch_ids(1, 5)
        with mock.patch(
            "prefill_buckets.call.generation.UPSTREAM_GENERATE", lambda model, **kwargs: received.append(kwargs)
        ):
            clear_warning_once()
            with CaptureLogger(package_logger) as logs:
                prefill_buckets.generate(
                    self.model, input_ids, cache_implementation="paged", max_new_tokens=3, prefill_buckets=[8]
                )
        self.assertEqual(len(received), 1)
        self.assertIs(received[0]["inputs"], input_ids)  # not padded
        self.assertIn("q_padding_interval_size", logs.out)
        self.assertIn("kv_padding_interval_size", logs.out)


# More decoder families than test_equivalence.py: other attention layouts, MoE, recurrent and hybrid caches. Built
# from tiny configs (`AutoConfig.for_model`), 2 layers, vocab 128.
_COMMON = {**LLAMA_LIKE, **SPECIAL_TOKENS}
MORE_ARCHITECTURES = {
    "gemma3_text": {"head_dim": 8, "sliding_window": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 8},
    "qwen2": {},
    "olmo2": {},
    "cohere": {},
    "falcon": {},
    "gpt_neox": {"num_key_value_heads": None},  # multi-head attention only: no key/value head count to state
    "phi": {},
    "starcoder2": {},
    "bloom": {"num_key_value_heads": None},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32, "num_key_value_heads": None},
    "gptj": {"n_embd": 32, "n_head": 4, "n_layer": 2, "rotary_dim": 4, "num_key_value_heads": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
    # Recurrent state, and hybrids of attention with recurrent or convolutional layers.
    "mamba": {"state_size": 4, "expand": 2, "conv_kernel": 4},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 4,
        "num_experts": 1,
        "mamba_d_state": 4,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "use_mamba_kernels": False,
    },
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "recurrent_gemma": {
        "head_dim": 8,
        "lru_width": 32,
        "attention_window_size": 8,
        "block_types": ["recurrent", "attention"],
    },
}


class MoreArchitecturesTest(RobustnessTestBase):
    @parameterized.expand([(name,) for name in MORE_ARCHITECTURES])
    def test_batch_of_lengths(self, name):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model(name, **{**_COMMON, **MORE_ARCHITECTURES[name]})
        model = AutoModelForCausalLM.from_config(config).eval()
        for length in (3, 8, 9):
            input_ids = random_batch_ids(2, length, seed=length)
            attention_mask = torch.ones_like(input_ids)
            input_ids[1, :1], attention_mask[1, :1] = 0, 0
            for cache_implementation in (None, "static"):
                with self.subTest(length=length, cache=cache_implementation):
                    kwargs = {
                        "attention_mask": attention_mask,
                        "max_new_tokens": 4,
                        "do_sample": False,
                        "cache_implementation": cache_implementation,
                    }
                    expected = model.generate(input_ids, **kwargs)
                    actual = prefill_buckets.generate(model, input_ids, prefill_buckets=[8, 16], **kwargs)
                    self.assertSameIds(actual, expected)
        self.assertNoHooksLeft(model)


class MoreArchitecturesCompiledTest(RobustnessTestBase):
    # Multi-query Falcon (its config states more key/value heads than it uses), MoE, recurrent and hybrid caches.
    @parameterized.expand([(name,) for name in ("falcon", "gpt_neox", "qwen3_moe", "mamba", "jamba", "lfm2")])
    def test_graphs_stay_within_the_bound(self, name):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        config = AutoConfig.for_model(name, **{**_COMMON, **MORE_ARCHITECTURES[name]})
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(config).eval()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        generation_config = GenerationConfig(
            cache_implementation="static", max_cache_len=32, max_new_tokens=4, do_sample=False
        )
        for length in (3, 5, 8, 11, 16, 2, 13):  # exact fits (8, 16) included
            input_ids = random_batch_ids(1, length, seed=length)
            actual = prefill_buckets.generate(
                model, input_ids, generation_config=generation_config, prefill_buckets=[8, 16]
            )
            self.assertSameIds(actual, reference.generate(input_ids, max_new_tokens=4, do_sample=False))
        self.assertEqual(counter.graphs, 3)  # a prefill graph per bucket, one decode graph
        self.assertNoHooksLeft(model)


class BadInputTest(RobustnessTestBase):
    def test_empty_prompt(self):
        with self.assertRaisesRegex(ValueError, "prompt is empty"):
            prefill_buckets.generate(self.model, torch.empty(1, 0, dtype=torch.long), prefill_buckets=[8])

    @parameterized.expand([("too_large", VOCAB), ("negative", -100)])
    def test_id_outside_the_vocabulary(self, _, bad_id):
        input_ids = random_batch_ids(2, 5)
        input_ids[1, 0] = bad_id
        with self.assertRaisesRegex(ValueError, rf"`input_ids` holds the id {bad_id}.*valid ids: 0 to {VOCAB - 1}"):
            prefill_buckets.generate(self.model, input_ids, max_new_tokens=2, prefill_buckets=[8])

    @parameterized.expand([("too_large", 500), ("negative", -1)])
    def test_pad_token_outside_the_vocabulary_in_a_batch(self, _, pad_token_id):
        input_ids = random_batch_ids(2, 5)
        with self.assertRaisesRegex(ValueError, rf"`pad_token_id` is {pad_token_id}.*valid ids: 0 to {VOCAB - 1}"):
            prefill_buckets.generate(
                self.model, input_ids, max_new_tokens=2, pad_token_id=pad_token_id, prefill_buckets=[8]
            )

    def test_pad_token_outside_the_vocabulary_with_batch_buckets(self):
        # One prompt, and a dummy row that finishes at once: upstream would feed it the pad id, so the call fills
        # finished rows with an id in the vocabulary. The user's row never finishes early: exact, as upstream.
        input_ids = random_batch_ids(1, 5)
        expected = self.model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=500)
        actual = prefill_buckets.generate(
            self.model,
            input_ids,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=500,
            prefill_buckets=[8],
            prefill_batch_buckets=[2],
        )
        self.assertSameIds(actual, expected)

    @parameterized.expand([("no_batch_buckets", None), ("batch_buckets", [4])])
    def test_pad_token_outside_the_vocabulary_eos_unreachable(self, _, batch_buckets):
        # transformers' own tests force generation to the maximum length with `pad_token_id=-1, eos_token_id=-1`:
        # no row can finish early, so upstream never feeds the pad id, and neither does the bucketed call.
        input_ids, attention_mask = random_batch_ids(2, 7), torch.ones(2, 7, dtype=torch.long)
        attention_mask[1, :3] = 0
        kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": -1, "eos_token_id": -1}
        expected = self.model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        actual = prefill_buckets.generate(
            self.model,
            input_ids,
            attention_mask=attention_mask,
            prefill_buckets=[8],
            prefill_batch_buckets=batch_buckets,
            **kwargs,
        )
        self.assertSameIds(actual, expected)

    def test_pad_token_outside_the_vocabulary_custom_criteria(self):
        # The user's own criterion could finish a row early: refused, naming why.
        class NeverStop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        with self.assertRaisesRegex(ValueError, "`pad_token_id` is -1.*`stopping_criteria` are passed"):
            prefill_buckets.generate(
                self.model,
                random_batch_ids(2, 5),
                max_new_tokens=2,
                pad_token_id=-1,
                eos_token_id=-1,
                stopping_criteria=StoppingCriteriaList([NeverStop()]),
                prefill_buckets=[8],
            )

    def test_pad_token_outside_the_vocabulary_one_prompt(self):
        # Never fed to the model: exact, as upstream.
        input_ids = random_batch_ids(1, 5)
        expected = self.model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=500)
        actual = prefill_buckets.generate(
            self.model, input_ids, max_new_tokens=4, do_sample=False, pad_token_id=500, prefill_buckets=[8]
        )
        self.assertSameIds(actual, expected)

    @parameterized.expand([("fits", 40, 64), ("bucket_past_the_end", 50, 64), ("prompt_past_the_end", 70, 70)])
    def test_bucket_capped_at_max_positions(self, _, length, padded):
        clear_warning_once()  # the capped-bucket warning is logged once per process: every capped prompt shares it
        model = tiny_llama(max_position_embeddings=64)
        input_ids = random_batch_ids(1, length)
        seen = []
        handle = model.register_forward_pre_hook(
            lambda m, a, k: seen.append(k["input_ids"].shape[1]), with_kwargs=True
        )
        self.addCleanup(handle.remove)
        with CaptureLogger(package_logger) as logs:
            actual = prefill_buckets.generate(
                model, input_ids, max_new_tokens=3, do_sample=False, prefill_buckets=[32, 128]
            )
        self.assertEqual(seen[0], padded)
        if length <= 64 < 128:
            self.assertIn("more positions than the model has", logs.out)
        seen.clear()
        expected = model.generate(input_ids, max_new_tokens=3, do_sample=False)
        self.assertEqual(seen[0], length)
        self.assertSameIds(actual, expected)

    def test_no_max_length_reminder_caused_by_padding(self):
        # 20 tokens + 3 new fit in 64 positions; the padded sequence (64 + 3) does not, but takes no more positions.
        model = tiny_llama(max_position_embeddings=64)
        from transformers.generation.stopping_criteria import logger as criteria_logger

        reminder = "exceeded the model's predefined maximum length"
        # Positive control: the reminder is a `warning_once`, so clear what earlier tests logged; an unpadded call
        # that does pass the model's positions (63 + 3 > 64) logs it.
        clear_warning_once()
        with CaptureLogger(criteria_logger) as logs:
            model.generate(random_batch_ids(1, 63), max_new_tokens=3, do_sample=False)
        self.assertIn(reminder, logs.out)
        clear_warning_once()
        with CaptureLogger(criteria_logger) as logs:
            prefill_buckets.generate(model, random_batch_ids(1, 20), max_new_tokens=3, prefill_buckets=[64])
        self.assertNotIn(reminder, logs.out)

    def test_padded_batch_without_mask_pad_is_eos(self):
        # The padding can't be told from the ids: upstream attends it (and warns); so does the bucketed call.
        model = tiny_llama(pad_token_id=1)
        input_ids = random_batch_ids(2, 6)
        input_ids[1, :2] = 1
        expected = model.generate(input_ids, max_new_tokens=3, do_sample=False)
        clear_warning_once()
        with CaptureLogger(package_logger) as logs:
            actual = prefill_buckets.generate(model, input_ids, max_new_tokens=3, do_sample=False, prefill_buckets=[8])
        self.assertSameIds(actual, expected)
        self.assertIn("can't be inferred from `input_ids`", logs.out)

    def test_padded_batch_without_mask_inferred(self):
        input_ids = random_batch_ids(2, 6)
        input_ids[1, :2] = 0
        expected = self.model.generate(input_ids, attention_mask=input_ids.ne(0).long(), max_new_tokens=3)
        clear_warning_once()  # else an earlier test's warning would make the check below pass vacuously
        with CaptureLogger(package_logger) as logs:
            actual = prefill_buckets.generate(self.model, input_ids, max_new_tokens=3, prefill_buckets=[8])
        self.assertSameIds(actual, expected)
        self.assertNotIn("can't be inferred", logs.out)


class CacheRoomTest(RobustnessTestBase):
    """
    A static cache shorter than the bucket plus the new tokens (issue 27). A 10-token prompt with 8 new tokens needs
    17 slots unpadded, and 23 padded on the left to 16: the call is planned against the cache it will write.
    """

    def config(self, **kwargs):
        return GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=False, **kwargs)

    def test_cache_passed_in_too_short_runs_unpadded(self):
        # Padded, it wrote past the cache's end (`index_copy_(): index 20 is out of bounds`); upstream runs.
        input_ids = random_batch_ids(1, 10)
        expected = UPSTREAM_GENERATE(
            self.model, input_ids, generation_config=self.config(), **{CACHE: StaticCache(self.model.config, 20)}
        )
        clear_warning_once()
        with CaptureLogger(package_logger) as captured:
            out = prefill_buckets.generate(
                self.model,
                input_ids,
                generation_config=self.config(),
                prefill_buckets=[16],
                prefill_padding_side="left",
                **{CACHE: StaticCache(self.model.config, 20)},
            )
        self.assertSameIds(out, expected)
        self.assertIn("the cache passed in has 20 slots, fewer than the 23 the padded call needs", captured.out)
        self.assertIn("runs unpadded", captured.out)

    def test_continued_cache_too_short_raises_naming_both(self):
        # The cache holds the first turn's padding, which the next turn must be padded by too: it can't run unpadded.
        first = self.config(cache_implementation="static", max_cache_len=32, return_dict_in_generate=True)
        out = prefill_buckets.generate(
            self.model,
            random_batch_ids(1, 9),
            generation_config=first,
            prefill_buckets=[16],
            prefill_padding_side="left",
        )
        conversation = torch.cat([out.sequences, random_batch_ids(1, 10, seed=1)], dim=1)  # 27 tokens, 7 pads in front
        with self.assertRaisesRegex(ValueError, "has 32 slots, fewer than the 41 this call needs"):
            prefill_buckets.generate(
                self.model,
                conversation,
                generation_config=self.config(),
                prefill_buckets=[16],
                **{CACHE: out[CACHE]},
            )

    def test_pinned_max_cache_len_too_short_says_so(self):
        # Upstream sizes the cache by what the call needs, past the pin: exact, in a cache shape of its own.
        input_ids = random_batch_ids(1, 10)
        config = self.config(cache_implementation="static", max_cache_len=17)
        expected = UPSTREAM_GENERATE(self.model, input_ids, generation_config=config)
        clear_warning_once()
        with CaptureLogger(package_logger) as captured:
            out = prefill_buckets.generate(
                self.model, input_ids, generation_config=config, prefill_buckets=[16], prefill_padding_side="left"
            )
        self.assertSameIds(out, expected)
        self.assertIn("`max_cache_len=17` is smaller than the 23 static cache slots this call needs", captured.out)


class FailingBackend:
    """A backend that raises for graphs with a `[batch, fail_length]` integer input (a prefill), else runs eagerly."""

    def __init__(self, fail_length: int):
        self.fail_length = fail_length
        self.failures = 0
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm, example_inputs, **kwargs):
        for tensor in example_inputs:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dtype == torch.long
                and tensor.ndim == 2
                and tensor.shape[-1] == self.fail_length
            ):
                self.failures += 1
                raise RuntimeError(f"cannot compile length {self.fail_length}")
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run

    def __deepcopy__(self, memo):
        return self


class BackendFailureTest(RobustnessTestBase):
    LENGTHS = (5, 20, 9, 25, 12)

    def compile(self, entry_point: str, backend):
        """(model or wrapper to generate with, extra generate kwargs)"""
        options = {"backend": backend, "dynamic": False, "fullgraph": True}
        if entry_point == "model.compile":
            self.model.compile(**options)
            return self.model, {}
        if entry_point == "compiled_forward":
            self.model.forward = torch.compile(self.model.forward, **options)
            return self.model, {}
        if entry_point == "wrapper":
            return torch.compile(self.model, **options), {}
        return self.model, {"compile_config": CompileConfig(**options)}

    @parameterized.expand([(e,) for e in ("model.compile", "compiled_forward", "wrapper", "compile_config")])
    def test_failing_bucket_runs_eagerly(self, entry_point):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        reference = tiny_llama()
        backend = FailingBackend(fail_length=32)
        model, extra = self.compile(entry_point, backend)
        config = GenerationConfig(cache_implementation="static", max_new_tokens=4, do_sample=False)
        with CaptureLogger(compilation_logger) as logs:
            for length in self.LENGTHS:
                input_ids = random_batch_ids(1, length, seed=length)
                actual = prefill_buckets.generate(
                    model, input_ids, generation_config=config, prefill_buckets=[16, 32], **extra
                )
                expected = reference.generate(input_ids, generation_config=config)
                self.assertSameIds(actual, expected)
        self.assertEqual(logs.out.count("Compiling the forward failed in the backend"), 1, logs.out)
        self.assertIn("cannot compile length 32", logs.out)
        self.assertEqual(backend.failures, 1)  # the failed shape is not tried again
        self.assertGreater(backend.calls, 0)  # the other bucket, and decode, stay compiled

    def test_graph_break_after_the_cache_moved_raises(self):
        # A failed attempt that already advanced the cache can't be re-run: the error is raised, with a note.
        class Layer:
            cumulative_length = 0

        class Cache:
            layers = [Layer()]

        cache = Cache()

        def compiled(**kwargs):
            kwargs["past_key_values"].layers[0].cumulative_length += 4  # ran before the graph break
            raise torch._dynamo.exc.BackendCompilerFailed(lambda: None, RuntimeError("boom"), None)

        eager_calls = []
        fallback = EagerFallback(self.model, compiled, lambda **kwargs: eager_calls.append(kwargs))
        with self.assertRaises(torch._dynamo.exc.BackendCompilerFailed) as raised:
            fallback(input_ids=torch.ones(1, 4, dtype=torch.long), past_key_values=cache)
        self.assertIn("left the cache untouched", "\n".join(getattr(raised.exception, "__notes__", [])))
        self.assertEqual(eager_calls, [])

    def test_failure_before_anything_ran_falls_back(self):
        class Layer:
            cumulative_length = torch.tensor(3)

        class Cache:
            layers = [Layer()]

        def compiled(**kwargs):
            raise torch._dynamo.exc.BackendCompilerFailed(lambda: None, RuntimeError("boom"), None)

        fallback = EagerFallback(self.model, compiled, lambda **kwargs: "eager")
        inputs = {"input_ids": torch.ones(1, 4, dtype=torch.long), "past_key_values": Cache()}
        self.assertEqual(fallback(**inputs), "eager")
        self.assertEqual(fallback(**inputs), "eager")  # remembered: not compiled again
