"""The compile-cache archive: what inductor compiled in one process, in a file that another process loads."""

import glob
import hashlib
import io
import json
import os
import platform
import sys
import zipfile
from pathlib import Path

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

# `save_compile_cache` writes a zip archive: a manifest, torch's cache artifacts, and the C++ kernels under `_KERNELS`
# at their paths relative to inductor's cache directory.
_ARCHIVE_FORMAT = 1
_MANIFEST = "manifest.json"
_ARTIFACTS = "torch_cache_artifacts.bin"
_KERNELS = "inductor_kernels/"
_ZIP_MAGIC = b"PK\x03\x04"


def save_compile_cache(path: str | os.PathLike) -> int:
    r"""
    Writes what this process compiled with inductor to `path`, so that another process can load it with
    [`load_compile_cache`] before it compiles, and then compile nothing but dynamo's graphs.

    The file is a zip archive that holds:

    - torch's cache artifacts (`torch.compiler.save_cache_artifacts`): the compiled graphs (inductor's and AOTAutograd's
      caches), Triton kernels on GPU, and autotuning results;
    - the C++ kernels (shared libraries in inductor's cache directory) this process loaded, and inductor's probes of
      the CPU's vector instruction sets. torch's artifacts don't carry them, and without them a new process builds
      every CPU kernel again with the C++ compiler, which is most of the compile time on CPU.

    The kernels are built for this machine's CPU (`-march=native`): [`load_compile_cache`] only installs them on a
    machine with the same CPU features, and otherwise loads the rest.

    Args:
        path (`str` or `os.PathLike`):
            The file to write (overwritten).

    Returns:
        `int`: the number of bytes written, 0 (and no file) when nothing was compiled with inductor in this process.
    """
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        logger.warning("Nothing compiled in this process can be saved (no inductor artifacts).")
        return 0
    artifacts, _ = saved
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = cache_dir()
    kernels = _kernels(root)
    manifest = {"format": _ARCHIVE_FORMAT, "torch": torch.__version__, "cpu": _cpu_fingerprint()}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(_MANIFEST, json.dumps(manifest))
        archive.writestr(_ARTIFACTS, artifacts)
        for kernel in kernels:
            archive.write(kernel, _KERNELS + Path(os.path.relpath(kernel, root)).as_posix())
    logger.info(f"save_compile_cache: torch's artifacts ({len(artifacts)} bytes) and {len(kernels)} C++ kernels")
    return os.path.getsize(path)


def load_compile_cache(path: str | os.PathLike) -> bool:
    r"""
    Loads a file written by [`save_compile_cache`] into this process, so that compiling the same graphs (for example
    with [`precompile`]) reuses the saved graphs and kernels instead of generating and building them. Call it before
    the first compile.

    torch's artifacts go to its in-process and on-disk caches; the C++ kernels are copied into inductor's cache
    directory (`TORCHINDUCTOR_CACHE_DIR`), where a kernel already there is kept. The kernels are skipped, with a
    warning, when the file was written on a machine with other CPU features: inductor then builds them again. A file
    written by an earlier version (torch's artifacts alone) loads as before.

    Args:
        path (`str` or `os.PathLike`):
            A file written by [`save_compile_cache`].

    Returns:
        `bool`: whether anything was loaded.
    """
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_ZIP_MAGIC):  # written before kernels were saved: torch's artifacts alone
        return torch.compiler.load_cache_artifacts(data) is not None
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        manifest = json.loads(archive.read(_MANIFEST))
        if manifest.get("format") != _ARCHIVE_FORMAT:
            raise ValueError(
                f"{path} has compile cache format {manifest.get('format')!r}, expected {_ARCHIVE_FORMAT}."
            )
        kernels = [name for name in archive.namelist() if name.startswith(_KERNELS) and not name.endswith("/")]
        restored = 0
        if kernels and manifest.get("cpu") != _cpu_fingerprint():
            logger.warning(
                f"{path} was written on a machine with other CPU features: its {len(kernels)} C++ kernels are not "
                "loaded (inductor builds them again), the rest is."
            )
        elif kernels:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            restored = _restore_kernels(archive, kernels, cache_dir())
        loaded = torch.compiler.load_cache_artifacts(archive.read(_ARTIFACTS)) is not None
    logger.info(f"load_compile_cache: torch's artifacts loaded: {loaded}, C++ kernels copied: {restored}")
    return loaded or restored > 0


def _kernels(root: str) -> list[str]:
    """
    The C++ libraries in inductor's cache directory `root` that a new process would otherwise build again: the kernels
    this process loaded, and inductor's probes of the CPU's vector instruction sets.
    """
    # Inductor keeps each library at `root/<2 characters>/<hash>[.main].so`, the hash being of the source and the
    # compiler's command line. Most kernels are loaded as Python extension modules (in `sys.modules`), some with
    # `ctypes`: on Linux, `/proc/self/maps` lists both.
    files = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            files.update(line.split(maxsplit=5)[-1].strip() for line in f if line.count(" ") >= 5)
    except OSError:
        pass
    prefix = os.path.join(root, "")
    kernels = {
        file
        for file in files
        if isinstance(file, str) and file.startswith(prefix) and not file.endswith(".py") and os.path.isfile(file)
    }
    return sorted(kernels | set(_isa_probes(root)))


def _isa_probes(root: str) -> list[str]:
    """
    The libraries inductor builds in `root`, at the first compile of each process, to test which vector instruction
    sets (AVX2, AVX-512, ...) the compiler and CPU support, one small C++ program per set (the `*_code` sources of
    `torch._inductor.cpu_vec_isa`). A subprocess loads them, so `_kernels` doesn't see them as loaded.
    """
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return []
    sources = {
        value.strip()
        for cls in vars(cpu_vec_isa).values()
        if isinstance(cls, type)
        for name, value in vars(cls).items()
        if name.endswith("_code") and isinstance(value, str)
    }
    probes = []
    for source in glob.glob(os.path.join(root, "??", "*.cpp")):
        library = source[: -len(".cpp")] + ".so"
        if os.path.getsize(source) < 4096 and os.path.isfile(library):
            with open(source, encoding="utf-8", errors="replace") as f:
                if f.read().strip() in sources:
                    probes.append(library)
    return probes


def _restore_kernels(archive: zipfile.ZipFile, names: list[str], root: str) -> int:
    """Copies the kernels `names` of `archive` into `root` (keeping those already there); returns how many it copied."""
    restored = 0
    for name in names:
        parts = name[len(_KERNELS) :].split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"Unexpected file name in a compile cache: {name!r}.")
        target = os.path.join(root, *parts)
        if os.path.exists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = f"{target}.{os.getpid()}.tmp"  # renamed into place, so no process loads a half-written kernel
        with open(partial, "wb") as f:
            f.write(archive.read(name))
        os.chmod(partial, 0o755)
        os.replace(partial, target)
        restored += 1
    return restored


def _cpu_fingerprint() -> str:
    """What the C++ kernels depend on besides their compiler command line: the architecture and its CPU features."""
    features = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    features = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {features}".encode()).hexdigest()[:16]
