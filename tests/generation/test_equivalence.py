# The contract of bucketed generation: `prefill_buckets.generate` returns exactly what upstream `generate` returns on
# the unpadded prompt (same ids, same shape, same per-step outputs), on tiny random models of several architectures,
# while the model really sees the padded prompt.

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig, masking_utils
from transformers.generation.streamers import BaseStreamer

import prefill_buckets
from prefill_buckets.call.hooks import HOOKS

from .tiny_models import (
    EOS,
    UPSTREAM_IGNORE_CAUSAL_MASK_SDPA,
    ForwardRecorder,
    get_model,
    left_padded_batch,
    random_batch_ids,
    single_thread_module,
)


MAX_NEW_TOKENS = 4


setUpModule, tearDownModule = single_thread_module()


# The bucket policies under test and the bucket each gives, computed by hand (not by `BucketPolicy`).
POLICIES = {
    "list": {"prefill_buckets": [8, 16, 32, 64]},
    "pow2": {"prefill_buckets": "pow2"},
    "multiple8": {"prefill_pad_to_multiple_of": 8},
}


def expected_bucket(policy: str, length: int) -> int:
    if policy == "list":
        return next((b for b in (8, 16, 32, 64) if b >= length), -(-length // 64) * 64)
    if policy == "pow2":
        return 1 << (length - 1).bit_length()
    if policy == "multiple8":
        return -(-length // 8) * 8
    raise ValueError(policy)


LENGTHS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63]
# The lengths every architecture runs: length 1, exact fits, just above a bucket, each policy. The whole
# LENGTHS x POLICIES matrix runs on the architectures of `AllLengthsMixin`.
SOME_LENGTHS = [("list", 1), ("list", 8), ("list", 9), ("list", 33), ("pow2", 3), ("pow2", 17), ("multiple8", 9)]


class AttentionMaskRecorder:
    """Pre-hook on the first attention layer: the mask that reaches attention (`None` when upstream skips it)."""

    def __init__(self, model):
        self.masks = []
        layer = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
        self.handle = layer.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        self.masks.append(None if mask is None else (tuple(mask.shape), mask.dtype))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.values = []
        self.ends = 0

    def put(self, value):
        self.values.append(value.clone())

    def end(self):
        self.ends += 1


class BucketedGenerationTestBase:
    """Shared setup and helpers of the test mixins below, which run every test on `model_name`."""

    model_name: str

    @classmethod
    def setUpClass(cls):
        prefill_buckets.disable()  # `model.generate` must be upstream's for the reference runs
        cls.model = get_model(cls.model_name)
        cls.pad_token_id = cls.model.generation_config.pad_token_id
        # Fill for the user's own padding. With no pad token, the user pads with any id and passes the mask.
        cls.user_pad_id = cls.pad_token_id if cls.pad_token_id is not None else 0

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        self.addCleanup(self.assertNoHooksLeft, self.model)

    def assertNoHooksLeft(self, model):
        for name in tuple(HOOKS):
            self.assertNotIn(name, model.__dict__)
        self.assertIs(masking_utils._ignore_causal_mask_sdpa, UPSTREAM_IGNORE_CAUSAL_MASK_SDPA)

    def generate_pair(self, policy: dict, seed: int | None = None, model=None, **kwargs):
        """(bucketed output, first forward length), (unpadded output, first forward length)."""
        model = self.model if model is None else model
        results = []
        for bucketed in (True, False):
            with ForwardRecorder(model) as recorder:
                if seed is not None:
                    torch.manual_seed(seed)
                if bucketed:
                    output = prefill_buckets.generate(model, **kwargs, **policy)
                else:
                    output = model.generate(**kwargs)
            results.append((output, recorder.first_length))
        return results

    def assertSameTensor(self, actual, expected, msg=None):
        self.assertEqual(tuple(actual.shape), tuple(expected.shape), msg)
        self.assertTrue(torch.equal(actual, expected), f"{msg or ''}\n{actual}\n!=\n{expected}")

    def assertSameSteps(self, actual, expected, name, atol=1e-4):
        self.assertIsNotNone(actual, name)
        self.assertEqual(len(actual), len(expected), name)
        for step, (a, e) in enumerate(zip(actual, expected)):
            self.assertEqual(a.shape, e.shape, f"{name}[{step}]")
            torch.testing.assert_close(a, e, atol=atol, rtol=1e-4, msg=f"{name}[{step}]")

    def assertSameOutput(self, actual, expected):
        if isinstance(expected, torch.Tensor):
            self.assertIsInstance(actual, torch.Tensor)
            self.assertSameTensor(actual, expected)
            return
        self.assertEqual(type(actual), type(expected))
        self.assertSameTensor(actual.sequences, expected.sequences)
        for name in ("scores", "logits"):
            if expected.get(name) is not None:
                self.assertSameSteps(actual.get(name), expected.get(name), name)
        if expected.get("sequences_scores") is not None:
            torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=1e-4)
        if expected.get("beam_indices") is not None:
            self.assertSameTensor(actual.beam_indices, expected.beam_indices)

    def check_single_prompt(self, policy, length):
        input_ids = random_batch_ids(1, length, seed=length)
        (bucketed, seen), (plain, plain_seen) = self.generate_pair(
            POLICIES[policy], input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        self.assertEqual(plain_seen, length)
        self.assertEqual(seen, expected_bucket(policy, length))
        self.assertSameOutput(bucketed, plain)
        self.assertEqual(tuple(bucketed.shape), (1, length + MAX_NEW_TOKENS))
        self.assertSameTensor(bucketed[:, :length], input_ids)

    def _early_eos(self, input_ids, attention_mask=None):
        """The first token the model emits for row 0: an eos it would stop on at once."""
        kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
        out = self.model.generate(input_ids, max_new_tokens=1, do_sample=False, **kwargs)
        return out[0, -1].item()

    def check_long_prompt(self, policy, bucket):
        input_ids = random_batch_ids(1, 70, seed=70)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES[policy], input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        self.assertEqual(seen, bucket)
        self.assertSameOutput(bucketed, plain)


class BucketedGenerationTesterMixin(BucketedGenerationTestBase):
    """The core: greedy, sampling and beam search, single prompts and batches, both caches, lengths, eos."""

    @parameterized.expand([(f"{policy}_{length}", policy, length) for policy, length in SOME_LENGTHS])
    def test_single_prompt(self, _, policy, length):
        self.check_single_prompt(policy, length)

    def test_prompt_longer_than_largest_bucket(self):
        self.check_long_prompt("list", 128)

    @parameterized.expand([(length,) for length in (1, 8, 33)])
    def test_static_cache(self, length):
        input_ids = random_batch_ids(1, length, seed=length)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            input_ids=input_ids,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            cache_implementation="static",
        )
        self.assertEqual(seen, expected_bucket("list", length))
        self.assertSameOutput(bucketed, plain)

    @parameterized.expand(
        [("list_dynamic", "list", "dynamic"), ("list_static", "list", "static"), ("pow2", "pow2", "dynamic")]
    )
    def test_batch_left_padded_by_user(self, _, policy, cache):
        lengths = (3, 7, 12)
        input_ids, attention_mask = left_padded_batch(lengths, self.user_pad_id, seed=1)
        cache_kwargs = {"cache_implementation": "static"} if cache == "static" else {}
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES[policy],
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            **cache_kwargs,
        )
        self.assertEqual(seen, expected_bucket(policy, 12))
        self.assertSameOutput(bucketed, plain)
        # The user's padding is kept, as upstream returns it.
        self.assertEqual(tuple(bucketed.shape), (3, 12 + MAX_NEW_TOKENS))
        self.assertSameTensor(bucketed[:, :12], input_ids)

    @parameterized.expand([("single", 1, 0), ("batch", 3, 2)])
    def test_sampling(self, _, batch_size, seed):
        if batch_size == 1:
            input_ids, attention_mask = random_batch_ids(1, 6, seed=seed), None
        else:
            input_ids, attention_mask = left_padded_batch((2, 6, 10), self.user_pad_id, seed=seed)
        kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            seed=seed,
            input_ids=input_ids,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            **kwargs,
        )
        self.assertEqual(seen, expected_bucket("list", input_ids.shape[1]))
        self.assertSameOutput(bucketed, plain)

    @parameterized.expand([("one_sequence", 1), ("two_sequences", 2)])
    def test_beam_search(self, _, num_return_sequences):
        input_ids, attention_mask = left_padded_batch((4, 9), self.user_pad_id, seed=4)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            num_beams=3,
            num_return_sequences=num_return_sequences,
            return_dict_in_generate=True,
            output_scores=True,
        )
        self.assertEqual(seen, 16)
        self.assertSameOutput(bucketed, plain)
        self.assertEqual(bucketed.sequences.shape[0], 2 * num_return_sequences)

    @parameterized.expand([("single", 1), ("batch", 3)])
    def test_max_length(self, _, batch_size):
        if batch_size == 1:
            input_ids, kwargs = random_batch_ids(1, 5, seed=5), {}
        else:
            input_ids, attention_mask = left_padded_batch((3, 5, 10), self.user_pad_id, seed=5)
            kwargs = {"attention_mask": attention_mask}
        prompt_length = input_ids.shape[1]
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"], input_ids=input_ids, max_length=prompt_length + 5, do_sample=False, **kwargs
        )
        self.assertEqual(seen, expected_bucket("list", prompt_length))
        self.assertSameOutput(bucketed, plain)
        self.assertEqual(bucketed.shape[1], prompt_length + 5)

    @parameterized.expand(
        [
            ("no_minimum_single", None, 1),
            ("no_minimum_batch", None, 3),
            ("min_new_tokens_batch", "min_new_tokens", 3),
            ("min_length_single", "min_length", 1),
        ]
    )
    def test_eos_and_minimum_lengths(self, _, minimum, batch_size):
        if batch_size == 1:
            input_ids, attention_mask = random_batch_ids(1, 6, seed=6), None
        else:
            input_ids, attention_mask = left_padded_batch((6, 3, 9), self.user_pad_id, seed=6)
        prompt_length = input_ids.shape[1]
        eos = self._early_eos(input_ids, attention_mask)
        kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
        if minimum == "min_length":
            kwargs["min_length"] = prompt_length + 5
        elif minimum == "min_new_tokens":
            kwargs["min_new_tokens"] = 5
        # Much more padding than prompt: a minimum length left in unpadded terms would be over before decoding.
        (bucketed, seen), (plain, _) = self.generate_pair(
            {"prefill_buckets": [32]},
            input_ids=input_ids,
            max_new_tokens=7,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=self.user_pad_id if self.user_pad_id != eos else 3,
            **kwargs,
        )
        self.assertEqual(seen, 32)
        self.assertSameOutput(bucketed, plain)
        generated = plain[0, prompt_length:].tolist()
        if minimum is None:
            self.assertEqual(generated[0], eos)
            if batch_size == 1:
                self.assertEqual(plain.shape[1], prompt_length + 1)
        else:
            # The minimum held eos back for 5 new tokens.
            self.assertGreaterEqual(plain.shape[1], prompt_length + 5)
            self.assertNotIn(eos, generated[:5])

    @parameterized.expand([("single", 1), ("batch", 3)])
    def test_inputs_embeds(self, _, batch_size):
        if batch_size == 1:
            input_ids = random_batch_ids(1, 5, seed=21)
            attention_mask = torch.ones_like(input_ids)
        else:
            input_ids, attention_mask = left_padded_batch((2, 5, 10), self.user_pad_id, seed=21)
        inputs_embeds = self.model.get_input_embeddings()(input_ids).detach()
        (bucketed, seen), (plain, plain_seen) = self.generate_pair(
            POLICIES["list"],
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
        )
        self.assertEqual(plain_seen, input_ids.shape[1])
        self.assertEqual(seen, expected_bucket("list", input_ids.shape[1]))
        self.assertSameOutput(bucketed, plain)

    def test_streamer(self):
        input_ids = random_batch_ids(1, 5, seed=31)
        streamers = []
        for bucketed in (True, False):
            streamer = RecordingStreamer()
            kwargs = {"input_ids": input_ids, "max_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
            with ForwardRecorder(self.model) as recorder:
                if bucketed:
                    out = prefill_buckets.generate(self.model, streamer=streamer, **kwargs, **POLICIES["list"])
                    self.assertEqual(recorder.first_length, 8)
                else:
                    out = self.model.generate(streamer=streamer, **kwargs)
            streamers.append((streamer, out))
        (streamer, out), (plain_streamer, plain_out) = streamers
        self.assertSameOutput(out, plain_out)
        # The prompt comes first, exactly as the user passed it: no added columns.
        self.assertSameTensor(streamer.values[0], input_ids)
        self.assertEqual(len(streamer.values), len(plain_streamer.values))
        for step, (value, expected) in enumerate(zip(streamer.values, plain_streamer.values)):
            self.assertSameTensor(value, expected, f"put #{step}")
        self.assertEqual(streamer.ends, 1)
        self.assertEqual(len(streamer.values), 1 + MAX_NEW_TOKENS)


class GenerationOutputsTesterMixin(BucketedGenerationTestBase):
    """Per-step outputs, other ways to pass inputs and config, and what a call must leave untouched."""

    def test_attention_mask_passed_explicitly(self):
        input_ids = random_batch_ids(1, 5, seed=5)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
        )
        self.assertEqual(seen, 8)
        self.assertSameOutput(bucketed, plain)

    def test_generation_config_argument(self):
        # The fields on a `generation_config` passed to the call (not enabled: stored as unknown fields).
        config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, prefill_buckets=[16])
        plain_config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        input_ids = random_batch_ids(1, 5, seed=5)
        with ForwardRecorder(self.model) as recorder:
            bucketed = prefill_buckets.generate(self.model, input_ids, generation_config=config)
        self.assertEqual(recorder.first_length, 16)
        plain = self.model.generate(input_ids, generation_config=plain_config)
        self.assertSameOutput(bucketed, plain)

    def test_same_signature_in_a_bucket(self):
        # On the right (issue 12) an exact fit and a padded prompt reach the model (and its attention) with the same
        # inputs and shapes, and no mask. On the left an eager forward gets upstream's inputs: the padded prompt
        # carries the mask, and the exact fit reaches the model as upstream's unpadded call does (one signature buys
        # an eager forward nothing). Compiled, the left's exact fit shares its bucket's graphs: test_compile_counts
        # counts them (LENGTHS_IN_BUCKET_16, DynamicCacheBucketTest).
        for cache_implementation, side in ((None, "auto"), ("static", "left"), ("static", "right")):
            signatures = []
            for length in (8, 5):
                with ForwardRecorder(self.model) as forwards, AttentionMaskRecorder(self.model) as masks:
                    prefill_buckets.generate(
                        self.model,
                        random_batch_ids(1, length, seed=length),
                        prefill_buckets=[8],
                        prefill_padding_side=side,
                        max_new_tokens=3,
                        do_sample=False,
                        cache_implementation=cache_implementation,
                    )
                signature = [(call["shapes"], call["none"]) for call in forwards.calls]
                if cache_implementation == "static" and side == "right":
                    # The static cache's 4D mask is built outside the forward, and reaches attention the same way.
                    # (With a dynamic cache the forward builds it; compiled, upstream never skips it: not checked.)
                    signature.append(tuple(masks.masks))
                signatures.append(signature)
            if side == "right":
                self.assertEqual(signatures[0], signatures[1], cache_implementation)
                self.assertNotIn("attention_mask", signatures[0][0][0], cache_implementation)
                continue
            self.assertIn("attention_mask", signatures[1][0][0], cache_implementation)
            with ForwardRecorder(self.model) as forwards:
                self.model.generate(
                    random_batch_ids(1, 8, seed=8),
                    max_new_tokens=3,
                    do_sample=False,
                    cache_implementation=cache_implementation,
                )
            upstream = [(call["shapes"], call["none"]) for call in forwards.calls]

            def queries(signature):  # a static mask's key axis is the cache's length, which the buckets size
                def no_keys(shape):  # a mask's shape, or a dict of them (one per attention type)
                    return {k: v[:-1] for k, v in shape.items()} if isinstance(shape, dict) else shape[:-1]

                return [
                    ({k: no_keys(v) if k == "attention_mask" else v for k, v in s.items()}, n) for s, n in signature
                ]

            self.assertEqual(queries(signatures[0]), queries(upstream), cache_implementation)

    def test_batch_mask_inferred_from_pad_token(self):
        # No attention_mask: upstream infers it from the pad tokens in the prompt, and so must the padded call.
        if self.pad_token_id is None:
            self.skipTest("the model has no pad token to infer a mask from")
        input_ids, _ = left_padded_batch((2, 6, 11), self.pad_token_id, seed=2)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"], input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        self.assertEqual(seen, 16)
        self.assertSameOutput(bucketed, plain)

    def test_batch_same_lengths(self):
        input_ids = random_batch_ids(3, 9, seed=9)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["pow2"], input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        self.assertEqual(seen, 16)
        self.assertSameOutput(bucketed, plain)

    def test_max_length_too_short_raises_like_upstream(self):
        input_ids = random_batch_ids(1, 5, seed=5)
        with self.assertRaises(ValueError) as upstream:
            self.model.generate(input_ids, max_length=5, do_sample=False)
        with self.assertRaises(ValueError) as bucketed:
            prefill_buckets.generate(self.model, input_ids, max_length=5, do_sample=False, **POLICIES["list"])
        self.assertEqual(str(bucketed.exception), str(upstream.exception))

    @parameterized.expand([("dynamic", None), ("static", "static")])
    def test_scores_and_logits(self, _, cache_implementation):
        input_ids, attention_mask = left_padded_batch((5, 11), self.user_pad_id, seed=11)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=True,
            cache_implementation=cache_implementation,
        )
        self.assertEqual(seen, 16)
        self.assertEqual(len(bucketed.scores), MAX_NEW_TOKENS)
        self.assertEqual(len(bucketed.logits), MAX_NEW_TOKENS)
        self.assertSameOutput(bucketed, plain)

    @parameterized.expand([("dynamic", None), ("static", "static")])
    def test_hidden_states(self, _, cache_implementation):
        input_ids, attention_mask = left_padded_batch((5, 11), self.user_pad_id, seed=12)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=4,
            do_sample=False,
            return_dict_in_generate=True,
            output_hidden_states=True,
            cache_implementation=cache_implementation,
        )
        self.assertEqual(seen, 16)
        self.assertSameOutput(bucketed, plain)
        self.assertEqual(len(bucketed.hidden_states), len(plain.hidden_states))
        for step, (b_layers, p_layers) in enumerate(zip(bucketed.hidden_states, plain.hidden_states)):
            self.assertEqual(len(b_layers), len(p_layers))
            for layer, (b, p) in enumerate(zip(b_layers, p_layers)):
                if step == 0:
                    self.assertEqual(b.shape[1], 11, f"prefill hidden states of layer {layer}")
                self.assertEqual(b.shape, p.shape, f"step {step} layer {layer}")
                # The user's pad positions are not compared: their values are not defined by the mask.
                torch.testing.assert_close(
                    b[attention_mask.bool()] if step == 0 else b,
                    p[attention_mask.bool()] if step == 0 else p,
                    atol=1e-4,
                    rtol=1e-4,
                    msg=f"step {step} layer {layer}",
                )

    def test_attentions_eager(self):
        model = get_model(self.model_name, "eager")
        self.addCleanup(self.assertNoHooksLeft, model)
        input_ids, attention_mask = left_padded_batch((5, 11), self.user_pad_id, seed=13)
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            model=model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=4,
            do_sample=False,
            return_dict_in_generate=True,
            output_attentions=True,
        )
        self.assertEqual(seen, 16)
        self.assertSameOutput(bucketed, plain)
        self.assertEqual(len(bucketed.attentions), len(plain.attentions))
        for step, (b_layers, p_layers) in enumerate(zip(bucketed.attentions, plain.attentions)):
            for layer, (b, p) in enumerate(zip(b_layers, p_layers)):
                self.assertEqual(b.shape, p.shape, f"step {step} layer {layer}")
                # Rows of the user's pad queries are not compared: their values are not defined by the mask.
                if step == 0:
                    rows = attention_mask.bool()[:, None, :, None].expand_as(p)
                    b, p = b[rows], p[rows]
                torch.testing.assert_close(b, p, atol=1e-4, rtol=1e-4, msg=f"step {step} layer {layer}")

    @parameterized.expand(
        [
            ("beam_search_static_cache", False, {"num_beams": 3, "cache_implementation": "static"}),
            ("sampling_two_sequences", False, {"do_sample": True, "top_k": 0, "num_return_sequences": 2}),
            ("no_cache", False, {"use_cache": False}),
            ("embeds_static_cache", True, {"cache_implementation": "static"}),
            ("embeds_max_length", True, {"max_length": 14, "max_new_tokens": None}),
            ("embeds_min_new_tokens", True, {"min_new_tokens": 3, "eos_token_id": "first"}),
        ]
    )
    def test_combinations(self, _, embeds, extra):
        input_ids, attention_mask = left_padded_batch((3, 7, 10), self.user_pad_id, seed=71)
        inputs = {"input_ids": input_ids}
        if embeds:
            inputs = {"inputs_embeds": self.model.get_input_embeddings()(input_ids).detach()}
        kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, **extra}
        if kwargs.get("eos_token_id") == "first":  # an eos that row 0 would emit at once
            kwargs["eos_token_id"] = self._early_eos(input_ids, attention_mask)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"], seed=0, attention_mask=attention_mask, **inputs, **kwargs
        )
        self.assertEqual(seen, 16)
        self.assertSameOutput(bucketed, plain)

    def test_inputs_embeds_without_mask(self):
        inputs_embeds = self.model.get_input_embeddings()(random_batch_ids(1, 5, seed=22)).detach()
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["pow2"], inputs_embeds=inputs_embeds, max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        self.assertEqual(seen, 8)
        self.assertSameOutput(bucketed, plain)

    def test_input_ids_and_inputs_embeds(self):
        input_ids = random_batch_ids(1, 5, seed=23)
        inputs_embeds = self.model.get_input_embeddings()(input_ids).detach()
        (bucketed, seen), (plain, _) = self.generate_pair(
            POLICIES["list"],
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
        )
        self.assertEqual(seen, 8)
        self.assertSameOutput(bucketed, plain)

    def test_inputs_are_not_modified(self):
        input_ids, attention_mask = left_padded_batch((3, 6), self.user_pad_id, seed=41)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        snapshot = {key: value.clone() for key, value in inputs.items()}
        config = GenerationConfig(max_new_tokens=4, do_sample=False, cache_implementation="static")
        config_before = config.to_dict()
        inputs_embeds = self.model.get_input_embeddings()(input_ids).detach()
        embeds_before = inputs_embeds.clone()

        prefill_buckets.generate(self.model, **inputs, generation_config=config, prefill_buckets=[16])
        prefill_buckets.generate(
            self.model,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            max_new_tokens=2,
            prefill_buckets=[16],
        )

        self.assertEqual(set(inputs), set(snapshot))
        self.assertIs(inputs["input_ids"], input_ids)
        self.assertIs(inputs["attention_mask"], attention_mask)
        for key, value in snapshot.items():
            self.assertSameTensor(inputs[key], value, key)
        self.assertSameTensor(inputs_embeds, embeds_before)
        self.assertEqual(config.to_dict(), config_before)
        self.assertIsNone(config.max_cache_len)

    def test_hooks_removed_after_an_error(self):
        with self.assertRaises(ValueError):
            prefill_buckets.generate(
                self.model, random_batch_ids(1, 5), max_length=3, do_sample=False, prefill_buckets=[8]
            )
        self.assertNoHooksLeft(self.model)
        # And the model still generates normally.
        input_ids = random_batch_ids(1, 5, seed=51)
        (bucketed, _), (plain, _) = self.generate_pair(
            POLICIES["list"], input_ids=input_ids, max_new_tokens=3, do_sample=False
        )
        self.assertSameOutput(bucketed, plain)

    def test_patched_generate(self):
        # The same through `model.generate` once enabled.
        input_ids, attention_mask = left_padded_batch((4, 10), self.user_pad_id, seed=61)
        plain = self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
        prefill_buckets.enable()
        with ForwardRecorder(self.model) as recorder:
            bucketed = self.model.generate(
                input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False, prefill_buckets=[32]
            )
        self.assertEqual(recorder.first_length, 32)
        self.assertSameOutput(bucketed, plain)


