# `save_compile_cache` / `load_compile_cache`: the archive of torch's cache artifacts and inductor's C++ kernels, and
# every kind of bad file it refuses.
#
# Compiling with inductor takes a minute here, so these tests don't: torch's artifact functions are replaced by
# stand-ins, and a "kernel" is a file in a temporary inductor cache directory, loaded in the sense inductor loads one
# (a module in `sys.modules` whose `__file__` is the library). `utils/measure_warm_start.py` measures the real thing.

import hashlib
import json
import multiprocessing
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
from prefill_buckets.compile import aot_forward, archive
from prefill_buckets.testing_utils import as_new_process


ARTIFACTS = b"\x95bu\xf6 torch cache artifacts"
KERNEL = os.path.join("ab", "cabkernel.main.so")
logger = logging.get_logger("prefill_buckets.compile.archive")


class CompileCacheTest(unittest.TestCase):
    def setUp(self):
        # Each test plays a process of its own: no `aot_forward` of an earlier test has graphs to save.
        self.enterContext(as_new_process())
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
        saved = prefill_buckets.save_compile_cache(self.path)
        self.assertEqual(saved.size, os.path.getsize(self.path))
        with open(self.path, "rb") as f:
            self.assertEqual(saved.sha256, hashlib.sha256(f.read()).hexdigest())
        self.assertEqual((saved.path, saved.kernels), (self.path, 1))
        self.assertEqual(sorted(os.listdir(self.tmp)), ["cold", "compile_cache.bin"])  # no temporary file left
        with zipfile.ZipFile(self.path) as archive:
            self.assertEqual(archive.read("torch_cache_artifacts.bin"), ARTIFACTS)
            # The loaded kernel only: the other library belongs to no graph of this process.
            self.assertEqual(
                sorted(name for name in archive.namelist() if name.startswith("inductor_kernels/")),
                ["inductor_kernels/ab/cabkernel.main.so"],
            )

        warm = self.use_cache_dir("warm")  # a new process: an empty cache directory
        self.assertTrue(prefill_buckets.load_compile_cache(self.path, sha256=saved.sha256.upper()))
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

    def test_nothing_to_save(self):
        with mock.patch.object(torch.compiler, "save_cache_artifacts", return_value=None):
            with CaptureLogger(logger) as captured:
                self.assertIsNone(prefill_buckets.save_compile_cache(self.path))
        self.assertIn("Nothing compiled in this process can be saved", captured.out)
        self.assertFalse(os.path.exists(self.path))

    def test_save_is_atomic(self):
        self.build_kernel()
        first = prefill_buckets.save_compile_cache(self.path)
        # A save that fails half-way leaves the previous file whole, and no temporary file.
        with mock.patch.object(zipfile.ZipFile, "write", side_effect=OSError("disk full")):
            with self.assertRaisesRegex(OSError, "disk full"):
                prefill_buckets.save_compile_cache(self.path)
        with open(self.path, "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), first.sha256)
        self.assertEqual(sorted(os.listdir(self.tmp)), ["cold", "compile_cache.bin"])

    def test_concurrent_saves_and_loads(self):
        # Two processes save to one path, over and over, while a third loads it: every load gets a whole file.
        self.build_kernel()
        prefill_buckets.save_compile_cache(self.path)
        context = multiprocessing.get_context("fork")  # the children keep this test's stand-ins for torch's functions
        stop = context.Event()
        savers = [context.Process(target=_save_until, args=(self.path, stop, seed)) for seed in (1, 2)]
        for saver in savers:
            saver.start()
        try:
            results = context.Queue()
            loader = context.Process(target=_load_repeatedly, args=(self.path, 200, results))
            loader.start()
            loaded, refusals = results.get(timeout=120)
            loader.join()
        finally:
            stop.set()
            for saver in savers:
                saver.join()
        self.assertEqual(refusals, [])
        self.assertEqual(loaded, 200)
        self.assertEqual(sorted(os.listdir(self.tmp)), ["cold", "compile_cache.bin"])


def _save_until(path: str, stop, seed: int) -> None:
    """In a child process: saves `path` (artifacts of a size that `seed` sets) until `stop` is set."""
    artifacts = os.urandom(seed * 300_000)  # incompressible: a save takes a while
    with mock.patch.object(torch.compiler, "save_cache_artifacts", return_value=(artifacts, None)):
        while not stop.is_set():
            prefill_buckets.save_compile_cache(path)


def _load_repeatedly(path: str, times: int, results) -> None:
    """In a child process: loads `path` `times` times; puts how many loaded, and the warnings of those that didn't."""
    loaded, refusals = 0, []
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    for _ in range(times):
        with CaptureLogger(logger) as captured:
            ok = prefill_buckets.load_compile_cache(path)
        loaded += ok
        if not ok:
            refusals.append(captured.out)
    results.put((loaded, refusals))


class BadFileTest(unittest.TestCase):
    """Every kind of file `load_compile_cache` can't use: one warning, `False`, and nothing installed."""

    def setUp(self):
        self.enterContext(as_new_process())
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name
        self.path = os.path.join(self.tmp, "compile_cache.bin")
        self.warm = os.path.join(self.tmp, "warm")
        env = mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": os.path.join(self.tmp, "cold")})
        env.start()
        self.addCleanup(env.stop)
        mock.patch.object(torch.compiler, "save_cache_artifacts", return_value=(ARTIFACTS, None)).start()
        self.load = mock.patch.object(torch.compiler, "load_cache_artifacts", return_value=object()).start()
        self.addCleanup(mock.patch.stopall)
        kernel = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], KERNEL)
        os.makedirs(os.path.dirname(kernel))
        with open(kernel, "wb") as f:
            f.write(b"\x7fELF kernel" * 100)
        module = types.ModuleType("bad_file_test.kernel")
        module.__file__ = kernel
        sys.modules[module.__name__] = module
        self.addCleanup(sys.modules.pop, module.__name__, None)
        self.saved = prefill_buckets.save_compile_cache(self.path)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.warm  # a new process: an empty cache directory
        with open(self.path, "rb") as f:
            self.good = f.read()

    def write(self, data: bytes) -> None:
        with open(self.path, "wb") as f:
            f.write(data)

    def rewrite(self, drop=(), add=None, manifest=None) -> None:
        """The saved archive without the entries `drop`, with the entries `add`, and the manifest's keys `manifest`."""
        with zipfile.ZipFile(self.path) as archive:
            entries = {name: archive.read(name) for name in archive.namelist() if name not in drop}
        if manifest is not None:
            entries["manifest.json"] = json.dumps(json.loads(entries["manifest.json"]) | manifest).encode()
        entries.update(add or {})
        with zipfile.ZipFile(self.path, "w") as archive:
            for name, content in entries.items():
                archive.writestr(name, content)

    def assert_refused(self, reason: str, **kwargs) -> None:
        with CaptureLogger(logger) as captured:
            self.assertFalse(prefill_buckets.load_compile_cache(self.path, **kwargs))
        self.assertEqual(captured.out.count("Not loading the compile cache"), 1, captured.out)
        self.assertIn(f"Not loading the compile cache {self.path}: ", captured.out)
        self.assertIn(reason, captured.out)
        self.load.assert_not_called()
        self.assertFalse(os.path.exists(self.warm), "something was installed into the cache directory")

    def test_good_file_loads(self):  # the positive control of every test below
        self.assertTrue(prefill_buckets.load_compile_cache(self.path, sha256=self.saved.sha256))
        self.load.assert_called_once_with(ARTIFACTS)
        self.assertTrue(os.path.exists(os.path.join(self.warm, KERNEL)))

    def test_missing(self):
        os.remove(self.path)
        self.assert_refused("it can't be read (FileNotFoundError")

    def test_empty(self):
        self.write(b"")
        self.assert_refused("it is empty")

    def test_truncated(self):
        for size in (len(self.good) // 2, len(self.good) - 10, 10):
            with self.subTest(size=size):
                self.write(self.good[:size])
                self.assert_refused("truncated or corrupt (BadZipFile")

    def test_corrupt_entry(self):
        # Damage the kernel's compressed bytes, not the archive's structure: only reading the entry finds it.
        with zipfile.ZipFile(self.path) as archive:
            info = archive.getinfo("inductor_kernels/" + KERNEL.replace(os.sep, "/"))
        start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 2
        damaged = bytearray(self.good)
        damaged[start : start + 4] = bytes(b ^ 0xFF for b in damaged[start : start + 4])
        self.write(bytes(damaged))
        self.assert_refused("truncated or corrupt")

    def test_foreign_format(self):
        self.write(b"GIF89a" + bytes(100))
        self.assert_refused("not a compile cache archive")

    def test_artifacts_file_of_earlier_versions(self):
        # Earlier versions wrote torch's artifacts alone: no manifest to check them against this process.
        self.write(ARTIFACTS)
        self.assert_refused("written by an earlier version of prefill_buckets")

    def test_foreign_zip(self):
        with zipfile.ZipFile(self.path, "w") as archive:
            archive.writestr("word/document.xml", b"<w:document/>")
        self.assert_refused("it has no manifest.json")

    def test_missing_manifest(self):
        self.rewrite(drop=["manifest.json"])
        self.assert_refused("it has no manifest.json")

    def test_missing_artifacts(self):
        self.rewrite(drop=["torch_cache_artifacts.bin"])
        self.assert_refused("it has no torch_cache_artifacts.bin")

    def test_manifest_not_json(self):
        self.rewrite(add={"manifest.json": b"\x80 not json"})
        self.assert_refused("its manifest.json is not JSON")
        self.rewrite(add={"manifest.json": b"[2]"})
        self.assert_refused("its manifest.json is not a JSON object")

    def test_unknown_format_version(self):
        current = archive._ARCHIVE_FORMAT
        for version in (*range(1, current), current + 1, None):  # every earlier format, the next one, none
            with self.subTest(version=version):
                self.rewrite(manifest={"format": version})
                self.assert_refused(f"it has compile cache format {version!r}, and this version of prefill_buckets")

    def test_unexpected_entry(self):
        self.rewrite(add={"run_me.py": b"import os"})
        self.assert_refused("it holds an unexpected entry 'run_me.py'")

    def test_entry_outside_cache_dir(self):
        for name in ("../escape.so", "ab/../../escape.so", "/escape.so", "ab//escape.so", "ab\\..\\escape.so"):
            with self.subTest(name=name):
                self.rewrite(add={"inductor_kernels/" + name: b"\x7fELF"})
                self.assert_refused("points outside the cache directory")
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "escape.so")))

    def test_oversized(self):
        self.assert_refused(
            f"it is {len(self.good)} bytes, more than `max_bytes={len(self.good) - 1}`", max_bytes=len(self.good) - 1
        )
        # A small file that expands to more: the kernel compresses 100 to 1.
        self.assert_refused("its entries expand to", max_bytes=len(self.good) + 10)

    def test_hash_mismatch(self):
        other = hashlib.sha256(b"another file").hexdigest()
        self.assert_refused(f"its SHA-256 is {self.saved.sha256}, not the expected {other}", sha256=other)

    def test_bad_hash_argument(self):
        for value in ("abc", "sha256:" + self.saved.sha256, self.saved.sha256[:-1] + "g", 123):
            with self.subTest(value=value):
                with self.assertRaisesRegex(ValueError, "`sha256` must be a SHA-256 hex digest"):
                    prefill_buckets.load_compile_cache(self.path, sha256=value)

    def test_stale_file(self):
        for key, what in (
            ("torch", "torch version"),
            ("transformers", "transformers version"),
            ("python", "python version"),
            ("cpu", "CPU features"),
        ):
            with self.subTest(key=key):
                self.write(self.good)
                self.rewrite(manifest={key: "0.0"})
                self.assert_refused(f"it is stale: written with {what} '0.0', and this process has")

    def test_torch_cant_read_artifacts(self):
        self.load.return_value = None  # torch's deserializer failed: it installed nothing
        with CaptureLogger(logger) as captured:
            self.assertFalse(prefill_buckets.load_compile_cache(self.path))
        self.assertIn("torch can't read the cache artifacts it holds", captured.out)
        self.assertFalse(os.path.exists(self.warm))


