# Property-based: for random prompt lengths, batch compositions and bucket policies, bucketed `generate` returns
# what upstream `generate` returns on the same (unpadded) inputs, and the stripped outputs keep their shapes.

import unittest

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prefill_buckets
from prefill_buckets.buckets import BucketPolicy

from .tiny_models import get_model


VOCAB, PAD = 128, 0
# Rotary positions, absolute position embeddings, and a sliding window (8) shorter than most prompts.
ARCHITECTURES = ("llama", "gpt2_pad", "mistral_sliding")


def increasing(values):
    return sorted(set(values))


bucket_lists = st.lists(st.integers(1, 48), min_size=1, max_size=4).map(increasing)
policies = st.one_of(
    st.fixed_dictionaries({"prefill_buckets": bucket_lists}),
    st.fixed_dictionaries({"prefill_buckets": st.just("pow2")}),
    st.fixed_dictionaries({"prefill_pad_to_multiple_of": st.integers(1, 24)}),
    st.fixed_dictionaries({"prefill_buckets": bucket_lists, "prefill_pad_to_multiple_of": st.integers(1, 16)}),
    st.fixed_dictionaries({"prefill_buckets": st.just("pow2"), "prefill_pad_to_multiple_of": st.integers(1, 16)}),
)
batch_buckets = st.one_of(
    st.none(), st.just("pow2"), st.lists(st.integers(1, 6), min_size=1, max_size=3).map(increasing)
)


