# `save_compile_cache` / `load_compile_cache`: the archive of torch's cache artifacts and inductor's C++ kernels.
#
# Compiling with inductor takes a minute here, so these tests don't: torch's artifact functions are replaced by
# stand-ins, and a "kernel" is a file in a temporary inductor cache directory, loaded in the sense inductor loads one
# (a module in `sys.modules` whose `__file__` is the library). `utils/measure_warm_start.py` measures the real thing.

import os
import sys
import tempfile
import types
import unittest
import zipfile
from unittest import mock

import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import compile_cache


ARTIFACTS = b"\x95bu\xf6 torch cache artifacts"
KERNEL = os.path.join("ab", "cabkernel.main.so")
logger = logging.get_logger("prefill_buckets.compile_cache")


class CompileCacheTest(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name
        self.path = os.path.join(self.tmp, "compile_cache.bin")
        env = mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": self.cache_dir("cold")})
        env.start()
        self.addCleanup(env.stop)
        save = mock.patch.object(torch.compiler, "save_cache_artifacts", return_value=(ARTIFACTS, None))
        self.load = mock.patch.object(torch.compiler, "load_cache_artifacts", return_value=object()).start()
        save.start()
        self.addCleanup(mock.patch.stopall)

    def cache_dir(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def build_kernel(self, relative: str = KERNEL, loaded: bool = True) -> bytes:
        """A "kernel" in the current inductor cache directory; `loaded` registers it as inductor's loaded module."""
        path = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        content = b"\x7fELF " + relative.encode()
        with open(path, "wb") as f:
            f.write(content)
        if loaded:
            module = types.ModuleType(f"{os.path.basename(relative)}.kernel")
            module.__file__ = path
            sys.modules[module.__name__] = module
            self.addCleanup(sys.modules.pop, module.__name__, None)
        return content

    def use_cache_dir(self, name: str) -> str:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir(name)
        return self.cache_dir(name)

    def test_round_trip_restores_loaded_kernels(self):
        content = self.build_kernel()
        self.build_kernel(os.path.join("cd", "cnotloaded.main.so"), loaded=False)
        written = prefill_buckets.save_compile_cache(self.path)
        self.assertEqual(written, os.path.getsize(self.path))
        with zipfile.ZipFile(self.path) as archive:
            self.assertEqual(archive.read("torch_cache_artifacts.bin"), ARTIFACTS)
            # The loaded kernel only: the other library belongs to no graph of this process.
            self.assertEqual(
                sorted(name for name in archive.namelist() if name.startswith("inductor_kernels/")),
                ["inductor_kernels/ab/cabkernel.main.so"],
            )

        warm = self.use_cache_dir("warm")  # a new process: an empty cache directory
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        self.load.assert_called_once_with(ARTIFACTS)
        with open(os.path.join(warm, KERNEL), "rb") as f:
            self.assertEqual(f.read(), content)
        self.assertEqual(os.listdir(warm), ["ab"])

    def test_kernel_already_in_cache_dir_is_kept(self):
        self.build_kernel()
        prefill_buckets.save_compile_cache(self.path)
        warm = self.use_cache_dir("warm")
        os.makedirs(os.path.join(warm, "ab"))
        with open(os.path.join(warm, KERNEL), "wb") as f:
            f.write(b"built here")
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        with open(os.path.join(warm, KERNEL), "rb") as f:
            self.assertEqual(f.read(), b"built here")

    def test_isa_probes_are_saved(self):
        from torch._inductor.cpu_vec_isa import VecISA

        cold = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        probe = os.path.join(cold, "ef", "cefprobe")
        os.makedirs(os.path.dirname(probe))
        with open(probe + ".cpp", "w") as f:
            f.write(VecISA._avx_code)
        with open(probe + ".so", "wb") as f:
            f.write(b"\x7fELF probe")
        with open(os.path.join(cold, "ef", "cefother.cpp"), "w") as f:  # another program: not a probe
            f.write("int main() { return 0; }\n")
        with open(os.path.join(cold, "ef", "cefother.so"), "wb") as f:
            f.write(b"\x7fELF other")
        prefill_buckets.save_compile_cache(self.path)
        with zipfile.ZipFile(self.path) as archive:
            kernels = [name for name in archive.namelist() if name.startswith("inductor_kernels/")]
        self.assertEqual(kernels, ["inductor_kernels/ef/cefprobe.so"])

    def test_other_cpu_skips_kernels(self):
        self.build_kernel()
        prefill_buckets.save_compile_cache(self.path)
        warm = self.use_cache_dir("warm")
        with mock.patch.object(compile_cache, "_cpu_fingerprint", return_value="another cpu"):
            with CaptureLogger(logger) as captured:
                self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        self.assertIn("other CPU features", captured.out)
        self.load.assert_called_once_with(ARTIFACTS)
        self.assertFalse(os.path.exists(os.path.join(warm, KERNEL)))

    def test_loads_artifacts_file_of_earlier_versions(self):
        # Earlier versions wrote torch's artifacts alone, as they come.
        with open(self.path, "wb") as f:
            f.write(ARTIFACTS)
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        self.load.assert_called_once_with(ARTIFACTS)

    def test_nothing_to_save(self):
        with mock.patch.object(torch.compiler, "save_cache_artifacts", return_value=None):
            with CaptureLogger(logger) as captured:
                self.assertEqual(prefill_buckets.save_compile_cache(self.path), 0)
        self.assertIn("Nothing compiled in this process can be saved", captured.out)
        self.assertFalse(os.path.exists(self.path))

    def test_path_outside_cache_dir_raises(self):
        prefill_buckets.save_compile_cache(self.path)
        with zipfile.ZipFile(self.path, "a") as archive:
            archive.writestr("inductor_kernels/../escape.so", b"")
        self.use_cache_dir("warm")
        with self.assertRaisesRegex(ValueError, "escape.so"):
            prefill_buckets.load_compile_cache(self.path)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "escape.so")))
