"""The compile-cache archive: what inductor compiled in one process, in a file that another process loads."""

import contextlib
import glob
import hashlib
import io
import json
import os
import platform
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers.utils import logging

from ..buckets import check_positive_int
from ..forgotten_enable import generation_configs, warn_if_enable_forgotten
from ..state import PROCESS
from ..upstream import torch_api
from . import aot_forward


logger = logging.get_logger(__name__)

# `save_compile_cache` writes a zip archive: a manifest, torch's cache artifacts, the C++ kernels under `_KERNELS` at
# their paths relative to inductor's cache directory, and the graphs of `aot_forward`s under `_FORWARDS`.
# 1: no transformers or Python version in the manifest; 2: compiled forwards keyed by their input shapes alone, which
# don't tell a fresh cache's graph from a continued one's (`aot_key.py`); 3: keys without the attention windows.
_ARCHIVE_FORMAT = 4
_MANIFEST = "manifest.json"
_ARTIFACTS = "torch_cache_artifacts.bin"
_KERNELS = "inductor_kernels/"
_FORWARDS = "aot_forwards/"
_ZIP_MAGIC = b"PK\x03\x04"
_MAX_BYTES = 4 * 2**30  # default limit on a file's size, and on what its entries expand to
_MAX_ENTRIES = 100_000
_SHA256_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class CompileCacheFile:
    """A file written by [`save_compile_cache`]: publish `sha256` with it, and pass it to [`load_compile_cache`]."""

    path: str
    size: int  # bytes
    sha256: str  # hex digest of the file's bytes
    kernels: int  # C++ kernels it holds


class _Refused(Exception):
    """Why a compile cache file is not loaded (the text follows "Not loading the compile cache PATH: ")."""


def save_compile_cache(path: str | os.PathLike) -> CompileCacheFile | None:
    r"""
    Writes what this process compiled with inductor to `path`, so that another process can load it with
    [`load_compile_cache`] before it compiles, and then compile nothing but dynamo's graphs.

    The file is a zip archive of a manifest (the torch, transformers and Python versions and the CPU, which
    [`load_compile_cache`] checks), torch's cache artifacts (`torch.compiler.save_cache_artifacts`), the graphs of
    [`aot_forward`]s, and the C++ kernels this process loaded with inductor's probes of the CPU's vector instruction
    sets: torch's artifacts don't carry them, and building them again is most of the compile time on CPU.

    <Tip warning={true}>

    The file is executable code: torch's artifacts are pickles, and the kernels are shared libraries that a process
    loading the file runs. Whoever can write the file runs code in every process that loads it. Keep it where only
    you can write it, and load it with its `sha256` (see [`load_compile_cache`]).

    </Tip>

    The file is written atomically (a temporary file in the same directory, mode 0644, renamed to `path`): a reader
    sees the previous file or the new one, never part of one.

    Args:
        path (`str` or `os.PathLike`):
            The file to write (replaced).

    Returns:
        [`CompileCacheFile`] or `None`: the file written, with its size and SHA-256; `None` (and no file) when nothing
        was compiled with inductor in this process.
    """
    warn_if_enable_forgotten(
        "save_compile_cache", generation_configs(*[forward.model for forward in list(PROCESS.aot_forwards)])
    )
    saved = torch.compiler.save_cache_artifacts()
    forwards = aot_forward.compiled_functions()
    if saved is None and not forwards:
        logger.warning("Nothing compiled in this process can be saved (no inductor artifacts).")
        return None
    artifacts = saved[0] if saved is not None else b""  # none with a backend other than inductor
    root = torch_api.inductor_cache_dir()
    kernels = _kernels(root)
    files = [{**meta, "file": f"{_FORWARDS}{index}.bin"} for index, (meta, _) in enumerate(forwards)]
    manifest = _environment() | {"format": _ARCHIVE_FORMAT, "aot_forwards": files}
    path = os.fspath(path)
    descriptor, partial = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w+b") as f:
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as archive:
                archive.writestr(_MANIFEST, json.dumps(manifest))
                archive.writestr(_ARTIFACTS, artifacts)
                for meta, (_, data) in zip(manifest["aot_forwards"], forwards):
                    archive.writestr(meta["file"], data)
                for kernel in kernels:
                    archive.write(kernel, _KERNELS + Path(os.path.relpath(kernel, root)).as_posix())
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            digest = hashlib.sha256()
            for block in iter(lambda: f.read(2**20), b""):
                digest.update(block)
            size = f.tell()
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
    logger.info(
        f"save_compile_cache: torch's artifacts ({len(artifacts)} bytes), {len(kernels)} C++ kernels, "
        f"{len(forwards)} compiled forwards"
    )
    return CompileCacheFile(path=path, size=size, sha256=digest.hexdigest(), kernels=len(kernels))


