# Unit tests of `call/plan.py`: `left_pad` and `fill_embedding` (what pads hold), and `plan_call` on resolved calls of
# a tiny Llama: the prompt and its per-token inputs padded in front (left) or passed on as they are (right), dummy rows
# up to the batch bucket, and the user's dicts and tensors never modified.

import unittest

import torch
from transformers import GenerationConfig

from prefill_buckets.call.plan import PaddingSide, fill_embedding, left_pad, plan_call
from prefill_buckets.call.resolved import bind_call, resolve_call
from prefill_buckets.call.views import DummyRowsFinished

from .tiny_models import tiny_llama


class LeftPadTest(unittest.TestCase):
    def test_left_pad_ids(self):
        ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
        padded = left_pad(ids, 2, 0)
        self.assertTrue(torch.equal(padded, torch.tensor([[0, 0, 5, 6, 7], [0, 0, 8, 9, 10]])))
        self.assertEqual(padded.dtype, ids.dtype)

    def test_left_pad_keeps_dtype_and_device(self):
        for dtype in (torch.long, torch.int32, torch.bool, torch.float16, torch.float32):
            tensor = torch.ones(2, 3, dtype=dtype)
            padded = left_pad(tensor, 4, 0)
            self.assertEqual(padded.dtype, dtype)
            self.assertEqual(padded.device, tensor.device)
            self.assertEqual(tuple(padded.shape), (2, 7))
            self.assertFalse(padded[:, :4].any())

    def test_left_pad_embeddings_with_a_vector(self):
        embeds = torch.randn(2, 3, 4)
        pad_vector = torch.arange(4, dtype=torch.float64)  # cast to the tensor's dtype
        padded = left_pad(embeds, 2, pad_vector, dim=1)
        self.assertEqual(tuple(padded.shape), (2, 5, 4))
        self.assertEqual(padded.dtype, torch.float32)
        for b in range(2):
            for s in range(2):
                self.assertTrue(torch.equal(padded[b, s], pad_vector.float()))
        self.assertTrue(torch.equal(padded[:, 2:], embeds))

    def test_left_pad_middle_dim_with_scalar(self):
        tensor = torch.ones(2, 3, 4)
        padded = left_pad(tensor, 1, 7.0, dim=1)
        self.assertEqual(tuple(padded.shape), (2, 4, 4))
        self.assertTrue((padded[:, 0] == 7.0).all())

    def test_left_pad_with_a_tensor_fill_of_the_sequence_shape(self):
        # A fill that is itself a tensor broadcasts over the new slice: per-row values fill each row's pads.
        ids = torch.tensor([[5, 6], [8, 9]])
        padded = left_pad(ids, 3, torch.tensor([[1], [2]]))
        expected = torch.cat([torch.tensor([[1] * 3, [2] * 3]), ids], dim=1)
        self.assertTrue(torch.equal(padded, expected))


class FillEmbeddingTest(unittest.TestCase):
    def test_dtype_and_device_of_the_embeddings(self):
        embedding = torch.nn.Embedding(8, 4)  # fp32 weights
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                like = torch.zeros(2, 3, 4, dtype=dtype)
                fill = fill_embedding(embedding, 5, like)
                self.assertEqual((fill.shape, fill.dtype, fill.device), ((4,), dtype, like.device))
                self.assertFalse(fill.requires_grad)
                self.assertTrue(torch.equal(fill, embedding.weight[5].detach().to(dtype)))


def resolved(model, *args, **kwargs):
    return resolve_call(model, None, *bind_call(model, args, kwargs))


def config(**fields):
    return GenerationConfig(max_new_tokens=2, do_sample=False, cache_implementation="static", **fields)


