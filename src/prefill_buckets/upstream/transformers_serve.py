"""`transformers serve`'s private places, which `prefill-buckets serve` (`serving.py`, `serving_loads.py`) hooks: its
`Serve` command, and where it loads the models it serves (the server's process through transformers 5.24, a process
of each model's own from 5.25) and what that process does once a model is loaded.

The others import `transformers.cli` when called, which needs the `serving` extra: `serve_unavailable` says whether it
is installed.
"""


def serve_unavailable() -> str | None:
    """Why `transformers serve` can't run here (its extra is not installed), or `None`."""
    from transformers.utils.import_utils import is_serve_available

    if is_serve_available():
        return None
    return (
        'transformers serve needs FastAPI and uvicorn: pip install "transformers-prefill-buckets[serving]" '
        '(or "transformers[serving]").'
    )


def serve_command():
    """`transformers serve` as a click command, with upstream's own options (its `Serve` class, through typer)."""
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)
    return typer.main.get_command(app)


def serve_model_manager():
    """
    The class whose `load_model_and_processor` loads the models `transformers serve` serves, in the server's process
    (transformers 5.17 to 5.24), or `None`.
    """
    from transformers.cli.serving.model_manager import ModelManager

    return ModelManager if hasattr(ModelManager, "load_model_and_processor") else None


def serve_model_process():
    """
    The class whose static `start_process(model, loader, ...)` starts a served model's process of its own and hands it
    `loader`, which loads the model there with `loader.load_model_and_processor(model_id, on_progress=...)`
    (transformers 5.25: `EngineClient`, the process spawned), or `None`.
    """
    from transformers.cli.serving import model_manager

    engine_client = getattr(model_manager, "EngineClient", None)
    return engine_client if engine_client is not None and "start_process" in vars(engine_client) else None


def serve_threads_rule():
    """
    What a served model's process does to torch's threads once its model is loaded, called with the model's device
    (transformers 5.25: `set_torch_threads_for_serving`, one thread for a model on an accelerator), or `None`. Dynamo
    guards every graph on the thread count, so a warm-up must run after it.
    """
    from transformers.cli.serving import utils

    return getattr(utils, "set_torch_threads_for_serving", None)
