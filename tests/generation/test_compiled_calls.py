# The compiled forward as bucketed calls run it (`compile/compiled_calls.py`): compiled with any `dynamic` but `False`,
# a bucketed prefill is one graph symbolic in the prompt length for every bucket (`mark_prefill_dynamic`, the window
# of its own tokens: `windows.QUERY_WINDOW`), and decode one static graph per window (`mark_decode_static`); compiled
# with `dynamic=False`, each bucket is a static graph of its own, as asked.
#
# Counts are real compiled graphs and compiled calls (`GraphCounter`, eager backend, `fullgraph=True`: a forward is
# one compiled graph or an error), and every output is compared with an unpadded, uncompiled run of the same weights.

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.call.budget import budget_of
from prefill_buckets.kvcache.windows import window_length


CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 2048,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "attn_implementation": "sdpa",
}
NEW_TOKENS = 4
# Buckets of "pow2-quarters" from 8 to 320 (and windows of 256 and 512 slots): 11 prefill shapes.
LENGTHS = [5, 11, 23, 40, 57, 100, 130, 200, 250, 300]
SLOTS = 1024  # max_cache_len: one cache for every call


class SymbolicLength(LlamaForCausalLM):
    """A Llama whose forward reads its prompt length as a Python int: a graph can't keep it symbolic."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        if input_ids is not None:
            for _ in range(input_ids.shape[1]):  # a loop over the length: a graph is traced for one length
                pass
        return super().forward(input_ids, attention_mask, position_ids, past_key_values, **kwargs)


def make_model(model_class=LlamaForCausalLM):
    torch.manual_seed(0)
    model = model_class(LlamaConfig(**CONFIG)).eval()
    reference = LlamaForCausalLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    return model, reference


def prompt(length: int) -> torch.Tensor:
    return torch.randint(3, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))


def config(**fields) -> GenerationConfig:
    return GenerationConfig(
        cache_implementation="static",
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        max_cache_len=SLOTS,
        **fields,
    )


class GenericPrefillTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        prefill_buckets.enable()
        self.addCleanup(prefill_buckets.disable)
        self.addCleanup(torch._dynamo.reset)

    def run_lengths(self, model, reference, dynamic, side="auto"):
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=dynamic, fullgraph=True)
        bucketed = config(prefill_buckets="pow2-quarters", prefill_padding_side=side)
        for length in LENGTHS:
            ids = prompt(length)
            mask = torch.ones_like(ids)
            calls = counter.calls
            out = model.generate(ids, attention_mask=mask, generation_config=bucketed)
            expected = reference.generate(ids, attention_mask=mask, generation_config=config())
            torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"prompt of {length} tokens")
            self.assertEqual(counter.calls - calls, NEW_TOKENS, f"a forward of the {length}-token call ran eagerly")
        return counter

    @parameterized.expand([("left",), ("right",)])
    def test_one_prefill_graph_for_every_bucket(self, side):
        model, reference = make_model()
        counter = self.run_lengths(model, reference, dynamic=None, side=side)
        # One prefill graph, and a decode graph per window the steps read: 256 and 512 slots.
        windows = {window_length(length + 1, SLOTS) for length in (8, 320)}  # the first and last buckets'
        self.assertEqual(counter.graphs, 1 + len(windows), counter.shapes)

    def test_static_shapes_compile_a_graph_per_bucket(self):
        # `dynamic=False`, as asked: each bucket is its own prefill graph (10 lengths, 10 buckets).
        model, reference = make_model()
        counter = self.run_lengths(model, reference, dynamic=False, side="left")
        self.assertEqual(counter.graphs, len(LENGTHS) + 2, counter.shapes)

    def test_the_tensors_passed_in_are_not_marked(self):
        model, _ = make_model()
        model.compile(backend=GraphCounter(), dynamic=None, fullgraph=True)
        ids = prompt(16)  # an exact fit: its ids reach the forward as they are
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, generation_config=config(prefill_buckets=[16, 64]))
        for tensor in (ids, mask):
            self.assertFalse(hasattr(tensor, "_dynamo_weak_dynamic_indices"))
            self.assertFalse(hasattr(tensor, "_dynamo_dynamic_indices"))

    def test_a_prefill_the_model_specializes_is_counted_per_bucket(self):
        # The model's code fixes the length: every bucket compiles, the budget learns it after the second call, and no
        # forward runs eagerly past torch's limit (`fullgraph=True` would raise).
        model, reference = make_model(SymbolicLength)
        torch._dynamo.config.recompile_limit, limit = 4, torch._dynamo.config.recompile_limit
        self.addCleanup(setattr, torch._dynamo.config, "recompile_limit", limit)
        with self.assertLogs("prefill_buckets", level="INFO") as logs:
            counter = self.run_lengths(model, reference, dynamic=None, side="left")
        self.assertTrue(budget_of(model).prefill_specializes)
        self.assertEqual(counter.graphs, len(LENGTHS) + 2, counter.shapes)
        self.assertTrue(any("compiled a graph per prompt length" in line for line in logs.output), logs.output)


if __name__ == "__main__":
    unittest.main()
