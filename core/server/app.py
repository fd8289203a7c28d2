"""The FastAPI app: OpenAI routes, Anthropic's /v1/messages, OpenAI's /v1/responses, /tokenize,
/detokenize, /health, /metrics, and the engine loaded in the background.

The HTTP server answers from its first second: while the model loads, /health says
{"status": "loading"} with a 503 and so does every API route, so an orchestrator can tell
"starting" from "dead". The engine is built on a daemon thread (loading is blocking; a signal
during it must not wait for it) and then started on the server's event loop.

Handlers take the raw request: the event loop reads the body's bytes and nothing else; parsing,
validation, chat templating and tokenization run on the preprocessing threads (preprocess.py).
The OpenAPI schema is written by openapi.py from the same request models.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from deepinfer import __version__
from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.connection import AcceptErrorLog
from deepinfer.core.server.errors import APIError, install_error_handlers
from deepinfer.core.server.health import HealthSnapshots
from deepinfer.core.server.metric_tallies import MetricTallies
from deepinfer.core.server.metrics import CONTENT_TYPE, EngineMetrics, ServerMetrics
from deepinfer.core.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ErrorCountMiddleware,
    HeadAsGetMiddleware,
)
from deepinfer.core.server.openapi import install_openapi
from deepinfer.core.server.preprocess import Preprocessor, read_json_bytes
from deepinfer.core.server.serving import ServingEngine, chars_per_token_bound
from deepinfer.core.server.serving_chat import create_chat_completion, prepare_chat
from deepinfer.core.server.serving_completions import create_completion, prepare_completion
from deepinfer.core.server.serving_messages import count_tokens, create_message, prepare_message
from deepinfer.core.server.serving_responses import create_response, prepare_response
from deepinfer.core.server.serving_tokenize import detokenize, tokenize

logger = logging.getLogger("deepinfer.server")

DRAIN_POLL_S = 0.05  # how often a shutdown checks whether the running requests are done
ENDED_GRACE_S = 10.0  # after the deadline, how long ended requests get to send their last chunk


def _build_engine(config: EngineConfig):
    from deepinfer.core.engine.frontend.async_engine import AsyncEngine

    return AsyncEngine(config)


def _build_engine_process(config: EngineConfig):
    from deepinfer.core.engine.frontend.core_client import EngineCoreClient

    return EngineCoreClient(config)


def _build_data_parallel(config: EngineConfig, num_replicas: int):
    from deepinfer.core.engine.frontend.data_parallel_client import DataParallelClient

    return DataParallelClient(config, num_replicas)


async def _on_daemon_thread(fn: Callable, *args):
    """`fn(*args)` on a daemon thread: unlike asyncio.to_thread, exiting never waits for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Callable, value) -> None:
        try:
            loop.call_soon_threadsafe(lambda: future.done() or outcome(value))
        except RuntimeError:  # the loop is closed: the server stopped while this ran; nobody waits
            pass

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as err:  # noqa: BLE001 -- handed to the awaiting task
            settle(future.set_exception, err)
        else:
            settle(future.set_result, result)

    threading.Thread(target=run, name="deepinfer-load", daemon=True).start()
    return await future


