"""Where `transformers serve` loads the models it serves, and the hooks that prepare each one there, before it serves:
in the server's process through transformers 5.24 (`prepared_loads`), in a process of each model's own from 5.25
(`wrapped_process_loaders`, with a pickled `PreparingLoader`). `prepared(prepare, report)` picks the one that applies.
"""

import contextlib
import pickle
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import transformers

from .upstream import transformers_serve


def unsupported_server() -> str | None:
    """Why this transformers' server can't serve a prepared model (no place it loads it is known here), or `None`."""
    if transformers_serve.serve_model_manager() is not None or transformers_serve.serve_model_process() is not None:
        return None
    return (
        "prefill-buckets serve prepares the served model where transformers serve loads it: in the server's process "
        "(`ModelManager.load_model_and_processor`, transformers 5.17 to 5.24) or in the model's own process (the loader "
        f"`EngineClient.start_process` hands it, transformers 5.25); transformers {transformers.__version__}'s server "
        "has neither, so its requests would run unbucketed. Serve with transformers 5.25 (pip install "
        "'transformers==5.25.0'), or call `prefill_buckets.enable()` in a server of your own."
    )


def prepared(prepare: Callable, report: Callable):
    """
    The context in which the models the server loads are prepared (`prepare(model, processor=...)`) and reported.
    Raises `ValueError` where they load in a process of their own and `prepare` or `report` can't be pickled.
    """
    if transformers_serve.serve_model_manager() is not None:
        return prepared_loads(prepare, report)
    try:
        pickle.dumps((prepare, report))
    except Exception as error:
        raise ValueError(
            f"transformers {transformers.__version__}'s server loads the model in a process of its own, where "
            "prefill_buckets prepares it: its options (`ServeOptions.backend` among them) and `report` go there "
            f"pickled, and can't ({type(error).__name__}: {error}). Pass a function defined at a module's top level, "
            "and a backend by name or a picklable callable."
        ) from None
    return wrapped_process_loaders(lambda loader: PreparingLoader(loader, prepare, report))


@contextlib.contextmanager
def prepared_loads(prepare: Callable, report: Callable):
    """While open, every model `ModelManager.load_model_and_processor` returns is prepared, once, before it serves."""
    manager = transformers_serve.serve_model_manager()
    load = manager.load_model_and_processor
    done = weakref.WeakSet()
    lock = threading.Lock()

    def load_model_and_processor(self, *args, **kwargs):
        model, processor = load(self, *args, **kwargs)
        with lock:
            if model not in done:
                warm = prepare(model, processor=processor)
                done.add(model)
                report(model, warm)
        return model, processor

    manager.load_model_and_processor = load_model_and_processor
    try:
        yield
    finally:
        manager.load_model_and_processor = load


@dataclass
class PreparingLoader:
    """Upstream's model loader (5.25: `ModelLoader`), whose models are prepared and reported in their own process."""

    loader: object
    prepare: Callable
    report: Callable

    def load_model_and_processor(self, model_id: str, on_progress=None):
        model, processor = self.loader.load_model_and_processor(model_id, on_progress=on_progress)
        threads_rule = transformers_serve.serve_threads_rule()
        if threads_rule is not None:
            # The process sets torch's threads once this returns: set first, the warm-up's graphs (guarded on the
            # thread count) would all compile again at the first requests.
            threads_rule(model.device)
        self.report(model, self.prepare(model, processor=processor))
        return model, processor


@contextlib.contextmanager
def wrapped_process_loaders(wrap: Callable):
    """While open, `EngineClient.start_process` (5.25) hands each model's process `wrap(loader)` instead of `loader`."""
    engine_client = transformers_serve.serve_model_process()
    start_process = vars(engine_client)["start_process"]  # the staticmethod itself, put back as it was

    def start_wrapped_process(model, loader, *args, **kwargs):
        return start_process.__func__(model, wrap(loader), *args, **kwargs)

    engine_client.start_process = staticmethod(start_wrapped_process)
    try:
        yield
    finally:
        engine_client.start_process = start_process
