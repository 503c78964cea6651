# Attentions under attention windows and rings (issue 36): every tensor `generate` returns has an unpadded upstream
# run's shape on every layer and step, and its values, when both runs have the same static cache length.
#
# A bucketed call's full-attention layers read a window of the cache (`kvcache/windows.py`) and its sliding-window layers are
# rings that read `window + new tokens` slots (`kvcache/ring.py`); `attention_keys.upstream_keys` puts the weights back at the
# slots upstream's layers return. Compared here against upstream eager on the unpadded prompt with `max_cache_len`
# pinned to 512 (the windows read 256 slots): every field, attentions with every value (the user's own pad queries
# too), on full-attention (Llama, Qwen3), sliding-window (Mistral: a window of 8 that prompts overflow, and of 300 that
# decode fills), chunked (Llama 4) and hybrid (Gemma 2, Gemma 3) models; eager and compiled (counting backend).
# Without the fix the attentions have the window (256) or the ring (window + new tokens) as their key axis.

import functools
import unittest

import torch
from parameterized import parameterized
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StaticSlidingWindowLayer,
)
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.kvcache import attention_keys, windows

from .tiny_models import CACHE, SLIDING_MODELS, assert_same, hide_user_pads, single_thread_module


SLOTS = 512  # pinned in both runs: the bucketed call's windows read 256 of them
_BASE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
_HYBRID = {"layer_types": ["sliding_attention", "full_attention"], "head_dim": 8}
MODELS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_BASE)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**_BASE, head_dim=8)),
    "mistral_8": (MistralForCausalLM, lambda: MistralConfig(**_BASE, sliding_window=8)),
    "mistral_300": (MistralForCausalLM, lambda: MistralConfig(**_BASE, sliding_window=300)),
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(**_BASE, head_dim=8, sliding_window=8)),
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(**_BASE, **_HYBRID, sliding_window=24)),
}
FLAGS = {"output_attentions": True, "output_hidden_states": True, "output_scores": True, "output_logits": True}
setUpModule, tearDownModule = single_thread_module()


def make(name: str):
    """A tiny random model with eager attention: the one that returns attention weights."""
    model_class, make_config = MODELS[name]
    torch.manual_seed(0)
    return model_class._from_config(make_config(), attn_implementation="eager").eval()


def batch(lengths, seed: int = 0):
    """Rows of `lengths` tokens, left-padded by the user to the longest: `(input_ids, attention_mask)`."""
    width = max(lengths)
    input_ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, 128, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def config(new_tokens: int, **fields) -> GenerationConfig:
    values = {"cache_implementation": "static", "max_cache_len": SLOTS, **FLAGS, **fields}
    return GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **values
    )


def assert_upstream(test, got, want, attention_mask, path: str) -> None:
    """Every field of `got` has the shape and values of `want` (an unpadded upstream run): attentions on every slot."""
    for output in (got, want):
        hide_user_pads(output, attention_mask)
    assert_same(test, got, want, path)


def key_axes(output) -> set:
    return {tuple(layer.shape[-1] for layer in layers) for layers in output.attentions}


class AttentionKeysTest(unittest.TestCase):
    def assert_upstream(self, name, lengths, bucket, new_tokens, model=None, **fields):
        model = model if model is not None else make(name)
        input_ids, attention_mask = batch(lengths)
        generation_config = config(new_tokens, **fields)
        want = model.generate(input_ids, attention_mask=attention_mask, generation_config=generation_config)
        got = prefill_buckets.generate(
            model,
            input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            prefill_buckets=[bucket],
        )
        self.assertEqual(len(got.attentions), new_tokens)
        assert_upstream(self, got, want, attention_mask, name)
        return got, want

    @parameterized.expand(
        [
            # Full attention: the windows (256) return as the cache's 512 slots.
            ("llama", (20, 14), 32, 4),
            ("qwen3", (20, 14), 32, 4),
            # A window of 8: the prompt overflows it, the ring reads 8 + 32 slots at prefill and 9 at decode.
            ("mistral_8", (20, 14), 32, 4),
            # A window of 300 on 512 slots: decode fills it (upstream: 300 keys, then 300 + 1 - 1 once full).
            ("mistral_300", (290, 280), 296, 12),
            # Hybrid: a ring and a windowed full-attention layer.
            ("gemma2", (20, 14), 32, 4),
            ("gemma3", (20, 14), 32, 8),
        ]
    )
    def test_every_layer_and_step_is_upstream(self, name, lengths, bucket, new_tokens):
        got, want = self.assert_upstream(name, lengths, bucket, new_tokens)
        self.assertEqual(key_axes(got), key_axes(want))

    @parameterized.expand([("llama",), ("mistral_8",), ("gemma2",)])
    def test_dynamic_cache_and_no_cache(self, name):
        # A key axis that spans the padded sequence loses the padding; a query that attends to nothing gets upstream's
        # weights on the keys left (`1 / keys`).
        for fields in ({"cache_implementation": None, "max_cache_len": None}, {"use_cache": False}):
            with self.subTest(**fields):
                self.assert_upstream(name, (20, 14), 32, 3, **fields)

    def test_chunked_attention(self):
        # Llama 4's chunked-attention layers (chunks of 16) are rings too; with a full-attention layer beside them.
        base = SLIDING_MODELS["llama4"]()
        model = type(base)._from_config(base.config, attn_implementation="eager").eval()
        got, _ = self.assert_upstream("llama4", (20, 14), 32, 6, model=model)
        self.assertEqual(key_axes(got), {(20, SLOTS), (16, SLOTS)})

    def test_chunked_prefill(self):
        # The documented deviation: the prefill step returns its last chunk, as upstream's does, but the chunks split
        # the padded prompt (32 = 16 + 16, upstream's 20 = 16 + 4). The decode steps are upstream's.
        model = make("gemma2")
        input_ids, attention_mask = batch((20, 14))
        generation_config = config(3, prefill_chunk_size=16)
        want = model.generate(input_ids, attention_mask=attention_mask, generation_config=generation_config)
        got = prefill_buckets.generate(
            model, input_ids, attention_mask=attention_mask, generation_config=generation_config, prefill_buckets=[32]
        )
        self.assertEqual([a.shape[-2] for a in want.attentions[0]], [4, 4])
        self.assertEqual([a.shape[-2] for a in got.attentions[0]], [16, 16])
        self.assertEqual(got.hidden_states[0][0].shape[1], 16)
        for output in (got, want):
            output["attentions"], output["hidden_states"] = output.attentions[1:], output.hidden_states[1:]
        assert_same(self, got, want, "decode steps")

    def test_full_attention_spans_the_cache(self):
        # The case: a 512-slot cache returns 512 keys on every layer at every step, not the 256-slot window.
        got, _ = self.assert_upstream("llama", (20,), 32, 3)
        self.assertEqual(key_axes(got), {(SLOTS, SLOTS)})

    def test_beam_search(self):
        self.assert_upstream("gemma2", (20, 14), 32, 4, num_beams=2, num_return_sequences=2)

    def test_continued_conversation(self):
        # The second turn's prefill runs after the cached tokens (and the first turn's padding): held > 0.
        model = make("gemma3")
        first_ids, first_mask = batch((20,))
        turns = {}
        upstream = functools.partial(type(model).generate, model)
        bucketed = functools.partial(prefill_buckets.generate, model, prefill_buckets=[32, 64])
        for run, generate in (("want", upstream), ("got", bucketed)):
            first = generate(first_ids, attention_mask=first_mask, generation_config=config(4))
            follow_up = torch.cat([first.sequences, batch((9,), seed=5)[0]], dim=1)
            later = config(4, cache_implementation=None, max_cache_len=None)  # the cache is passed in
            turns[run] = generate(follow_up, generation_config=later, **{CACHE: first[CACHE]})
            self.assertGreater(turns[run].attentions[0][0].shape[-2], 1)  # a prefill, after the cached tokens
        self.assertEqual(key_axes(turns["got"]), key_axes(turns["want"]))
        assert_same(self, turns["got"], turns["want"], "second turn")


