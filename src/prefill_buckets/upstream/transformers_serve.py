"""`transformers serve`'s private places, which `prefill-buckets serve` (`serving.py`, `serving_loads.py`) hooks. All
but `serve_unavailable` import `transformers.cli`, which needs the `serving` extra.
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
    """The class whose `load_model_and_processor` loads served models in the server's process (5.17 to 5.24), or `None`."""
    from transformers.cli.serving.model_manager import ModelManager

    return ModelManager if hasattr(ModelManager, "load_model_and_processor") else None


def serve_model_process():
    """
    The class whose static `start_process(model, loader, ...)` spawns a served model's own process, where `loader`
    loads it (transformers 5.25: `EngineClient`), or `None`.
    """
    from transformers.cli.serving import model_manager

    engine_client = getattr(model_manager, "EngineClient", None)
    return engine_client if engine_client is not None and "start_process" in vars(engine_client) else None


def serve_threads_rule():
    """
    What a served model's process does to torch's threads once it is loaded, called with the model's device
    (transformers 5.25: `set_torch_threads_for_serving`), or `None`. Dynamo guards graphs on the thread count.
    """
    from transformers.cli.serving import utils

    return getattr(utils, "set_torch_threads_for_serving", None)
