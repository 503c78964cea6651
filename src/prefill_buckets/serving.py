"""`prefill-buckets serve MODEL ...`: transformers' own OpenAI-compatible server, with bucketed, precompiled generate.

The server is upstream's `transformers serve`, started on a model this module prepares where upstream loads it
(`serving_loads.py`), before the first request: `enable()`, the bucket fields and a static cache on its generation
config, the forward compiled, and with `--precompile` every bucket's graphs compiled (or loaded from
`--compile-cache`). See the usage reference's "Serving".
"""

import argparse
import copy
import functools
import os
import sys
import time
from dataclasses import dataclass

from . import serving_loads
from .buckets import BucketPolicy, validate_buckets
from .compile.aot_forward import aot_forward
from .compile.archive import load_compile_cache, save_compile_cache
from .compile.precompile import bucket_lengths, precompile
from .config import PREFILL_BUCKETS
from .patch import enable
from .state import state_of
from .upstream import torch_api, transformers_serve
from .upstream.transformers_api import max_positions


DEFAULT_BUCKETS = "pow2-quarters"
# What upstream's server gives a request that sends no `max_tokens`: at least this many new tokens
# (`BaseHandler._build_generation_config`). The served default, so such a request fits the precompiled cache.
UPSTREAM_MIN_NEW_TOKENS = 1024

SERVE_HELP = """\
Serve MODEL with transformers' own server (`transformers serve`: OpenAI-compatible chat completions, completions and
responses), every request's generate bucketed: prompts padded to a few bucket lengths, each compiled once.

The options below are this command's; every other option is `transformers serve`'s, passed to it as they are (see
`transformers serve --help`): --host, --port, --device, --dtype, --attn-implementation, --log-level, ...

Example:

  prefill-buckets serve ./my-model --max-prompt 2048 --max-new-tokens 256 --precompile \\
      --compile-cache compile-cache.zip --port 8000

A first launch compiles the graphs and saves the file; a later launch loads it and compiles nothing (with
--compile-with model, dynamo traces each graph again; with aot, nothing is traced).
"""


@dataclass
class ServeOptions:
    """This command's own options (the rest are `transformers serve`'s)."""

    buckets: "str | list[int]" = DEFAULT_BUCKETS
    max_prompt: int | None = None
    max_new_tokens: int = UPSTREAM_MIN_NEW_TOKENS
    precompile: bool = False
    compile_cache: str | None = None
    compile_with: str = "model"
    backend: object = "inductor"  # a backend name, or (from Python) a backend callable such as `GraphCounter()`
    # `precompile`'s plan and a line per warm-up call on stderr: a warm-up of every bucket takes minutes to an hour.
    progress: bool = True


@dataclass
class WarmUp:
    """What preparing the served model did: the buckets, and the graphs and seconds the warm-up took."""

    buckets: "str | list[int]"
    graphs: int = 0  # graphs dynamo compiled while preparing (0 on a warm start with `aot`)
    seconds: float = 0.0
    cache_loaded: bool = False
    cache_saved: str | None = None


def parse_buckets(value: str) -> "str | list[int]":
    """`--buckets`: a named set (`pow2`, `pow2-quarters`) or comma-separated lengths (`64,256,1024`)."""
    value = value.strip()
    if "," in value or value.isdigit():
        try:
            buckets = [int(part) for part in value.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--buckets must be a named set (pow2, pow2-quarters) or comma-separated lengths, but is {value!r}."
            ) from None
    else:
        buckets = value
    try:
        validate_buckets(buckets, "--buckets")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return buckets


