# PEFT models through bucketed `generate` (`peft` from the `testing` extra): every call's tokens equal upstream's unpadded
# call on the same PEFT model. `PeftModel.generate` passes its LoRA layers per-row arguments the call's own arguments
# don't show (`side_assumptions.PEFT_ROW_ARGUMENTS`): activated LoRA's offsets, counted from each forward's last token,
# take the left side (on the right, silently other tokens), and neither they nor a mixed-adapter batch's
# `adapter_names` get dummy rows (PEFT raised on the row count).

import copy
import importlib.util
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.call import generation

from .tiny_models import single_thread_module, static_config, tiny_llama


setUpModule, tearDownModule = single_thread_module()

INVOCATION = [7, 8]  # the tokens that switch an activated LoRA on, from where they start to the end
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_model(*adapters: str, activated: bool = False):
    """A tiny Llama with LoRA adapters of random, nonzero weights (each seeded), as a causal-LM `PeftModel`."""
    from peft import LoraConfig, get_peft_model

    model = None
    for index, name in enumerate(adapters):
        config = LoraConfig(
            r=4,
            target_modules=TARGETS,
            init_lora_weights=False,
            task_type="CAUSAL_LM",
            alora_invocation_tokens=INVOCATION if activated else None,
        )
        torch.manual_seed(100 + index)
        if model is None:
            model = get_peft_model(tiny_llama(), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    return model.eval()


def invoked_prompts(lengths, rows: int = 2, seed: int = 0) -> list[torch.Tensor]:
    """Prompts of ids 10.. (never the invocation's) with the invocation tokens 4 from their end."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for length in lengths:
        prompt = torch.randint(10, 100, (rows, length), generator=generator)
        prompt[:, length - 4 : length - 2] = torch.tensor(INVOCATION)
        prompts.append(prompt)
    return prompts


@unittest.skipUnless(importlib.util.find_spec("peft"), "needs peft (the `testing` extra)")
class PeftTest(unittest.TestCase):
    def setUp(self):
        prefill_buckets.enable()
        self.addCleanup(prefill_buckets.disable)
        logging.get_logger("prefill_buckets").warning_once.cache_clear()  # each test's reason is logged again
        self.sides = []
        original = generation.choose_side

        def spy(*args, **kwargs):
            self.sides.append(original(*args, **kwargs))
            return self.sides[-1]

        patcher = mock.patch.object(generation, "choose_side", spy)
        patcher.start()
        self.addCleanup(patcher.stop)

    def assert_as_unpadded(self, model, prompt, settings=(), reference=None, **fields) -> None:
        """
        The bucketed call's (`fields`) tokens and first scores equal the unpadded call's, both with `settings`, on the
        same model or an uncompiled `reference` copy of it.
        """
        settings = {"output_scores": True, "return_dict_in_generate": True, **dict(settings)}
        reference = model if reference is None else reference
        expected = reference.generate(input_ids=prompt, generation_config=static_config(6, **settings))
        output = model.generate(input_ids=prompt, generation_config=static_config(6, **settings, **fields))
        self.assertEqual(output.sequences.tolist(), expected.sequences.tolist())
        torch.testing.assert_close(output.scores[0], expected.scores[0])

    def test_the_activated_lora_applies(self):
        # The positive control: the adapter changes these prompts' tokens, so a padding that moved it would show.
        model, (prompt,) = lora_model("a", activated=True), invoked_prompts([11])
        with_adapter = model.generate(input_ids=prompt, generation_config=static_config(6))
        with model.disable_adapter():
            without = model.generate(input_ids=prompt, generation_config=static_config(6))
        self.assertNotEqual(with_adapter.tolist(), without.tolist())

    @parameterized.expand([("auto",), ("right",), ("left",)])
    def test_activated_lora_is_padded_on_the_left(self, side):
        model = lora_model("a", activated=True)
        for prompt in invoked_prompts([6, 11, 19, 27]):
            self.assert_as_unpadded(model, prompt, prefill_buckets=[16, 32], prefill_padding_side=side)
        self.assertEqual({decided.side for decided in self.sides}, {"left"})  # the bucketed calls' (4)
        self.assertEqual(len(self.sides), 4)
        if side != "left":
            self.assertIn("alora_offsets", self.sides[0].reason)

    def test_activated_lora_compiled(self):
        model = lora_model("a", activated=True)
        reference = copy.deepcopy(model)
        counter = GraphCounter()
        model.base_model.model.compile(backend=counter, dynamic=False)
        for prompt in invoked_prompts([6, 11, 19, 27]):
            self.assert_as_unpadded(model, prompt, reference=reference, prefill_buckets=[16, 32])
        graphs = counter.graphs
        for prompt in invoked_prompts([5, 12, 21, 30], seed=1):
            self.assert_as_unpadded(model, prompt, reference=reference, prefill_buckets=[16, 32])
        self.assertEqual(counter.graphs, graphs, "no new graph for new prompt lengths")

    def test_activated_lora_with_chunked_prefill_runs_unpadded(self):
        # Padding in front moves the chunks' ends, from which each chunk counts the offsets.
        model = lora_model("a", activated=True)
        (prompt,) = invoked_prompts([21])
        logger = logging.get_logger("prefill_buckets.call.generation")
        with CaptureLogger(logger) as captured:
            self.assert_as_unpadded(model, prompt, {"prefill_chunk_size": 8}, prefill_buckets=[32])
        self.assertEqual([decided.side for decided in self.sides], ["unpadded"])
        self.assertIn("prefill_chunk_size=8", captured.out)

    @parameterized.expand([("activated", True), ("mixed adapters", False)])
    def test_per_row_arguments_keep_their_rows(self, _, activated):
        model = lora_model("a", "b", activated=activated)
        prompt = invoked_prompts([9], rows=3)[0]
        mask = torch.ones_like(prompt)
        mask[0, :3] = 0  # a ragged batch, padded on the left as a tokenizer pads it
        adapters = {} if activated else {"adapter_names": ["a", "__base__", "b"]}
        logger = logging.get_logger("prefill_buckets.call.decision")
        expected = model.generate(
            input_ids=prompt, attention_mask=mask, **adapters, generation_config=static_config(6)
        )
        with CaptureLogger(logger) as captured:
            output = model.generate(
                input_ids=prompt,
                attention_mask=mask,
                **adapters,
                generation_config=static_config(6, prefill_buckets=[16], prefill_batch_buckets=[4]),
            )
        self.assertEqual(output.tolist(), expected.tolist())
        self.assertEqual(self.sides[-1].padded_batch, 3)
        name = "alora_offsets" if activated else "adapter_names"
        self.assertIn(f"it can't pad the per-row `{name}` PEFT passes the layers", captured.out)

    @parameterized.expand([("left",), ("right",)])
    def test_mixed_adapter_batch(self, side):
        model = lora_model("a", "b")
        prompt = invoked_prompts([9], rows=3)[0]
        names = ["a", "__base__", "b"]
        expected = model.generate(input_ids=prompt, adapter_names=names, generation_config=static_config(6))
        output = model.generate(
            input_ids=prompt,
            adapter_names=names,
            generation_config=static_config(6, prefill_buckets=[16], prefill_padding_side=side),
        )
        self.assertEqual(output.tolist(), expected.tolist())
        self.assertEqual(self.sides[-1].side, side)  # adapter names count no positions: either side is exact

    def test_lora_compiled_once_per_bucket(self):
        model = lora_model("a")
        reference = copy.deepcopy(model)
        counter = GraphCounter()
        model.base_model.model.compile(backend=counter, dynamic=False)
        for prompt in invoked_prompts([5, 9, 13, 20, 31], rows=1):
            self.assert_as_unpadded(model, prompt, reference=reference, prefill_buckets=[16, 32])
        graphs, calls = counter.graphs, counter.calls
        for prompt in invoked_prompts([6, 10, 17, 29], rows=1, seed=1):
            model.generate(input_ids=prompt, generation_config=static_config(6, prefill_buckets=[16, 32]))
        self.assertEqual(counter.graphs, graphs, "no new graph for new prompt lengths")
        self.assertEqual(counter.calls - calls, 4 * 6, "every forward compiled")


if __name__ == "__main__":
    unittest.main()
