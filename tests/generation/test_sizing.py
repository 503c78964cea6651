# The static cache allocated once per workload (`kvcache/sizing.py`: `keep_cache`, `reuse_cache`): upstream makes a new
# cache for every call, and allocating it costs time in proportion to its slots. A bucketed call that made its cache
# and did not hand it back leaves it to the next call.
#
# - Reuse: every call of a compiled workload (mixed lengths, both sides) runs on the same tensors, and its tokens are
#   an unpadded eager run's.
# - Zeroed: the slots a longer call wrote are zero again when a shorter call takes the tensors, as in a new cache.
# - Conversations and several models: a chat's own cache beside one-off calls, two models each with their own.
# - Not shared: a cache handed back (`return_dict_in_generate=True`) is never reused, nor a cache passed in; a change
#   of batch size or cache length allocates anew.
# - Eager calls: a cache their first forward allocated as early initialization would have is kept too, and a compiled
#   call that reuses it compiles nothing more; one of another shape or dtype is new every call.
# - Modes: a call under `torch.inference_mode()` and one outside it each take tensors made in their own mode.
# - Static addresses: each layer's length counter is kept with its keys and values, so every static input of the
#   compiled graphs stays where CUDA graphs recorded it.
# - Length: a static cache made without `max_cache_len` has one length for every prompt of a bucket
#   (`StaticCacheLengthTest`, moved from test_equivalence.py).

import copy
import unittest

import torch
from parameterized import parameterized
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    MistralConfig,
    MistralForCausalLM,
    StaticCache,
)

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.kvcache.sizing import early_initialize, reuse_cache
from prefill_buckets.state import state_of

from .tiny_models import CACHE, MODEL_SPECS, random_batch_ids, tiny_llama


NEW_TOKENS = 5


def prompt(length: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(length))


def config(side: str, **kwargs) -> GenerationConfig:
    fields = {"cache_implementation": "static", "prefill_buckets": [16, 32], "prefill_padding_side": side, **kwargs}
    return GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **fields)


def kept_keys(model):
    """The first layer's keys of the cache the model keeps for the next call, or `None`."""
    kept = state_of(model).kept_cache
    return kept.cache.layers[0].keys if kept is not None else None


class StaticAddresses:
    """
    A `torch.compile` backend (eager kernels) that checks what CUDA graphs rely on: on every later run of a graph, each
    input dynamo marks as a static address (`_dynamo_static_input_type`) is at the address of the graph's first run.
    It holds the first run's tensors, so that no new tensor can be given their memory.
    """

    def __init__(self):
        self.first: list[dict[int, torch.Tensor] | None] = []  # per graph: its static inputs at its first run
        self.moved: list[tuple[int, int]] = []  # (graph, input index) of each static input found elsewhere

    def __call__(self, gm, example_inputs, **kwargs):
        graph = len(self.first)
        self.first.append(None)

        def run(*args):
            static = {
                i: a
                for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and getattr(a, "_dynamo_static_input_type", None) is not None
            }
            if self.first[graph] is None:
                self.first[graph] = static
            else:
                for i, tensor in self.first[graph].items():
                    if i in static and static[i].data_ptr() != tensor.data_ptr():
                        self.moved.append((graph, i))
            return gm.forward(*args)

        return run


class CacheStorageTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        self.model = tiny_llama()
        self.reference = tiny_llama()  # the same weights, eager, unbucketed
        self.model.compile(backend=GraphCounter(), dynamic=False, fullgraph=True)

    @parameterized.expand([("left",), ("right",)])
    def test_a_workload_runs_on_one_allocation(self, side):
        kept = []
        for length in (30, 7, 20, 3, 12):
            out = prefill_buckets.generate(self.model, prompt(length), generation_config=config(side))
            expected = self.reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertEqual(out.tolist(), expected.tolist())
            kept.append((kept_keys(self.model), state_of(self.model).kept_cache.cache))
        self.assertIsNotNone(kept[0][0])
        self.assertTrue(all(keys is kept[0][0] for keys, _ in kept), "every call's cache had the first call's tensors")
        self.assertTrue(all(cache is kept[0][1] for _, cache in kept), "every call ran on the first call's cache")

    @parameterized.expand([("left",), ("right",)])
    def test_what_a_longer_call_wrote_is_zeroed(self, side):
        prefill_buckets.generate(self.model, prompt(30), generation_config=config(side))
        keys = kept_keys(self.model)
        long_written = state_of(self.model).kept_cache.written
        self.assertGreater(long_written, 32)
        prefill_buckets.generate(self.model, prompt(3), generation_config=config(side))
        self.assertIs(kept_keys(self.model), keys)
        short_written = state_of(self.model).kept_cache.written
        self.assertLess(short_written, long_written)
        self.assertTrue(bool(keys[:, :, :short_written].any()), "the short call's tokens are in the cache")
        self.assertFalse(bool(keys[:, :, short_written:].any()), "the longer call's slots are zero again")

    def test_a_returned_cache_is_not_reused(self):
        first = prefill_buckets.generate(
            self.model, prompt(20), generation_config=config("right", return_dict_in_generate=True)
        )
        returned = first[CACHE].layers[0].keys
        self.assertIsNone(kept_keys(self.model))
        snapshot = returned.clone()
        prefill_buckets.generate(self.model, prompt(7), generation_config=config("right"))
        self.assertIsNot(kept_keys(self.model), returned)
        self.assertTrue(torch.equal(returned, snapshot), "the returned cache is untouched")

    def test_a_passed_cache_is_not_kept(self):
        cache = StaticCache(config=self.model.config, max_cache_len=64)
        prefill_buckets.generate(
            self.model, prompt(7), generation_config=config("left", cache_implementation=None), **{CACHE: cache}
        )
        self.assertIsNone(kept_keys(self.model))

    def test_another_batch_size_allocates_anew(self):
        prefill_buckets.generate(self.model, prompt(7), generation_config=config("right"))
        one_row = kept_keys(self.model)
        out = prefill_buckets.generate(self.model, prompt(7, rows=2), generation_config=config("right"))
        expected = self.reference.generate(prompt(7, rows=2), max_new_tokens=NEW_TOKENS, do_sample=False)
        self.assertEqual(out.tolist(), expected.tolist())
        self.assertEqual(kept_keys(self.model).shape[0], 2)
        self.assertIsNot(kept_keys(self.model), one_row)

    def test_a_conversation_beside_one_off_calls(self):
        # A chat passes its returned cache back each turn (never reused); one-off calls between the turns reuse the
        # kept tensors. Every turn equals upstream's run on the whole conversation.
        sequence = prompt(7)
        cache = None
        for turn in range(4):
            passed = {} if cache is None else {CACHE: cache, "cache_implementation": None}
            out = prefill_buckets.generate(
                self.model, sequence, generation_config=config("left", return_dict_in_generate=True), **passed
            )
            cache = out[CACHE]
            expected = self.reference.generate(sequence, max_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertEqual(out.sequences.tolist(), expected.tolist())
            prefill_buckets.generate(self.model, prompt(25), generation_config=config("right"))
            self.assertIsNot(kept_keys(self.model), cache.layers[0].keys)
            sequence = torch.cat([out.sequences, prompt(4 + turn)], dim=1)

    def test_two_models_keep_their_own(self):
        other = tiny_llama()
        with torch.no_grad():
            for parameter in other.parameters():
                parameter.mul_(1.3)
        other_reference = tiny_llama()
        other_reference.load_state_dict(other.state_dict())
        other.compile(backend=GraphCounter(), dynamic=False, fullgraph=True)
        for length in (9, 30, 5):
            for model, reference in ((self.model, self.reference), (other, other_reference)):
                out = prefill_buckets.generate(model, prompt(length), generation_config=config("right"))
                expected = reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
                self.assertEqual(out.tolist(), expected.tolist())
        self.assertIsNot(kept_keys(self.model), kept_keys(other))

    # Full-attention layers; sliding-window layers beside them (rings in a call); sliding-window layers only.
    @parameterized.expand([("llama",), ("gemma2",), ("mistral_sliding",)])
    def test_a_reused_cache_holds_what_a_new_one_would(self, name):
        # The kept cache, reset for the next call (`reuse_cache`), against the cache upstream's step makes for that call
        # and `early_initialize` allocates: the same class and attributes, on the cache and on every layer (tensors by
        # value, dtype and device), so the next call runs as on a new cache.
        model = {"llama": tiny_llama, "gemma2": _tiny_gemma2, "mistral_sliding": _tiny_mistral}[name]()
        model.compile(backend=GraphCounter(), dynamic=False, fullgraph=True)
        prefill_buckets.generate(model, prompt(30), generation_config=config("right"))
        kept = state_of(model).kept_cache
        self.assertTrue(bool(kept.cache.layers[0].keys.any()), "the premise: the call wrote into the cache")
        slots = kept.slots
        reused = reuse_cache(model, "static", 1, slots)
        self.assertIs(reused, kept.cache)
        new = model._prepare_static_cache("static", 1, slots, None, {})
        early_initialize(model, new, 1)
        self.assertIsNot(new, reused)
        self.assertEqual(_attributes(reused, skip="layers"), _attributes(new, skip="layers"))
        for reused_layer, new_layer in zip(reused.layers, new.layers, strict=True):
            self.assertIs(type(reused_layer), type(new_layer))
            self.assertEqual(_attributes(reused_layer), _attributes(new_layer))

    def test_a_cache_allocated_in_its_first_forward_is_not_kept(self):
        # This GPT-NeoX config says 1 key/value head where its attention holds 4, so the cache is allocated by the
        # first forward, inside the compiled graph, as upstream's. Reused, the next call's first forward would find it
        # allocated: a graph of its own. Not kept, every call in the bucket compiles nothing new.
        model = _gpt_neox_misstating_its_heads()
        reference = copy.deepcopy(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        graphs = []
        for length in (7, 9, 12):
            out = prefill_buckets.generate(model, prompt(length), generation_config=config("right"))
            expected = reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertEqual(out.tolist(), expected.tolist())
            self.assertIsNone(state_of(model).kept_cache)
            graphs.append(counter.graphs)
        self.assertEqual(graphs[1:], graphs[:1] * 2, "the later calls in the bucket compiled nothing new")

    def test_a_class_that_makes_its_own_cache_makes_it_every_call(self):
        # A model class that overrides upstream's `_prepare_static_cache` (Mllama sizes its cross-attention layers
        # there) gets its own step on every call: the kept cache is upstream's step's, not the override's.
        class OwnCache(type(self.model)):
            made = 0

            def _prepare_static_cache(self, *args, **kwargs):
                OwnCache.made += 1
                return super()._prepare_static_cache(*args, **kwargs)

        model = tiny_llama()
        model.__class__ = OwnCache
        model.compile(backend=GraphCounter(), dynamic=False, fullgraph=True)
        for length in (7, 12, 5):
            out = prefill_buckets.generate(model, prompt(length), generation_config=config("right"))
            expected = self.reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertEqual(out.tolist(), expected.tolist())
        self.assertEqual(OwnCache.made, 3)

    @parameterized.expand([("left",), ("right",)])
    def test_each_mode_writes_tensors_of_its_own(self, side):
        # Tensors made under `torch.inference_mode()` can't be written outside it (torch raises), and tensors of the
        # other mode are other graph inputs (dynamo compiles again): a call takes kept tensors of its own mode only.
        modes = (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad)
        for length, mode in zip((7, 9, 5, 12), modes):
            with mode():
                out = prefill_buckets.generate(self.model, prompt(length), generation_config=config(side))
            expected = self.reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertEqual(out.tolist(), expected.tolist())
            self.assertEqual(kept_keys(self.model).is_inference(), mode is torch.inference_mode)
        with torch.inference_mode():
            prefill_buckets.generate(self.model, prompt(7), generation_config=config(side))
            inference_keys = kept_keys(self.model)
            prefill_buckets.generate(self.model, prompt(9), generation_config=config(side))
        self.assertIs(kept_keys(self.model), inference_keys, "calls in one mode share one allocation")

    @parameterized.expand([("left",), ("right",)])
    def test_every_static_address_stays_across_calls(self, side):
        # What CUDA graphs (`mode="reduce-overhead"`) replay needs, checked on CPU: every input a graph takes as a
        # static address (the parameters, and each layer's keys, values and length counter, which upstream marks with
        # `mark_static_address`) is where the graph's first run found it. On an H200 a new counter per call made
        # cudagraph trees re-record (`test_gpu.py`: "static input data pointer changed" for the 4 layers' counters).
        torch._dynamo.reset()
        model, addresses = tiny_llama(), StaticAddresses()
        model.compile(backend=addresses, dynamic=False, fullgraph=True)
        for length in (30, 7, 20, 3, 12, 7):
            out = prefill_buckets.generate(model, prompt(length), generation_config=config(side))
            expected = self.reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertEqual(out.tolist(), expected.tolist())
        counters = [t for first in addresses.first for t in first.values() if t.ndim == 0]
        self.assertTrue(counters, "the layers' length counters are static inputs of the graphs")
        self.assertEqual(addresses.moved, [], "static inputs moved between calls: (graph, input index)")

    @parameterized.expand([("left",), ("right",)])
    def test_an_eager_workload_runs_on_one_allocation(self, side):
        # Eager, the first forward allocates the cache from its keys, as upstream's: what early initialization would
        # have allocated, so it is kept and reused as a compiled call's.
        model, kept = tiny_llama(), []
        for length in (30, 7, 20, 3):
            out = prefill_buckets.generate(model, prompt(length), generation_config=config(side))
            expected = self.reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertEqual(out.tolist(), expected.tolist())
            kept.append(state_of(model).kept_cache.cache)
        self.assertTrue(all(cache is kept[0] for cache in kept), "every eager call ran on the first call's cache")

    def test_an_eager_call_keeps_what_a_compiled_call_would_allocate(self):
        # A cache kept by an eager call, reused once the model is compiled, compiles the graphs a compiled call's own
        # cache does: none more.
        graphs = []
        for eager_first in (False, True):
            torch._dynamo.reset()
            model, counter = tiny_llama(), GraphCounter()
            if eager_first:
                prefill_buckets.generate(model, prompt(9), generation_config=config("left"))
                self.assertIsNotNone(kept_keys(model))
            model.compile(backend=counter, dynamic=False, fullgraph=True)
            for length in (7, 12, 25):
                out = prefill_buckets.generate(model, prompt(length), generation_config=config("left"))
                expected = self.reference.generate(prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False)
                self.assertEqual(out.tolist(), expected.tolist())
            graphs.append(counter.graphs)
        self.assertEqual(graphs[1], graphs[0])

    def test_an_eager_cache_of_an_unpredicted_shape_is_not_kept(self):
        # Keys of 4 heads where the config says 1 (GPT-NeoX with an unused `num_key_value_heads`): not the cache early
        # initialization makes, so new every call, as upstream's.
        model = _gpt_neox_misstating_its_heads()
        prefill_buckets.generate(model, prompt(7), generation_config=config("right"))
        self.assertIsNone(state_of(model).kept_cache)

    def test_an_eager_cache_of_another_dtype_is_not_kept(self):
        # Under `torch.autocast` the values come in its dtype: not the cache early initialization makes.
        model = tiny_llama()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            try:
                tiny_llama().generate(prompt(7), generation_config=config("right"))
            except RuntimeError as error:  # transformers 5.17: keys and values of two dtypes in one cache
                self.skipTest(f"upstream: {error}")
            prefill_buckets.generate(model, prompt(7), generation_config=config("right"))
        self.assertIsNone(state_of(model).kept_cache)
        prefill_buckets.generate(model, prompt(7), generation_config=config("right"))
        self.assertIsNotNone(state_of(model).kept_cache, "the positive control: outside autocast it is kept")


def _gpt_neox_misstating_its_heads():
    """A tiny GPT-NeoX whose config says 1 key/value head where its attention holds 4."""
    torch.manual_seed(0)
    config_ = AutoConfig.for_model(
        "gpt_neox", vocab_size=128, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
        num_key_value_heads=1, intermediate_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config_).eval()


def _tiny_gemma2():
    """A tiny Gemma 2: every other layer a sliding window of 8 slots."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=1024, pad_token_id=0,
        eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return Gemma2ForCausalLM(config).eval()


def _tiny_mistral():
    """A tiny Mistral: every layer a sliding window of 8 slots."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # fmt: skip
    return MistralForCausalLM(config).eval()


def _attributes(thing, skip: str = "") -> dict:
    """`vars(thing)` but `skip`, comparable with `==`: a tensor as its values, dtype and device."""
    return {
        name: (value.tolist(), value.dtype, value.device) if isinstance(value, torch.Tensor) else value
        for name, value in vars(thing).items()
        if name != skip
    }


# The cache length a bucketed call gives a static cache (`sizing.static_cache_length`): moved whole from
# test_equivalence.py, with whose model specs (in tiny_models.py) it builds its models.
class StaticCacheLengthTest(unittest.TestCase):
    """With a static cache and no `max_cache_len`, prompts of one bucket get one cache length."""

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)

    def cache_length(self, length, model=None, **kwargs):
        # A fresh model by default: upstream keeps the largest cache length a model has seen.
        if model is None:
            model_class, make_config = MODEL_SPECS["llama"]
            model = model_class(make_config()).eval()
        out = prefill_buckets.generate(
            model,
            random_batch_ids(1, length, seed=length),
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
            return_dict_in_generate=True,
            **kwargs,
        )
        return out[CACHE].layers[0].max_cache_len

    def test_one_cache_length_per_bucket(self):
        # A list of buckets bounds the prompts: the first cache holds the largest bucket, 64 + 4 - 1 = 67 slots,
        # rounded up to a multiple of 64. Every prompt of every bucket gets that one cache length.
        lengths = {self.cache_length(n, prefill_buckets=[8, 16, 32, 64]) for n in (3, 5, 8, 9, 64)}
        self.assertEqual(lengths, {128})

    def test_cache_length_is_aligned(self):
        # No largest bucket: the first cache has `DEFAULT_CACHE_SLOTS`, aligned to 24 (8208), and capped at the model's
        # 256 positions, never past them.
        self.assertEqual(self.cache_length(5, prefill_pad_to_multiple_of=24), 256)
        # Aligned where that stays within them: 8 + 4 - 1 = 11 slots -> 64.
        self.assertEqual(self.cache_length(5, prefill_buckets=[8]), 64)

    def test_cache_grows_once_to_what_the_model_takes(self):
        model_class, make_config = MODEL_SPECS["llama"]
        model = model_class(make_config()).eval()
        # 70 and 200 are longer than the largest bucket: padded to multiples of 16.
        lengths = [self.cache_length(n, model=model, prefill_buckets=[8, 16]) for n in (5, 70, 200, 9)]
        # First 16 + 3 = 19 -> 64; then one growth, to the model's 256 positions; never again.
        self.assertEqual(lengths, [64, 256, 256, 256])

    def test_max_cache_len_is_respected(self):
        self.assertEqual(self.cache_length(5, prefill_buckets=[8, 16], max_cache_len=40), 40)


if __name__ == "__main__":
    unittest.main()