class ServerState:
    """Where the server is: "loading" -> "ready" (serving set) or "failed" (error set); then
    "shutting_down" once a signal came (new requests get a 503, running ones finish)."""

    def __init__(self, server_config: ServerConfig, metric_tallies: MetricTallies | None = None):
        self.status = "loading"
        self.engine = None
        self.serving: ServingEngine | None = None
        self.health: HealthSnapshots | None = None
        self.metrics = ServerMetrics(metric_tallies)
        self.preprocessor = Preprocessor(server_config.preprocess_workers, server_config.max_pending_requests)
        self.error: str | None = None
        self._end_timer: asyncio.TimerHandle | None = None
        self._drain_task: asyncio.Task | None = None

    def require_serving(self) -> ServingEngine:
        if self.status == "shutting_down":
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.serving is None:
            message = "the model is still loading" if self.status == "loading" else f"the model failed to load: " \
                                                                                      f"{self.error}"
            raise APIError(503, message, code="model_loading" if self.status == "loading" else "model_load_failed")
        return self.serving

    def begin_shutdown(self, timeout_s: float, on_drained: Callable[[], None] | None = None) -> None:
        """Refuse new requests; end the running ones (final chunk, [DONE]) unless they finish within `timeout_s`.
        `on_drained()` is called on the loop once no request is running: the listener stays open until
        then, so a client that connects meanwhile gets the 503, not a refused connection."""
        if self.status == "shutting_down":
            return
        self.status = "shutting_down"
        logger.info("shutting down: running requests get %.0f s to finish", timeout_s)
        loop = asyncio.get_running_loop()
        self._end_timer = loop.call_later(timeout_s, self.end_requests)
        if on_drained is not None:
            deadline = loop.time() + timeout_s + ENDED_GRACE_S
            self._drain_task = loop.create_task(self._call_when_drained(on_drained, deadline))

    async def _call_when_drained(self, on_drained: Callable[[], None], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.serving is not None and self.serving.num_running and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        on_drained()

    def end_requests(self) -> None:
        if self._end_timer is not None:
            self._end_timer.cancel()
        if self.serving is not None:
            ended = self.serving.end_all()
            if ended:
                logger.info("ended %d running requests", ended)


def create_app(engine_config: EngineConfig, server_config: ServerConfig | None = None,
               engine_factory: Callable[[EngineConfig], object] = _build_engine,
               on_load_failed: Callable[[Exception], None] | None = None,
               on_engine_dead: Callable[[], None] | None = None,
               metric_tallies: MetricTallies | None = None) -> FastAPI:
    """`engine_factory(config)` builds the (unstarted) AsyncEngine; it runs on a loader thread
    (with `server_config.engine_process` the default factory builds an EngineCoreClient instead).
    `on_load_failed(err)` lets the caller stop the process when the model cannot be loaded;
    `on_engine_dead()`, when the engine process dies (its open requests have already ended with a 503).
    `metric_tallies`: where /metrics tallies (shared by the API servers of one engine); None = this app's own."""
    server_config = server_config or ServerConfig()
    state = ServerState(server_config, metric_tallies)
    if server_config.data_parallel_size > 1 and engine_factory is _build_engine:
        engine_factory = functools.partial(_build_data_parallel, num_replicas=server_config.data_parallel_size)
    elif server_config.engine_process and engine_factory is _build_engine:
        engine_factory = _build_engine_process

    def load() -> tuple[object, int | None]:
        engine = engine_factory(engine_config)
        return engine, chars_per_token_bound(engine.tokenizer)

    async def load_engine() -> None:
        try:
            engine, chars_per_token = await _on_daemon_thread(load)
            state.engine = engine
            serving = ServingEngine(engine, server_config, chars_per_token)
            health = HealthSnapshots(engine)  # before the engine thread runs: the first snapshot is exact
            replicas = getattr(engine, "replicas", None)  # a DataParallelClient's: each one's figures labelled
            metrics = EngineMetrics(serving.model_name, state.metrics.registry, state.metrics.tallies,
                                    num_replicas=None if replicas is None else len(replicas))
            if replicas is None:
                engine.add_stats_listener(metrics.record)
            for index, replica in enumerate(replicas or []):
                replica.add_stats_listener(functools.partial(metrics.record, replica=index))
            engine.add_stats_listener(health.on_step)
            if on_engine_dead is not None and hasattr(engine, "add_dead_callback"):
                engine.add_dead_callback(on_engine_dead)
            await engine.start()
            state.serving, state.health = serving, health
            if state.status == "loading":
                state.status = "ready"
            logger.info("model %s ready; sampling defaults of requests that leave them unset: %s",
                        serving.model_name, engine.sampling_defaults.describe())
            logger.info("tool call parser: %s; reasoning parser: %s", serving.tool_parser.name,
                        serving.reasoning_parser.name if serving.reasoning_parser is not None else "none")
        except Exception as err:  # noqa: BLE001 -- reported by /health and the CLI; HTTP keeps answering
            state.status, state.error = "failed", str(err) or type(err).__name__
            logger.error("model failed to load: %s", state.error)
            if on_load_failed is not None:
                on_load_failed(err)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        loader = asyncio.create_task(load_engine())
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()
            state.end_requests()
            if state.engine is not None and state.serving is not None:
                await state.engine.shutdown()
            state.preprocessor.shutdown()

    app = FastAPI(title="deepinfer", summary="OpenAI-compatible LLM inference server", version=__version__,
                  lifespan=lifespan, docs_url=None, redoc_url=None)  # Swagger UI and ReDoc load their code from a CDN
    app.state.deepinfer = state
    install_error_handlers(app)
    # Added innermost first: the error count sees everything, CORS answers preflights before the key check.
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_body_bytes)
    if server_config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=server_config.api_key)
    app.add_middleware(HeadAsGetMiddleware)
    if server_config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=server_config.allowed_origins,
                           allow_methods=["GET", "POST", "HEAD", "OPTIONS"], allow_headers=["*"], max_age=600)
    app.add_middleware(ErrorCountMiddleware, count=state.metrics.count_rejection)

    async def prepared(raw_request: Request, prepare: Callable, bounded: bool = False):
        """Read the body on the loop, prepare it on a preprocessing thread (parse, template, tokenize), or
        on the loop when `bounded` and small (Preprocessor.run)."""
        serving = state.require_serving()
        with state.preprocessor.slot():
            body = await read_json_bytes(raw_request)
            raw_request.state.body_bytes = len(body)
            return serving, await state.preprocessor.run(prepare, serving, body, bounded)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.status != "ready":
            body = {"status": state.status} | ({"error": state.error} if state.error else {})
            return JSONResponse(body, status_code=503)
        alive = state.engine.is_alive  # False from the engine's death until this server has stopped
        return JSONResponse({"status": "ok" if alive else "engine_dead", "served_model_name": state.serving.model_name,
                             **state.health.latest, "engine_alive": alive}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

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
    async def chat_completions(raw_request: Request):
        serving, (request, prompt) = await prepared(raw_request, prepare_chat)
        return await create_chat_completion(serving, request, prompt, raw_request)

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        serving, (request, prompts) = await prepared(raw_request, prepare_completion, bounded=True)
        return await create_completion(serving, request, prompts, raw_request)

    @app.post("/v1/messages")
    async def messages(raw_request: Request):
        serving, message = await prepared(raw_request, prepare_message)
        return await create_message(serving, message, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(raw_request: Request):
        _, answer = await prepared(raw_request, count_tokens)
        return JSONResponse(answer)

    @app.post("/v1/responses")
    async def responses(raw_request: Request):
        serving, response = await prepared(raw_request, prepare_response)
        return await create_response(serving, response, raw_request)

    @app.post("/tokenize")
    async def tokenize_route(raw_request: Request):
        _, answer = await prepared(raw_request, tokenize)
        return JSONResponse(answer)

    @app.post("/detokenize")
    async def detokenize_route(raw_request: Request):
        _, answer = await prepared(raw_request, detokenize)
        return JSONResponse(answer)

    install_openapi(app)
    return app