def _positive(name: str):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, but is {value!r}.")
        return number

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This command's options; `transformers serve`'s come after them, unparsed here."""
    parser.add_argument("model", help="the model to serve: a local folder or a Hub id (transformers serve's MODEL)")
    parser.add_argument(
        "--buckets",
        type=parse_buckets,
        default=DEFAULT_BUCKETS,
        help=f"prefill_buckets: a named set (pow2, pow2-quarters) or comma-separated lengths (default: {DEFAULT_BUCKETS})",
    )
    parser.add_argument(
        "--max-prompt",
        type=_positive("--max-prompt"),
        help="the longest prompt served, in tokens: a named set becomes the list of its buckets up to the one that "
        "holds it (a longer prompt is still served, exactly, with a warning and a graph of its own)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=_positive("--max-new-tokens"),
        default=UPSTREAM_MIN_NEW_TOKENS,
        help="the most new tokens a request asks for (its max_tokens): the static cache holds the largest bucket and "
        f"these (default: {UPSTREAM_MIN_NEW_TOKENS}, what transformers serve gives a request without max_tokens)",
    )
    parser.add_argument(
        "--precompile",
        action="store_true",
        help="compile every bucket's graphs before the server answers (needs --max-prompt with a named set); "
        "prints up front the warm-up calls it runs, then a line per call as it ends (its shape, the graphs it "
        "compiled, its seconds, the calls left)",
    )
    parser.add_argument(
        "--compile-cache",
        metavar="FILE",
        help="load compiled graphs from FILE, or, when it is missing or can't be used, save them to it after "
        "precompiling (implies --precompile)",
    )
    parser.add_argument(
        "--compile-with",
        choices=("model", "static", "aot", "none"),
        default="model",
        help="how the forward is compiled: model (model.compile(): one prefill graph for every bucket; default), "
        "static (model.compile(dynamic=False): a prefill graph per bucket), aot (prefill_buckets.aot_forward: a "
        "graph per bucket, and a warm start that traces nothing), none (eager, bucketed)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="the torch.compile backend (default: inductor; aot_eager compiles quickly, for tests)",
    )


def options_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServeOptions:
    """The options, checked together; a bad combination is a usage error naming the options."""
    if args.compile_cache is not None:
        args.precompile = True
    if args.precompile and args.compile_with == "none":
        parser.error("--precompile (or --compile-cache) needs a compiled forward: --compile-with aot or model.")
    if args.precompile and isinstance(args.buckets, str) and args.max_prompt is None:
        parser.error(
            f"--precompile with the named set {args.buckets!r} needs --max-prompt (its buckets have no upper end), "
            "or pass --buckets as a list of lengths."
        )
    return ServeOptions(
        buckets=args.buckets,
        max_prompt=args.max_prompt,
        max_new_tokens=args.max_new_tokens,
        precompile=args.precompile,
        compile_cache=args.compile_cache,
        compile_with=args.compile_with,
        backend=args.compile_backend,
    )


def served_buckets(model, options: ServeOptions) -> "str | list[int]":
    """The `prefill_buckets` the model serves with: with `max_prompt`, the policy's buckets up to the one holding it."""
    if options.max_prompt is None:
        return options.buckets
    return bucket_lengths(BucketPolicy(buckets=options.buckets), options.max_prompt, max_positions(model))