def load_compile_cache(path: str | os.PathLike, sha256: str | None = None, max_bytes: int = _MAX_BYTES) -> bool:
    r"""
    Loads a file written by [`save_compile_cache`] into this process, so that compiling the same graphs (for example
    with [`precompile`]) reuses the saved graphs and kernels instead of generating and building them. Call it before
    the first compile.

    The C++ kernels are copied into inductor's cache directory (`TORCHINDUCTOR_CACHE_DIR`), keeping those already
    there. A file that can't be used (unreadable, larger than `max_bytes`, corrupt, of another format, whose SHA-256
    is not `sha256`, or stale: written with another torch, transformers or Python version, or on another CPU) loads
    nothing: one warning names the file and the reason, it returns `False`, and this process compiles from scratch.
    Every check runs before anything is installed.

    <Tip warning={true}>

    The file is executable code (pickles and shared libraries): loading it runs code from whoever wrote it. For a
    fleet, publish the file with the `sha256` that [`save_compile_cache`] returned, and load it with `sha256=`: a
    file that differs in one byte is refused before any of it is read.

    </Tip>

    Args:
        path (`str` or `os.PathLike`):
            A file written by [`save_compile_cache`].
        sha256 (`str`, *optional*):
            The file's expected SHA-256, as 64 hexadecimal digits ([`CompileCacheFile.sha256`]).
        max_bytes (`int`, *optional*, defaults to 4 GiB):
            The largest file, and the most its entries may expand to, that is loaded.

    Returns:
        `bool`: whether the file was loaded.
    """
    if sha256 is not None:
        sha256 = sha256.lower() if isinstance(sha256, str) else sha256
        if not isinstance(sha256, str) or len(sha256) != 64 or not set(sha256) <= _SHA256_HEX:
            raise ValueError(f"`sha256` must be a SHA-256 hex digest (64 hexadecimal digits), but is {sha256!r}.")
    check_positive_int(max_bytes, "max_bytes")
    warn_if_enable_forgotten("load_compile_cache", model_known=False)
    try:
        data = _read(path, sha256, max_bytes)
        artifacts, kernels, forwards = _unpack(data, max_bytes)
        if artifacts and torch.compiler.load_cache_artifacts(artifacts) is None:  # then torch installs nothing
            raise _Refused("torch can't read the cache artifacts it holds")
    except _Refused as refused:
        logger.warning(
            f"Not loading the compile cache {os.fspath(path)}: {refused}. Nothing in it is used: this process "
            "compiles from scratch."
        )
        return False
    restored = _restore_kernels(kernels, torch_api.inductor_cache_dir())
    aot_forward.stage(forwards, os.fspath(path))
    logger.info(
        f"load_compile_cache: torch's artifacts loaded, C++ kernels copied: {restored} of {len(kernels)}, compiled "
        f"forwards: {len(forwards)} (loaded by `aot_forward`)"
    )
    return True


def _read(path: str | os.PathLike, sha256: str | None, max_bytes: int) -> bytes:
    """The bytes of the file at `path`, after the checks that need no parsing: size, and `sha256` when given."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise _Refused(f"it is {size} bytes, more than `max_bytes={max_bytes}`")
            data = f.read(max_bytes + 1)
    except OSError as error:
        raise _Refused(f"it can't be read ({type(error).__name__}: {error.strerror or error})") from None
    if len(data) > max_bytes:
        raise _Refused(f"it is more than `max_bytes={max_bytes}` bytes")
    if sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise _Refused(f"its SHA-256 is {actual}, not the expected {sha256}")
    if not data:
        raise _Refused("it is empty")
    if not data.startswith(_ZIP_MAGIC):
        raise _Refused(
            "it is not a compile cache archive (a file of another format, or one written by an earlier version of "
            "prefill_buckets; save it again)"
        )
    return data


def _unpack(data: bytes, max_bytes: int) -> tuple[bytes, dict[str, bytes], list[tuple[dict, bytes]]]:
    """
    Checks the archive `data` whole (reading every entry checks its CRC) and returns torch's artifacts, the kernels by
    relative path, and the compiled forwards with their metadata.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            if len(entries) > _MAX_ENTRIES:
                raise _Refused(f"it has {len(entries)} entries, more than {_MAX_ENTRIES}")
            names = [entry.filename for entry in entries]
            if len(set(names)) != len(names):
                raise _Refused("it holds an entry name twice")
            expanded = sum(entry.file_size for entry in entries)
            if expanded > max_bytes:
                raise _Refused(f"its entries expand to {expanded} bytes, more than `max_bytes={max_bytes}`")
            if _MANIFEST not in names or _ARTIFACTS not in names:
                raise _Refused(f"it has no {_MANIFEST if _MANIFEST not in names else _ARTIFACTS}")
            manifest = _check_manifest(archive.read(_MANIFEST))
            forward_files = _check_forwards(manifest.get("aot_forwards"))
            kernels = []
            for name in names:
                if name.startswith(_KERNELS) and not name.endswith("/"):
                    kernels.append(_kernel_path(name))
                elif name not in (_MANIFEST, _ARTIFACTS) and name not in forward_files:
                    raise _Refused(f"it holds an unexpected entry {name!r}")
            if not forward_files <= set(names):
                raise _Refused(
                    f"its manifest lists compiled forwards it doesn't hold: {sorted(forward_files - set(names))}"
                )
            artifacts = archive.read(_ARTIFACTS)
            kernels = {relative: archive.read(_KERNELS + relative) for relative in kernels}
            forwards = [(meta, archive.read(meta["file"])) for meta in manifest["aot_forwards"]]
    except _Refused:
        raise
    except Exception as error:  # `BadZipFile`, `zlib.error`, `EOFError`, ...: a truncated or damaged archive
        raise _Refused(f"it is truncated or corrupt ({type(error).__name__}: {error})") from None
    return artifacts, kernels, forwards


