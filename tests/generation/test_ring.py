# Unit tests of `kvcache/ring.py`: a `SlidingWindowRing` does what upstream's `StaticSlidingWindowLayer.update` does,
# with tensor arithmetic on its count. Run side by side with an upstream layer on the same updates (prefills shorter
# and longer than the window, decode steps past it), it keeps upstream's storage and count; what it reads holds the
# position `start + j` in slot `j`, as its mask sizes say, so attention over it under the sliding window is attention
# over every token seen; and `open` / `close` hand a layer between upstream and the ring with its count.

import unittest

import torch
from transformers import MistralConfig, StaticCache

from prefill_buckets.kvcache.ring import SlidingWindowRing
from prefill_buckets.upstream import transformers_api


WINDOW = 4
HEAD_DIM = 8


def sliding_layer():
    """The sliding-window layer of a static cache longer than the window: a ring of `WINDOW` slots."""
    config = MistralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=WINDOW,
        max_position_embeddings=64,
    )
    return StaticCache(config=config, max_cache_len=16).layers[0]


def windowed_attention(query, keys, values, query_positions, key_positions):
    """Softmax attention of each query over the keys at positions within its sliding window (causal)."""
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = (distance >= 0) & (distance < WINDOW)
    scores = (query @ keys.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ values


class SlidingWindowRingTest(unittest.TestCase):
    def run_side_by_side(self, query_lengths, seed=0):
        upstream, ring = sliding_layer(), sliding_layer()
        self.assertEqual(type(upstream), transformers_api.StaticSlidingWindowLayer)
        SlidingWindowRing.open(ring)
        generator = torch.Generator().manual_seed(seed)
        seen_keys, seen_values, held = [], [], 0
        for new in query_lengths:
            with self.subTest(held=held, new=new):
                keys = torch.randn(1, 1, new, HEAD_DIM, generator=generator)
                values = torch.randn(1, 1, new, HEAD_DIM, generator=generator)
                query = torch.randn(1, 1, new, HEAD_DIM, generator=generator)
                ring.set_tokens(held + new)
                read_slots, first_position = ring.get_mask_sizes(new)
                upstream.update(keys, values)
                read_keys, read_values = ring.update(keys, values)
                seen_keys.append(keys)
                seen_values.append(values)
                all_keys, all_values = torch.cat(seen_keys, -2), torch.cat(seen_values, -2)

                # Upstream's storage and count.
                self.assertTrue(torch.equal(ring.keys, upstream.keys))
                self.assertTrue(torch.equal(ring.values, upstream.values))
                self.assertEqual(int(ring.get_seq_length()), upstream.get_seq_length())
                self.assertEqual(int(ring.get_seq_length()), held + new)
                # It reads the window's slots then the new tokens, slot `j` holding the position `start + j`.
                start = max(0, held - WINDOW)
                self.assertEqual((read_slots, first_position), (WINDOW + new, start))
                self.assertEqual(read_keys.shape[-2], read_slots)
                filled = held + new - start
                self.assertTrue(torch.equal(read_keys[..., :filled, :], all_keys[..., start : start + filled, :]))
                self.assertTrue(torch.equal(read_values[..., :filled, :], all_values[..., start : start + filled, :]))
                # So attention over what it reads, slots past the new tokens masked as later positions, is attention
                # over every token seen.
                query_positions = torch.arange(held, held + new)
                ring_out = windowed_attention(
                    query, read_keys, read_values, query_positions, torch.arange(start, start + read_slots)
                )
                full_out = windowed_attention(query, all_keys, all_values, query_positions, torch.arange(held + new))
                torch.testing.assert_close(ring_out, full_out)
            held += new
        return upstream, ring

    def test_short_prefill_then_decode_past_the_window(self):
        self.run_side_by_side([3, 1, 1, 1, 2, 1, 1])

    def test_prefill_longer_than_the_window(self):
        self.run_side_by_side([7, 1, 3, 1], seed=1)

    def test_close_hands_upstream_the_count(self):
        upstream, ring = self.run_side_by_side([3, 1, 1, 1, 2], seed=2)
        SlidingWindowRing.close(ring)
        self.assertIs(type(ring), transformers_api.StaticSlidingWindowLayer)
        self.assertNotIn("overflow", ring.__dict__)
        self.assertEqual(ring.cumulative_length_int, upstream.cumulative_length_int)
        # Upstream's own update goes on from there as on its own layer.
        keys, values = torch.randn(1, 1, 1, HEAD_DIM), torch.randn(1, 1, 1, HEAD_DIM)
        for out_ring, out_upstream in zip(ring.update(keys, values), upstream.update(keys, values), strict=True):
            self.assertTrue(torch.equal(out_ring, out_upstream))
        self.assertTrue(torch.equal(ring.keys, upstream.keys))

    def test_open_takes_upstreams_count(self):
        # A layer upstream filled past its window (its tensor count stops there), then opened as a ring.
        upstream, opened = sliding_layer(), sliding_layer()
        generator = torch.Generator().manual_seed(3)
        for new in (3, 1, 1, 1, 1):
            keys = torch.randn(1, 1, new, HEAD_DIM, generator=generator)
            upstream.update(keys, keys)
            opened.update(keys, keys)
        SlidingWindowRing.open(opened)
        self.assertIsNone(opened.overflow)
        self.assertEqual(int(opened.get_seq_length()), upstream.get_seq_length())
        keys = torch.randn(1, 1, 1, HEAD_DIM, generator=generator)
        upstream.update(keys, keys)
        opened.update(keys, keys)
        self.assertTrue(torch.equal(opened.keys, upstream.keys))
        self.assertEqual(int(opened.get_seq_length()), upstream.get_seq_length())

    def test_mask_sizes_without_set_tokens(self):
        # Not told the tokens: counted from the tensor, as `set_tokens` would have said.
        ring = sliding_layer()
        SlidingWindowRing.open(ring)
        for new in (6, 1, 1):
            told = sliding_layer()
            SlidingWindowRing.open(told)
            told.cumulative_length.fill_(int(ring.cumulative_length))
            told.set_tokens(int(ring.cumulative_length) + new)
            self.assertEqual(ring.get_mask_sizes(new), told.get_mask_sizes(new))
            ring.update(torch.randn(1, 1, new, HEAD_DIM), torch.randn(1, 1, new, HEAD_DIM))


if __name__ == "__main__":
    unittest.main()
