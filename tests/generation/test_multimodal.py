"""Image- and audio-text-to-text models (LLaVA, Qwen2-VL, Qwen2-Audio): a prompt with images or audio is padded on the
left (`pixel_values`, `input_features` and the other per-image or per-clip inputs are not padded on the right), compiles
once per bucket, and gives upstream's unpadded tokens.

The pads' id is never one the config gives a placeholder: LLaVA and Qwen2-Audio count the placeholder ids in the
prompt, padding included, against their image or audio features (transformers' own generation tests call them with
`pad_token_id=-1, eos_token_id=-1`, and their configs' placeholder is id 0, the fill's last resort before).
"""

import copy
import unittest

import torch
from transformers import (
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2AudioConfig,
    Qwen2AudioEncoderConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.call.resolved import resolve_settings
from prefill_buckets.upstream.transformers_api import reserved_token_ids

from .tiny_models import single_thread_module, static_config


setUpModule, tearDownModule = single_thread_module()

# The language model of LLaVA and Qwen2-Audio: ids 0 and 4 to 98 are prompt tokens and placeholders.
TEXT = {
    "vocab_size": 99,
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}
IMAGE_TOKENS = 4  # an 8x8 image in 4x4 patches
IMAGE_ID = 0


def tiny_llava() -> LlavaForConditionalGeneration:
    text = LlamaConfig(**TEXT)
    vision = CLIPVisionConfig(
        image_size=8, patch_size=4, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4
    )
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=IMAGE_ID,
        image_seq_length=IMAGE_TOKENS,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval()


def llava_inputs(text_length: int, rows: int = 2, seed: int = 0) -> dict:
    """An image's placeholders, then `text_length` text tokens, per row."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(4, 99, (rows, text_length), generator=generator)
    input_ids = torch.cat([torch.full((rows, IMAGE_TOKENS), IMAGE_ID), text], dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.randn(rows, 3, 8, 8, generator=generator),
    }


def tiny_qwen2_vl() -> Qwen2VLForConditionalGeneration:
    text = {
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "hidden_size": 32,
        "vocab_size": 99,
        "intermediate_size": 37,
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rope_parameters": {"type": "mrope", "mrope_section": [2, 1, 1]},
    }
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "patch_size": 14}
    vision |= {"spatial_merge_size": 1, "temporal_patch_size": 2}
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=3, image_token_id=4, video_token_id=5
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


def qwen2_vl_inputs(text_length: int, rows: int = 2, seed: int = 0) -> dict:
    """A vision start marker, one image token (a 14x14 image in one patch), then `text_length` text tokens, per row."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(6, 99, (rows, text_length), generator=generator)
    input_ids = torch.cat([torch.full((rows, 1), 3), torch.full((rows, 1), 4), text], dim=1)
    mm_token_type_ids = torch.zeros_like(input_ids)
    mm_token_type_ids[:, 1] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": mm_token_type_ids,
        "pixel_values": torch.randn(rows, 3 * 14 * 14 * 2, generator=generator),
        "image_grid_thw": torch.tensor([[1, 1, 1]] * rows),
    }


AUDIO_FRAMES = 60  # mel frames per clip: 15 audio tokens (two stride-2 reductions)


def tiny_qwen2_audio() -> Qwen2AudioForConditionalGeneration:
    text = Qwen2Config(**TEXT)
    audio = Qwen2AudioEncoderConfig(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=32,
        num_mel_bins=80,
        max_source_positions=AUDIO_FRAMES // 2,
    )
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_id=0)
    torch.manual_seed(0)
    return Qwen2AudioForConditionalGeneration(config).eval()