def _kernel_path(name: str) -> str:
    """The path, relative to inductor's cache directory, of the kernel entry `name`; refuses one that leaves it."""
    relative = name[len(_KERNELS) :]
    parts = relative.split("/")
    if any(part in ("", ".", "..") or "\\" in part or "\0" in part or ":" in part for part in parts):
        raise _Refused(f"its entry {name!r} points outside the cache directory")
    return relative


def _check_manifest(raw: bytes) -> dict:
    """Refuses a manifest of another format version, or written in another environment than this process's."""
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise _Refused(f"its {_MANIFEST} is not JSON") from None
    if not isinstance(manifest, dict):
        raise _Refused(f"its {_MANIFEST} is not a JSON object")
    if manifest.get("format") != _ARCHIVE_FORMAT:
        raise _Refused(
            f"it has compile cache format {manifest.get('format')!r}, and this version of prefill_buckets reads "
            f"format {_ARCHIVE_FORMAT} (save it again)"
        )
    for key, expected in _environment().items():
        if manifest.get(key) != expected:
            what = "CPU features" if key == "cpu" else f"{key} version"
            raise _Refused(
                f"it is stale: written with {what} {manifest.get(key)!r}, and this process has {expected!r}"
            )
    return manifest


def _check_forwards(forwards) -> set[str]:
    """Refuses a malformed list of compiled forwards in the manifest; returns the entry names it lists."""
    text = {"file", "fingerprint", "key", "forward"}
    if not isinstance(forwards, list) or not all(
        isinstance(meta, dict)
        and all(isinstance(meta.get(field), str) for field in text)
        and meta["file"].startswith(_FORWARDS)
        and isinstance(meta.get("modules"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in meta["modules"].items())
        for meta in forwards
    ):
        raise _Refused(f"its {_MANIFEST} has a malformed list of compiled forwards")
    files = {meta["file"] for meta in forwards}
    if len(files) != len(forwards):
        raise _Refused(f"its {_MANIFEST} lists a compiled forward twice")
    return files


def _environment() -> dict[str, str]:
    """What the compiled code depends on besides the model: recorded by `save_compile_cache`, checked at load."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": ".".join(platform.python_version_tuple()[:2]),
        "cpu": _cpu_fingerprint(),
    }


def _kernels(root: str) -> list[str]:
    """The C++ libraries in inductor's cache directory `root` that this process loaded, and its `_isa_probes`."""
    # Inductor keeps each library at `root/<2 characters>/<hash>[.main].so`, the hash being of the source and the
    # compiler's command line. Most kernels are loaded as Python extension modules (in `sys.modules`), some with
    # `ctypes`: on Linux, `/proc/self/maps` lists both.
    files = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    with contextlib.suppress(OSError), open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        files.update(line.split(maxsplit=5)[-1].strip() for line in f if line.count(" ") >= 5)
    prefix = os.path.join(root, "")
    kernels = {
        file
        for file in files
        if isinstance(file, str) and file.startswith(prefix) and not file.endswith(".py") and os.path.isfile(file)
    }
    return sorted(kernels | set(_isa_probes(root)))


def _isa_probes(root: str) -> list[str]:
    """
    The libraries inductor builds in `root` at each process's first compile to probe the vector instruction sets, one
    small C++ program per set (the `*_code` sources of `torch._inductor.cpu_vec_isa`): a subprocess loads them, so
    `_kernels` doesn't see them.
    """
    cpu_vec_isa = torch_api.inductor_cpu_vec_isa()
    if cpu_vec_isa is None:
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


def _restore_kernels(kernels: dict[str, bytes], root: str) -> int:
    """Writes `kernels` (by path relative to `root`) into `root`, keeping those already there; returns how many."""
    restored = 0
    for relative, content in kernels.items():
        target = os.path.join(root, *relative.split("/"))
        if os.path.exists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = f"{target}.{os.getpid()}.tmp"  # renamed into place, so no process loads a half-written kernel
        with open(partial, "wb") as f:
            f.write(content)
        os.chmod(partial, 0o755)
        os.replace(partial, target)
        restored += 1
    return restored


def _cpu_fingerprint() -> str:
    """What the C++ kernels depend on besides their compiler command line: the architecture and its CPU features."""
    features = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                features = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha256(f"{platform.machine()} {features}".encode()).hexdigest()[:16]