class CompiledForwardsTest(unittest.TestCase):
    """The graphs of `aot_forward` in the archive: saved with their metadata, staged at load, checked like the rest."""

    FORWARD = (
        {
            "key": "[0]",
            "fingerprint": "f" * 32,
            "forward": "m:C",
            "modules": {"___module_collections_1_c0": "collections"},
        },
        b"fn",
    )

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name
        self.path = os.path.join(self.tmp, "compile_cache.bin")
        mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": os.path.join(self.tmp, "cold")}).start()
        mock.patch.object(torch.compiler, "save_cache_artifacts", return_value=None).start()  # another backend
        self.load = mock.patch.object(torch.compiler, "load_cache_artifacts", return_value=object()).start()
        mock.patch.object(aot_forward, "compiled_functions", return_value=[self.FORWARD]).start()
        self.stage = mock.patch.object(aot_forward, "stage").start()
        self.addCleanup(mock.patch.stopall)
        self.saved = prefill_buckets.save_compile_cache(self.path)

    def manifest(self) -> dict:
        with zipfile.ZipFile(self.path) as archive:
            return json.loads(archive.read("manifest.json"))

    def rewrite(self, manifest=None, add=None, drop=()) -> None:
        with zipfile.ZipFile(self.path) as archive:
            entries = {name: archive.read(name) for name in archive.namelist() if name not in drop}
        if manifest is not None:
            entries["manifest.json"] = json.dumps(manifest).encode()
        entries.update(add or {})
        with zipfile.ZipFile(self.path, "w") as archive:
            for name, content in entries.items():
                archive.writestr(name, content)

    def assert_refused(self, reason: str) -> None:
        with CaptureLogger(logger) as captured:
            self.assertFalse(prefill_buckets.load_compile_cache(self.path))
        self.assertIn(reason, captured.out)
        self.stage.assert_not_called()

    def test_saved_and_staged(self):
        self.assertIsNotNone(self.saved)  # no inductor artifacts, but a compiled forward: saved
        meta = self.manifest()["aot_forwards"]
        self.assertEqual(meta, [{**self.FORWARD[0], "file": "aot_forwards/0.bin"}])
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        self.load.assert_not_called()  # no torch artifacts to load
        self.stage.assert_called_once_with([(meta[0], b"fn")], self.path)

    def test_malformed_list(self):
        manifest = self.manifest()
        for bad in ("not a list", [{"file": "aot_forwards/0.bin"}], [{**manifest["aot_forwards"][0], "modules": [1]}]):
            with self.subTest(bad=bad):
                self.rewrite(manifest={**manifest, "aot_forwards": bad})
                self.assert_refused("has a malformed list of compiled forwards")

    def test_listed_but_missing(self):
        self.rewrite(drop=["aot_forwards/0.bin"])
        self.assert_refused("its manifest lists compiled forwards it doesn't hold: ['aot_forwards/0.bin']")

    def test_not_listed(self):
        self.rewrite(add={"aot_forwards/1.bin": b"fn"})
        self.assert_refused("it holds an unexpected entry 'aot_forwards/1.bin'")