def qwen2_audio_inputs(text_length: int, rows: int = 2, seed: int = 0) -> dict:
    """BOS, a clip's 15 placeholders, then `text_length` text tokens, per row."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(4, 99, (rows, text_length), generator=generator)
    input_ids = torch.cat([torch.full((rows, 1), 1), torch.full((rows, 15), 0), text], dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "input_features": torch.randn(rows, 80, AUDIO_FRAMES, generator=generator),
        "feature_attention_mask": torch.ones(rows, AUDIO_FRAMES, dtype=torch.long),
    }


class ReservedTokenIdsTest(unittest.TestCase):
    def test_a_composite_config_reserves_its_placeholders_not_its_generation_tokens(self):
        reserved = reserved_token_ids(tiny_qwen2_vl().config)
        self.assertLessEqual({3, 4, 5}, reserved)  # vision start, image, video (and its default vision end marker)
        self.assertFalse(reserved & {0, 1, 2}, "bos, eos and pad fill padding")
        self.assertEqual(reserved_token_ids(tiny_llava().config), {IMAGE_ID})

    def test_the_fill_skips_a_reserved_id(self):
        model = tiny_llava()
        settings = resolve_settings(model, GenerationConfig(pad_token_id=-1, eos_token_id=-1), {}, {})
        self.assertEqual(settings.reserved_token_ids, {IMAGE_ID})
        self.assertNotIn(settings.fill_token_id, settings.reserved_token_ids)
        self.assertNotIn(settings.unmasked_fill_token_id, settings.reserved_token_ids)
        self.assertEqual(resolve_settings(model, GenerationConfig(), {}, {}).fill_token_id, 3)  # the pad token


class MultimodalGenerationTest(unittest.TestCase):
    def assert_upstream_tokens(self, model, inputs, generation: dict, **fields):
        """The bucketed call (`fields`) returns the unpadded call's tokens, both greedy for 4 tokens with `generation`."""
        expected = model.generate(**inputs, generation_config=static_config(4, **generation))
        bucketed = static_config(4, **generation, **fields)
        self.assertTrue(bucketed.prefill_buckets)
        self.assertTrue(torch.equal(prefill_buckets.generate(model, **inputs, generation_config=bucketed), expected))

    def test_llava_without_pad_or_eos_tokens(self):
        # As transformers' own tests call it: no valid pad or eos id, so the fill falls back to an id of its own.
        generation = {"pad_token_id": -1, "eos_token_id": -1}
        for side in ("auto", "left"):
            with self.subTest(side=side):
                self.assert_upstream_tokens(
                    tiny_llava(), llava_inputs(7), generation, prefill_buckets=[16], prefill_padding_side=side
                )

    def test_llava_from_inputs_embeds(self):
        # LLaVA finds the placeholders in `inputs_embeds` by their embedding: the fill's must not be the image's.
        model = tiny_llava()
        inputs = llava_inputs(7)
        inputs["inputs_embeds"] = model.get_input_embeddings()(inputs.pop("input_ids"))
        self.assert_upstream_tokens(model, inputs, {"pad_token_id": -1, "eos_token_id": -1}, prefill_buckets=[16])

    def test_qwen2_audio_without_pad_or_eos_tokens(self):
        generation = {"pad_token_id": -1, "eos_token_id": -1}
        self.assert_upstream_tokens(tiny_qwen2_audio(), qwen2_audio_inputs(5), generation, prefill_buckets=[32])

    def test_qwen2_vl_multimodal_positions(self):
        # Qwen2-VL's 3D rotary positions come from the mask and the image grid: left pads must not shift them.
        for text_length in (3, 9):
            with self.subTest(text_length=text_length):
                self.assert_upstream_tokens(tiny_qwen2_vl(), qwen2_vl_inputs(text_length), {}, prefill_buckets=[16])

    def test_llava_compiled_once_per_bucket(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        reference = tiny_llava()
        model = copy.deepcopy(reference)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)
        bucketed = static_config(4, prefill_buckets=[16, 32])
        graphs = []
        for text_length in (5, 8, 11, 20, 25):  # prompts of 9 to 29 tokens: two buckets
            inputs = llava_inputs(text_length, seed=text_length)
            expected = reference.generate(**inputs, generation_config=static_config(4))
            self.assertTrue(
                torch.equal(prefill_buckets.generate(model, **inputs, generation_config=bucketed), expected)
            )
            graphs.append(counter.graphs)
        self.assertEqual(graphs[0], graphs[2], "prompts in the first bucket share its graphs")
        self.assertGreater(graphs[3], graphs[2], "the second bucket's prefill compiles")
        self.assertEqual(graphs[3], graphs[4], "prompts in the second bucket share its graphs")


if __name__ == "__main__":
    unittest.main()
