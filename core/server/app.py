"""The FastAPI app: OpenAI routes, /health, /metrics, and the engine loaded in the background.

The HTTP server answers from its first second: while the model loads, /health says
{"status": "loading"} with a 503 and so does every /v1 route, so an orchestrator can tell
"starting" from "dead". The engine is built in a worker thread (loading is blocking) and then
started on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.errors import APIError, install_error_handlers
from deepinfer.core.server.metrics import EngineMetrics
from deepinfer.core.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from deepinfer.core.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.core.server.serving import ServingEngine
from deepinfer.core.server.serving_chat import create_chat_completion
from deepinfer.core.server.serving_completions import create_completion

logger = logging.getLogger("deepinfer.server")


def _build_engine(config: EngineConfig):
    from deepinfer.core.engine.async_engine import AsyncEngine

    return AsyncEngine(config)


class ServerState:
    """Where the engine is: "loading" -> "ready" (serving and metrics set) or "failed" (error set)."""

    def __init__(self):
        self.status = "loading"
        self.engine = None
        self.serving: ServingEngine | None = None
        self.metrics: EngineMetrics | None = None
        self.error: str | None = None

    def require_serving(self) -> ServingEngine:
        if self.serving is None:
            message = "the model is still loading" if self.status == "loading" else f"the model failed to load: " \
                                                                                      f"{self.error}"
            raise APIError(503, message, code="model_loading" if self.status == "loading" else "model_load_failed")
        return self.serving


def create_app(engine_config: EngineConfig, server_config: ServerConfig | None = None,
               engine_factory: Callable[[EngineConfig], object] = _build_engine,
               on_load_failed: Callable[[Exception], None] | None = None) -> FastAPI:
    """`engine_factory(config)` builds the (unstarted) AsyncEngine; it runs in a worker thread.
    `on_load_failed(err)` lets the caller stop the process when the model cannot be loaded."""
    server_config = server_config or ServerConfig()
    state = ServerState()

    async def load_engine() -> None:
        try:
            engine = await asyncio.to_thread(engine_factory, engine_config)
            state.engine = engine
            await engine.start()
            serving = ServingEngine(engine, server_config)
            metrics = EngineMetrics(serving.model_name)
            engine.add_stats_listener(metrics.record)
            state.serving, state.metrics, state.status = serving, metrics, "ready"
            logger.info("model %s ready", serving.model_name)
        except Exception as err:  # noqa: BLE001 -- reported by /health and the CLI; HTTP keeps answering
            state.status, state.error = "failed", str(err) or type(err).__name__
            logger.error("model failed to load: %s", state.error)
            if on_load_failed is not None:
                on_load_failed(err)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loader = asyncio.create_task(load_engine())
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()
            if state.engine is not None and state.status == "ready":
                await state.engine.shutdown()

    app = FastAPI(title="deepinfer", lifespan=lifespan)
    app.state.deepinfer = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_body_bytes)
    if server_config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=server_config.api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.status != "ready":
            body = {"status": state.status} | ({"error": state.error} if state.error else {})
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "served_model_name": state.serving.model_name,
                             **state.engine.health()})

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type=EngineMetrics.content_type)
        return Response(state.metrics.render(), media_type=EngineMetrics.content_type)

    def model_card(serving: ServingEngine) -> dict:
        return {"id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "deepinfer",
                "max_model_len": serving.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(state.require_serving())]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        serving = state.require_serving()
        serving.check_model(model)
        return JSONResponse(model_card(serving))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(state.require_serving(), request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await create_completion(state.require_serving(), request, raw_request)

    return app