def left_padded(lengths: list[int], generator: torch.Generator, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of `lengths` random ids in `[3, high)`, left-padded to the longest with `PAD`: `(input_ids, mask)`."""
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, high, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


@st.composite
def batches(draw):
    """A batch of prompts of random lengths, left-padded to the longest with a mask, as a tokenizer does."""
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    return left_padded(lengths, generator, high=VOCAB)


class PropertiesTestCase(unittest.TestCase):
    def setUp(self):
        prefill_buckets.disable()
        # Tiny model: one thread is as fast, and steadier on a loaded machine.
        self.addCleanup(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(1)


class BucketedGenerationPropertiesTest(PropertiesTestCase):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        architecture=st.sampled_from(ARCHITECTURES),
        batch=batches(),
        policy=policies,
        batch_policy=batch_buckets,
        max_new_tokens=st.integers(1, 5),
        cache_implementation=st.sampled_from([None, "static"]),
        outputs=st.booleans(),
    )
    def test_same_as_unpadded_run(
        self, architecture, batch, policy, batch_policy, max_new_tokens, cache_implementation, outputs
    ):
        model = get_model(architecture)
        input_ids, attention_mask = batch
        kwargs = {
            "attention_mask": attention_mask,
            "max_new_tokens": max_new_tokens,
            "do_sample": False,
            "cache_implementation": cache_implementation,
            "return_dict_in_generate": outputs,
            "output_scores": outputs,
            "output_hidden_states": outputs,
        }
        expected = model.generate(input_ids, **kwargs)
        actual = prefill_buckets.generate(
            model, input_ids, **kwargs, **policy, **({"prefill_batch_buckets": batch_policy} if batch_policy else {})
        )
        sequences = actual.sequences if outputs else actual
        expected_sequences = expected.sequences if outputs else expected
        # Shape invariants: the user's rows, the prompt as passed, then the new tokens.
        self.assertEqual(sequences.shape[0], input_ids.shape[0])
        self.assertTrue(torch.equal(sequences[:, : input_ids.shape[1]], input_ids))
        self.assertLessEqual(sequences.shape[1], input_ids.shape[1] + max_new_tokens)
        self.assertTrue(torch.equal(sequences, expected_sequences), f"{policy}\n{sequences}\n!=\n{expected_sequences}")
        if not outputs:
            return
        self.assertEqual(len(actual.scores), len(expected.scores))
        for got, want in zip(actual.scores, expected.scores):
            self.assertEqual(got.shape, want.shape)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        self.assertEqual(len(actual.hidden_states), len(expected.hidden_states))
        for step, (got_layers, want_layers) in enumerate(zip(actual.hidden_states, expected.hidden_states)):
            for got, want in zip(got_layers, want_layers):
                self.assertEqual(got.shape, want.shape, f"step {step}")
                # Rows' real tokens agree; the user's own left padding gives arbitrary (unused) states.
                mask = attention_mask.bool() if step == 0 else torch.ones(got.shape[:2], dtype=torch.bool)
                torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)

    @settings(max_examples=200, deadline=None)
    @given(policy=policies, length=st.integers(1, 300))
    def test_padded_length(self, policy, length):
        # The bucket holds the prompt, is aligned, and (for a listed bucket) is the smallest that holds it.
        bucket_policy = BucketPolicy(
            buckets=policy.get("prefill_buckets"), pad_to_multiple_of=policy.get("prefill_pad_to_multiple_of")
        )
        padded = bucket_policy.bucket(length)
        self.assertGreaterEqual(padded, length)
        multiple = policy.get("prefill_pad_to_multiple_of")
        if multiple is not None:
            self.assertEqual(padded % multiple, 0)
        buckets = policy.get("prefill_buckets")
        if isinstance(buckets, list) and length <= buckets[-1] and multiple is None:
            self.assertEqual(padded, min(b for b in buckets if b >= length))
        self.assertEqual(bucket_policy.bucket(padded), padded)  # a padded prompt stays where it is


# Generation settings the fields must leave exact, each drawn or left out: logits processors that read token content or
# count lengths, sampling warpers, decoding modes, and the prompt as ids or embeddings.
SETTINGS = {
    "temperature": st.sampled_from([0.5, 1.3]),
    "top_k": st.sampled_from([0, 5]),
    "top_p": st.just(0.8),
    "repetition_penalty": st.sampled_from([0.7, 1.5]),
    "no_repeat_ngram_size": st.integers(1, 3),
    "sequence_bias": st.just({(5,): 4.0, (PAD,): 3.0, (6, 7): 2.0}),
    "suppress_tokens": st.just([5, 6, 7]),
    "begin_suppress_tokens": st.just([5, 6]),
    "bad_words_ids": st.just([[8], [9, 10]]),
    "forced_eos_token_id": st.just(1),
    "min_new_tokens": st.integers(1, 3),
    "exponential_decay_length_penalty": st.just((2, 1.5)),
    "renormalize_logits": st.just(True),
}
MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True},
    "beams": {"do_sample": False, "num_beams": 2, "num_return_sequences": 2},
    "prompt_lookup": {"prompt_lookup_num_tokens": 3},
    "assisted": {"assistant_model": "llama"},
}


@st.composite
def prompts(draw, rows: int):
    """Ids of `rows` prompts of random lengths (left-padded with a mask), some repeating a few ids (lookup matches)."""
    lengths = draw(st.lists(st.integers(1, 30), min_size=rows, max_size=rows))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    alphabet = draw(st.sampled_from([VOCAB, 8]))  # 8: ids 3..10 only, so n-grams repeat
    return left_padded(lengths, generator, high=min(VOCAB, 3 + alphabet))


class GenerationSettingsPropertiesTest(PropertiesTestCase):
    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_same_as_unpadded_run(self, data):
        architecture = data.draw(st.sampled_from(ARCHITECTURES + ("gpt2_no_pad",)), "architecture")
        mode = data.draw(st.sampled_from(sorted(MODES)), "mode")
        rows = 1 if mode in ("prompt_lookup", "assisted") else data.draw(st.integers(1, 3), "rows")
        input_ids, attention_mask = data.draw(prompts(rows), "prompt")
        names = data.draw(st.sets(st.sampled_from(sorted(SETTINGS)), max_size=4), "settings")
        chosen = {name: data.draw(SETTINGS[name], name) for name in sorted(names)}
        policy = data.draw(policies, "policy")
        embeds = data.draw(st.booleans(), "inputs_embeds")
        cache_implementation = data.draw(st.sampled_from([None, "static"]), "cache_implementation")
        seed = data.draw(st.integers(0, 2**16), "seed")

        model = get_model(architecture)
        kwargs = {
            "attention_mask": attention_mask,
            "max_new_tokens": data.draw(st.integers(1, 6), "max_new_tokens"),
            "cache_implementation": cache_implementation,
            "return_dict_in_generate": True,
            "output_scores": True,
            "pad_token_id": model.generation_config.pad_token_id,
            **MODES[mode],
            **chosen,
        }
        if mode == "assisted":
            kwargs["assistant_model"] = get_model(kwargs["assistant_model"])
        if mode in ("assisted", "prompt_lookup") and cache_implementation == "static":
            # Upstream's own cache (prompt + new tokens, or a longer one an earlier call left) can be too short for the
            # candidates past the last token: an IndexError, or not, as earlier examples ran. Pinned on both sides.
            kwargs["max_cache_len"] = 96
        prompt = (
            {"inputs_embeds": model.get_input_embeddings()(input_ids).detach()} if embeds else {"inputs": input_ids}
        )

        def run(generate, **fields):
            torch.manual_seed(seed)
            try:
                return generate(**prompt, **kwargs, **fields)
            except Exception as error:  # the same error as upstream's is the same outcome
                return error

        expected = run(model.generate)
        actual = run(lambda **arguments: prefill_buckets.generate(model, **arguments), **policy)
        if isinstance(expected, Exception) or isinstance(actual, Exception):
            self.assertIs(type(actual), type(expected), f"{actual!r} != {expected!r}")
            return
        self.assertTrue(
            torch.equal(actual.sequences, expected.sequences), f"\n{actual.sequences}\n!=\n{expected.sequences}"
        )
        self.assertEqual(len(actual.scores), len(expected.scores))
        for got, want in zip(actual.scores, expected.scores):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