class AllLengthsMixin(BucketedGenerationTestBase):
    """Every length under every policy, on the architectures most sensitive to positions: a sliding window, GPT-2."""

    @parameterized.expand(
        [
            (f"{policy}_{length}", policy, length)
            for policy in POLICIES
            for length in LENGTHS
            if (policy, length) not in SOME_LENGTHS  # those run on every architecture
        ]
    )
    def test_all_lengths(self, _, policy, length):
        self.check_single_prompt(policy, length)

    @parameterized.expand([("multiple8", "multiple8", 72), ("pow2", "pow2", 128)])
    def test_prompt_longer_than_largest_bucket_other_policies(self, _, policy, bucket):
        self.check_long_prompt(policy, bucket)

    def test_list_with_alignment(self):
        # The buckets aligned to 8 are 16 and 24; 13 tokens fit in 16. Beyond the list the alignment alone decides.
        policy = {"prefill_buckets": [12, 24], "prefill_pad_to_multiple_of": 8}
        for length, bucket in ((5, 16), (13, 16), (17, 24), (30, 32)):
            input_ids = random_batch_ids(1, length, seed=length)
            (bucketed, seen), (plain, _) = self.generate_pair(
                policy, input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
            self.assertEqual(seen, bucket, length)
            self.assertSameOutput(bucketed, plain)


class LlamaBucketedGenerationTest(BucketedGenerationTesterMixin, GenerationOutputsTesterMixin, unittest.TestCase):
    model_name = "llama"


class Qwen3BucketedGenerationTest(BucketedGenerationTesterMixin, GenerationOutputsTesterMixin, unittest.TestCase):
    model_name = "qwen3"


class MistralSlidingWindowBucketedGenerationTest(
    BucketedGenerationTesterMixin, GenerationOutputsTesterMixin, AllLengthsMixin, unittest.TestCase
):
    model_name = "mistral_sliding"


class GemmaBucketedGenerationTest(BucketedGenerationTesterMixin, GenerationOutputsTesterMixin, unittest.TestCase):
    model_name = "gemma"


class Phi3BucketedGenerationTest(BucketedGenerationTesterMixin, GenerationOutputsTesterMixin, unittest.TestCase):
    model_name = "phi3"


class GPT2NoPadTokenBucketedGenerationTest(BucketedGenerationTesterMixin, unittest.TestCase):
    model_name = "gpt2_no_pad"

    def test_config_has_no_pad_token(self):
        self.assertIsNone(self.model.config.pad_token_id)
        self.assertIsNone(self.model.generation_config.pad_token_id)


class GPT2PadTokenBucketedGenerationTest(
    BucketedGenerationTesterMixin, GenerationOutputsTesterMixin, AllLengthsMixin, unittest.TestCase
):
    model_name = "gpt2_pad"


class LlamaNoPadTokenBucketedGenerationTest(BucketedGenerationTesterMixin, unittest.TestCase):
    model_name = "llama_no_pad"

    def test_config_has_no_pad_token(self):
        self.assertIsNone(self.model.config.pad_token_id)
        self.assertIsNone(self.model.generation_config.pad_token_id)
        self.assertEqual(self.model.generation_config.eos_token_id, EOS)


class LlamaNoPadNoEosBucketedGenerationTest(BucketedGenerationTesterMixin, unittest.TestCase):
    model_name = "llama_no_pad_no_eos"

    def test_config_has_no_pad_nor_eos_token(self):
        for config in (self.model.config, self.model.generation_config):
            self.assertIsNone(config.pad_token_id)
            self.assertIsNone(config.eos_token_id)


if __name__ == "__main__":
    unittest.main()
