"""`deepinfer serve`: the OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions,
/v1/models, /health, /metrics).

The HTTP server starts at once and loads the model in the background (/health answers 503
"loading" until it is ready); if the model cannot be loaded the command exits with that error.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from deepinfer.cli.errors import fail
from deepinfer.cli.options import engine_config, engine_flags

HostOpt = Annotated[str, typer.Option("--host", help="Address to bind; the default serves this machine only.")]
PortOpt = Annotated[int, typer.Option("--port", help="TCP port.")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", envvar="DEEPINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* routes.")]
ServedNameOpt = Annotated[str | None, typer.Option(
    "--served-model-name", help="The model name clients send and see (default: the Hugging Face id, or the "
                                "model's own name).")]
MaxBodyOpt = Annotated[str, typer.Option(
    "--max-body-bytes", help="Largest request body accepted (e.g. 2MiB); larger ones get HTTP 413.")]
MaxPromptOpt = Annotated[int | None, typer.Option(
    "--max-prompt-tokens", help="Longest prompt accepted, in tokens (default: the context length).")]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error.")]


@engine_flags("serve")
def serve(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    served_model_name: ServedNameOpt = None,
    max_body_bytes: MaxBodyOpt = "2MiB",
    max_prompt_tokens: MaxPromptOpt = None,
    log_level: LogLevelOpt = "info",
    *,
    engine: dict,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with /health and /metrics."""
    import uvicorn

    from deepinfer.core.config import parse_size
    from deepinfer.core.server.app import create_app
    from deepinfer.core.server.config import ServerConfig
    from deepinfer.core.weights.hub import parse_hub_id

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    hub_id = engine.get("model") if engine.get("model") and parse_hub_id(engine["model"]) else None
    config = engine_config(engine)
    if served_model_name is None and hub_id is not None and config.model != hub_id:
        served_model_name = hub_id.split(":")[0]  # clients name the model as they would on the Hub
    server_config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                                 max_body_bytes=parse_size(max_body_bytes), max_prompt_tokens=max_prompt_tokens)
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("deepinfer.server").warning(
            "serving on %s without --api-key: anyone who can reach this address can use the model", host)
    load_errors: list[Exception] = []

    def stop_on_load_failure(err: Exception) -> None:
        load_errors.append(err)
        server.should_exit = True

    app = create_app(config, server_config, on_load_failed=stop_on_load_failure)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                           timeout_graceful_shutdown=5))
    server.run()
    if load_errors:
        fail(f"cannot serve: {load_errors[0]}")
