# The transformers names the package reads (`upstream/transformers_api.py`): a model's text config, read only where
# its config may nest one.

import inspect
import types
import unittest

import transformers
from transformers import LlamaConfig

from prefill_buckets.upstream import transformers_api


class TextConfigTest(unittest.TestCase):
    def test_only_configs_that_may_nest_one_ask_for_their_text_config(self):
        # `max_positions` reads the text config, and asks `get_text_config()` (slow: each name it looks under goes
        # through the config's attribute hooks) only of configs that may nest one: for every config class of
        # transformers, one that doesn't is its own text config.
        checked = 0
        for name in dir(transformers):
            if not name.endswith("Config"):
                continue
            try:  # a lazily imported name whose module needs what this machine lacks raises here
                config_class = getattr(transformers, name)
                if not (inspect.isclass(config_class) and issubclass(config_class, transformers.PretrainedConfig)):
                    continue
                config = config_class()
            except Exception:  # noqa: BLE001 (also a config that needs arguments)
                continue
            checked += 1
            if not transformers_api._may_nest_a_text_config(config):
                self.assertIs(config.get_text_config(), config, name)
        self.assertGreater(checked, 100)

    def test_a_text_config_set_on_the_instance_is_read(self):
        config = LlamaConfig(max_position_embeddings=512)
        model = types.SimpleNamespace(config=config)
        self.assertEqual(transformers_api.max_positions(model), 512)
        config.text_config = LlamaConfig(max_position_embeddings=77)
        self.assertEqual(transformers_api.max_positions(model), 77)

    def test_a_config_class_with_its_own_get_text_config_is_asked(self):
        class OwnTextConfig(LlamaConfig):  # as a model's remote code may define it
            def get_text_config(self, *args, **kwargs):
                return LlamaConfig(max_position_embeddings=33)

        model = types.SimpleNamespace(config=OwnTextConfig(max_position_embeddings=512))
        self.assertEqual(transformers_api.max_positions(model), 33)
