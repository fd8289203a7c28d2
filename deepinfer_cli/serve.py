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
AllowedOriginsOpt = Annotated[str | None, typer.Option(
    "--allowed-origins", help="Comma-separated origins browsers may call from (CORS), or '*'; off by default.")]
ShutdownTimeoutOpt = Annotated[float, typer.Option(
    "--shutdown-timeout", help="Seconds running requests get to finish after SIGTERM/SIGINT; then they are ended.")]
RequestTimeoutOpt = Annotated[float, typer.Option(
    "--request-timeout", help="Seconds a client has to send a whole request (line, headers, body); then 408.")]
MaxConnectionsOpt = Annotated[int, typer.Option(
    "--max-connections", help="Open connections held at once; beyond it new ones get 503 and are closed.")]


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
    allowed_origins: AllowedOriginsOpt = None,
    shutdown_timeout: ShutdownTimeoutOpt = 30.0,
    request_timeout: RequestTimeoutOpt = 30.0,
    max_connections: MaxConnectionsOpt = 2048,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with /health and /metrics."""
    from deepinfer.core.config import parse_size
    from deepinfer.core.errors import DeepInferError
    from deepinfer.core.server.config import ServerConfig
    from deepinfer.core.server.run import run_server

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = engine_config(
        model=model, dtype=dtype, device=device, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization, reserve_memory_mb=reserve_memory_mb,
        kv_cache_memory=kv_cache_memory, max_vram=max_vram, prefix_caching=prefix_caching,
        max_waiting_requests=max_waiting_requests, enforce_eager=enforce_eager, async_scheduling=async_scheduling,
        attention_backend=attention_backend, dummy_weights=dummy_weights, shape=shape, seed=seed)
    origins = [o.strip() for o in (allowed_origins or "").split(",") if o.strip()]
    try:
        server_config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                                     max_body_bytes=parse_size(max_body_bytes), max_prompt_tokens=max_prompt_tokens,
                                     allowed_origins=origins, shutdown_timeout_s=shutdown_timeout,
                                     request_timeout_s=request_timeout, max_connections=max_connections,
                                     tool_call_parser=tool_call_parser)
    except ValueError as err:
        fail(str(err))
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("deepinfer.server").warning(
            "serving on %s without --api-key: anyone who can reach this address can use the model", host)
    try:
        code = run_server(config, server_config, log_level)
    except DeepInferError as err:
        fail(f"cannot serve: {err}")
    raise typer.Exit(code)