def prepare_model(model, options: ServeOptions, processor=None) -> WarmUp:
    """
    Sets the bucket fields and a static cache on `model.generation_config`, compiles the forward, and with
    `options.precompile` compiles every bucket's graphs (loading or saving `options.compile_cache`). The warm-up calls
    pass `processor` as `tokenizer`, as upstream's server does with every request: `generate` hands it on to the
    forward, and a compiled forward called with other keyword arguments than its warm-up's would compile again.
    """
    enable()
    state_of(model).entry = "serve"  # advice names serve's options (`--max-prompt`), not the Python API's
    start = time.perf_counter()
    graphs_before = torch_api.graphs_compiled()
    config = model.generation_config
    buckets = served_buckets(model, options)
    setattr(config, PREFILL_BUCKETS, buckets)
    config.cache_implementation = "static"
    warm = WarmUp(buckets=buckets)
    path = options.compile_cache
    if path is not None and os.path.exists(path):
        warm.cache_loaded = load_compile_cache(path)  # before the first compile; a bad file logs why, loads nothing
    if options.compile_with == "aot":
        model.forward = aot_forward(model, backend=options.backend)
    elif options.compile_with == "model":  # dynamic=None: the prefill's length symbolic, one graph for every bucket
        model.compile(backend=options.backend)
    elif options.compile_with == "static":
        model.compile(backend=options.backend, dynamic=False)
    if options.precompile:
        # What a request without `generation_config` gets, at the served maximum.
        request = copy.deepcopy(model.generation_config)
        request.max_new_tokens = options.max_new_tokens
        precompile(
            model,
            request,
            max_prompt_length=options.max_prompt,
            progress=options.progress,
            generate_kwargs={"tokenizer": processor} if processor is not None else None,
        )
        if path is not None and not warm.cache_loaded:
            saved = save_compile_cache(path)
            warm.cache_saved = None if saved is None else f"{saved.path} (sha256 {saved.sha256})"
    warm.graphs = torch_api.graphs_compiled() - graphs_before
    warm.seconds = time.perf_counter() - start
    return warm


def _print_ready(model, warm: WarmUp) -> None:
    source = "loaded from the compile cache, " if warm.cache_loaded else ""
    saved = f"; saved {warm.cache_saved}" if warm.cache_saved else ""
    print(
        f"prefill_buckets serve: {type(model).__name__} ready with prefill_buckets={warm.buckets}: "
        f"{source}{warm.graphs} graphs compiled in {warm.seconds:.1f} s before serving{saved}",
        file=sys.stderr,
        flush=True,
    )


def serve_problem(serve_args) -> "tuple[type[Exception], str] | None":
    """
    Why this command can't serve here with `serve_args`, as `(error class, message)`: no `serving` extra
    (`ImportError`), a server it can't prepare (`RuntimeError`), an option it can't serve bucketed (`ValueError`).
    """
    missing_extra = transformers_serve.serve_unavailable()  # first: without it, the server's module can't be read
    if missing_extra is not None:
        return ImportError, missing_extra
    unsupported = serving_loads.unsupported_server()
    if unsupported is not None:
        return RuntimeError, unsupported
    if "--continuous-batching" in serve_args:
        return ValueError, (
            "--continuous-batching schedules requests' tokens itself (`generate_batch`, with paged attention), not "
            "through `generate`, so there is no prompt to pad to a bucket: its requests would run unbucketed, on a "
            "forward this command compiled for `generate`'s calls. Serve it with `transformers serve "
            "--continuous-batching`, or leave the option out here."
        )
    return None


def serve(model: str, options: ServeOptions, serve_args: list[str] = (), report=None):
    """
    Runs `transformers serve MODEL serve_args...` with `model` prepared by `prepare_model`, then `report(model, warm)`
    called (by default, it prints the ready line). Blocks until the server stops, unless `serve_args` hold
    `--non-blocking` (through transformers 5.24: then it returns upstream's running `Serve`). From transformers 5.25 the
    model is prepared in its own process, so `report` and a callable `options.backend` must pickle. Raises what
    `serve_problem` says, and `ValueError` for what can't be pickled.
    """
    problem = serve_problem(serve_args)
    if problem is not None:
        error_class, message = problem
        raise error_class(message)
    prepare = functools.partial(prepare_model, options=options)
    prepared = serving_loads.prepared(prepare, report if report is not None else _print_ready)
    command = transformers_serve.serve_command()
    with prepared:
        return command.main(args=[model, *serve_args], prog_name="prefill-buckets serve", standalone_mode=False)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser, serve_args: list[str]) -> int:
    """`prefill-buckets serve`: the options parsed by `cli.py`, the rest passed to transformers serve."""
    options = options_from_args(args, parser)
    problem = serve_problem(serve_args)
    if problem is not None:
        parser.error(problem[1])
    serve(args.model, options, serve_args)
    return 0