class UpstreamLayoutTest(unittest.TestCase):
    def test_sliding_layout_is_upstreams(self):
        # `KeyLayout.read` against upstream's own layer: the keys it returns, and the position in its slot 0.
        for window, forwards in ((4, (3, 2, 1, 1, 3, 1)), (4, (6, 1, 1)), (4, (4, 1, 2))):
            layer = StaticSlidingWindowLayer(max_cache_len=64, sliding_window=window)
            layout = attention_keys.KeyLayout(attention_keys.SLIDING, window)
            held = 0
            for new in forwards:
                positions = torch.arange(held, held + new, dtype=torch.float32).view(1, 1, new, 1)
                keys, _ = layer.update(positions, positions)
                count, first = layout.read(held, new)
                self.assertEqual(keys.shape[-2], count, (window, forwards, held, new))
                written = min(count, held + new - first)  # the slots after them hold no position yet
                torch.testing.assert_close(keys[0, 0, :written, 0], torch.arange(first, first + written).float())
                held += new

    def test_unknown_layouts_are_returned_as_read(self):
        # What the package can't place is returned as the layers read it, and it says why.
        full = attention_keys.KeyLayout(attention_keys.FULL, SLOTS)
        logger = transformers_logging.get_logger("prefill_buckets.kvcache.attention_keys")
        with CaptureLogger(logger) as captured:
            self.assertIsNone(attention_keys.layouts_for((full, full), 3))
        self.assertIn("The attentions have 3 layers and the static cache 2", captured.out)
        weights = torch.rand(1, 2, 1, 100)  # a window is 256 slots, the cache 512: not what this layer reads
        with CaptureLogger(logger) as captured:
            self.assertIs(attention_keys.upstream_keys(weights, full, tokens=40, added=8, cached=39), weights)
        self.assertIn("An attention tensor has 100 keys where its cache layer reads 512", captured.out)


class CompiledAttentionKeysTest(unittest.TestCase):
    """`model.compile(dynamic=False, fullgraph=True)` with the counting backend."""

    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)

    @parameterized.expand([("llama",), ("gemma2",)])
    def test_compiled(self, name):
        model = make(name)
        input_ids, attention_mask = batch((20, 14))
        want = model.generate(input_ids, attention_mask=attention_mask, generation_config=config(4))
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        plain = dict.fromkeys(FLAGS, False)
        for length in (20, 25):  # one bucket: a prefill graph and a decode graph (one window), compiled once
            ids = batch((length, 14))
            prefill_buckets.generate(
                model, ids[0], attention_mask=ids[1], generation_config=config(4, **plain), prefill_buckets=[32]
            )
        self.assertEqual(counter.graphs, 2, counter.shapes)
        self.assertEqual(windows.window_length(32 + 4, SLOTS), 256)
        got = prefill_buckets.generate(
            model, input_ids, attention_mask=attention_mask, generation_config=config(4), prefill_buckets=[32]
        )
        assert_upstream(self, got, want, attention_mask, name)
        calls = counter.calls
        prefill_buckets.generate(
            model, input_ids, attention_mask=attention_mask, generation_config=config(4), prefill_buckets=[32]
        )
        self.assertEqual(counter.calls - calls, 4, "a forward ran eagerly")
        self.assertEqual(counter.graphs, 4, counter.shapes)  # attentions are another output: their own 2 graphs
