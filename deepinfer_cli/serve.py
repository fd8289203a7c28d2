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
from deepinfer.cli.options import (
    AsyncSchedulingOpt,
    AttentionBackendOpt,
    BlockSizeOpt,
    DeviceOpt,
    DtypeOpt,
    DummyWeightsOpt,
    EnforceEagerOpt,
    GpuMemUtilOpt,
    KvCacheDtypeOpt,
    KvCacheMemoryOpt,
    MaxBatchedTokensOpt,
    MaxModelLenOpt,
    MaxNumSeqsOpt,
    MaxVramOpt,
    ModelOpt,
    PrefixCachingOpt,
    ReserveMbOpt,
    SeedOpt,
    ShapeOpt,
    engine_config,
)

HostOpt = Annotated[str, typer.Option("--host", help="Address to bind; the default serves this machine only.")]
PortOpt = Annotated[int, typer.Option("--port", help="TCP port.")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", envvar="DEEPINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* routes.")]
ServedNameOpt = Annotated[str | None, typer.Option(
    "--served-model-name", help="The model name clients send and see (default: the model's own name).")]
MaxWaitingOpt = Annotated[int, typer.Option(
    "--max-waiting-requests", help="Bounded waiting queue; beyond it requests get HTTP 429.")]
MaxBodyOpt = Annotated[str, typer.Option(
    "--max-body-bytes", help="Largest request body accepted (e.g. 2MiB); larger ones get HTTP 413.")]
MaxPromptOpt = Annotated[int | None, typer.Option(
    "--max-prompt-tokens", help="Longest prompt accepted, in tokens (default: the context length).")]
ToolParserOpt = Annotated[str | None, typer.Option(
    "--tool-call-parser", help="hermes | llama3_json | mistral: how the model writes tool calls "
                               "(default: detected from its chat template).")]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error.")]


def serve(
    model: ModelOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    served_model_name: ServedNameOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    block_size: BlockSizeOpt = 16,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    max_num_seqs: MaxNumSeqsOpt = 64,
    max_num_batched_tokens: MaxBatchedTokensOpt = 2048,
    max_model_len: MaxModelLenOpt = None,
    gpu_memory_utilization: GpuMemUtilOpt = 0.90,
    reserve_memory_mb: ReserveMbOpt = 0,
    kv_cache_memory: KvCacheMemoryOpt = None,
    max_vram: MaxVramOpt = None,
    prefix_caching: PrefixCachingOpt = True,
    max_waiting_requests: MaxWaitingOpt = 1024,
    enforce_eager: EnforceEagerOpt = False,
    async_scheduling: AsyncSchedulingOpt = True,
    attention_backend: AttentionBackendOpt = "auto",
    dummy_weights: DummyWeightsOpt = False,
    shape: ShapeOpt = None,
    seed: SeedOpt = 0,
    max_body_bytes: MaxBodyOpt = "2MiB",
    max_prompt_tokens: MaxPromptOpt = None,
    tool_call_parser: ToolParserOpt = None,
    log_level: LogLevelOpt = "info",
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with /health and /metrics."""
    import uvicorn

    from deepinfer.core.config import parse_size
    from deepinfer.core.server.app import create_app
    from deepinfer.core.server.config import ServerConfig

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = engine_config(
        model=model, dtype=dtype, device=device, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization, reserve_memory_mb=reserve_memory_mb,
        kv_cache_memory=kv_cache_memory, max_vram=max_vram, prefix_caching=prefix_caching,
        max_waiting_requests=max_waiting_requests, enforce_eager=enforce_eager, async_scheduling=async_scheduling,
        attention_backend=attention_backend, dummy_weights=dummy_weights, shape=shape, seed=seed)
    server_config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                                 max_body_bytes=parse_size(max_body_bytes), max_prompt_tokens=max_prompt_tokens,
                                 tool_call_parser=tool_call_parser)
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