class PlanCallTest(unittest.TestCase):
    def setUp(self):
        self.model = tiny_llama()
        self.ids = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 8, 9, 10]])  # the second row padded by the user (pad 0)
        self.mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])

    def call(self, **kwargs):
        kwargs = {"attention_mask": self.mask, "generation_config": config(), "prefill_buckets": [8], **kwargs}
        return resolved(self.model, self.ids, **kwargs)

    def assert_unmodified(self, call, before):
        for name, value in before.items():
            now = {**call.arguments, **call.model_kwargs}[name]
            self.assertTrue(torch.equal(now, value), name)

    def test_left(self):
        call = self.call()
        before = {"inputs": self.ids.clone(), "attention_mask": self.mask.clone()}
        kwargs_before = dict(call.model_kwargs)
        plan, arguments, model_kwargs = plan_call(call, PaddingSide("left", "test", padded_length=8))
        fill = call.settings.fill_token_id
        # The prompt and its mask get 3 columns in front: the fill id, masked.
        self.assertTrue(torch.equal(model_kwargs["input_ids"], torch.cat([torch.full((2, 3), fill), self.ids], 1)))
        self.assertTrue(
            torch.equal(model_kwargs["attention_mask"], torch.cat([torch.zeros(2, 3).long(), self.mask], 1))
        )
        self.assertNotIn("inputs", arguments)
        self.assertEqual((plan.side, plan.prompt_length, plan.padded_length), ("left", 5, 8))
        self.assertEqual((plan.added_id_columns, plan.added_positions, plan.prompt_slots), (3, 3, 8))
        self.assertEqual((plan.padded_batch, plan.padded_rows), (2, 2))
        # The user's tensors and the resolved call's dicts are as they were.
        self.assert_unmodified(call, before)
        self.assertEqual(call.model_kwargs, kwargs_before)
        self.assertIsNot(model_kwargs, call.model_kwargs)

    def test_left_infers_the_mask_upstream_infers(self):
        # No mask passed: the user's pad tokens are masked (the pad id is not eos), and the added columns too.
        call = resolved(self.model, self.ids, generation_config=config(), prefill_buckets=[8])
        _, _, model_kwargs = plan_call(call, PaddingSide("left", "test", padded_length=8))
        expected = torch.cat([torch.zeros(2, 3).long(), (self.ids != self.model.config.pad_token_id).long()], 1)
        self.assertTrue(torch.equal(model_kwargs["attention_mask"], expected))

    def test_left_inputs_embeds(self):
        embeds = self.model.get_input_embeddings()(self.ids).detach()
        call = resolved(
            self.model, inputs_embeds=embeds, attention_mask=self.mask, generation_config=config(), prefill_buckets=[8]
        )
        plan, _, model_kwargs = plan_call(call, PaddingSide("left", "test", padded_length=8))
        padded = model_kwargs["inputs_embeds"]
        self.assertEqual(tuple(padded.shape), (2, 8, embeds.shape[-1]))
        fill = self.model.get_input_embeddings().weight[call.settings.fill_token_id]
        self.assertTrue(torch.equal(padded[:, :3], fill.detach().expand(2, 3, -1)))
        self.assertTrue(torch.equal(padded[:, 3:], embeds))
        self.assertEqual(plan.added_id_columns, 0)  # no ids to pad

    def test_right(self):
        call = self.call()
        before = {"inputs": self.ids.clone(), "attention_mask": self.mask.clone()}
        plan, arguments, model_kwargs = plan_call(call, PaddingSide("right", "test", bucket=8))
        # The prompt goes on as passed; the `_prefill` hook pads it after its end to the bucket.
        self.assertTrue(torch.equal(arguments["inputs"], self.ids))
        self.assertTrue(torch.equal(model_kwargs["attention_mask"], self.mask))
        self.assertEqual((plan.side, plan.prompt_length, plan.padded_length, plan.added_positions), ("right", 5, 5, 0))
        self.assertEqual((plan.right.bucket, plan.prompt_slots), (8, 8))
        self.assert_unmodified(call, before)

    def test_dummy_rows(self):
        for side in (
            PaddingSide("left", "test", padded_length=8, padded_batch=4),
            PaddingSide("right", "t", bucket=8, padded_batch=4),
        ):
            with self.subTest(side.side):
                call = self.call()
                before = {"inputs": self.ids.clone(), "attention_mask": self.mask.clone()}
                plan, arguments, model_kwargs = plan_call(call, side)
                length = plan.padded_length
                ids, mask = model_kwargs["input_ids"], model_kwargs["attention_mask"]
                self.assertEqual((tuple(ids.shape), tuple(mask.shape)), ((4, length), (4, length)))
                self.assertEqual(
                    (plan.call.rows, plan.padded_batch, plan.padded_rows, plan.call.output_rows), (2, 4, 4, 2)
                )
                # The user's rows first, as the call without dummy rows has them.
                _, _, unbatched = plan_call(self.call(), PaddingSide(side.side, "t", padded_length=8, bucket=8))
                unbatched_ids = unbatched.get("input_ids", self.ids)
                self.assertTrue(torch.equal(ids[:2], unbatched_ids))
                self.assertTrue(torch.equal(mask[:2], unbatched["attention_mask"]))
                # Dummy rows: the fill id, and never fully masked (on the left only their last token is attended).
                self.assertTrue((ids[2:] == call.settings.fill_token_id).all())
                expected_mask = torch.ones(2, length).long()
                if side.side == "left":
                    expected_mask[:, :-1] = 0
                self.assertTrue(torch.equal(mask[2:], expected_mask))
                # Finished from the first step on, so they never keep generation going.
                stop = [c for c in arguments["stopping_criteria"] if isinstance(c, DummyRowsFinished)]
                self.assertEqual(len(stop), 1)
                self.assertEqual(stop[0](ids, None).tolist(), [False, False, True, True])
                self.assert_unmodified(call, before)

    def test_finished_rows_pad_id(self):
        call = self.call()
        plan_call(call, PaddingSide("left", "test", padded_length=8, finished_rows_pad_id=7))
        self.assertEqual(call.settings.generation_config.pad_token_id, 7)
        self.assertNotEqual(self.model.generation_config.pad_token_id, 7)  # the call's own config, not the model's


if __name__ == "__main__":
    unittest.main()
