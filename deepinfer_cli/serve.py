"""`deepinfer serve`: the OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions,
/v1/models, /tokenize, /detokenize, /health, /metrics).

The port is bound first (a busy port fails at once), then the model loads in the background (/health
answers 503 "loading" until it is ready); if the model cannot be loaded the command exits with that
error. SIGTERM/SIGINT stop accepting and let running requests finish (core/server/run.py).
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
ToolParserOpt = Annotated[str | None, typer.Option(
    "--tool-call-parser", help="hermes | llama3_json | mistral | qwen3_coder | pythonic: how the model writes tool "
                               "calls (default: detected from its chat template).")]
ReasoningParserOpt = Annotated[str | None, typer.Option(
    "--reasoning-parser", help="qwen3 | deepseek_r1 | none: how the model writes its reasoning, returned as "
                               "reasoning_content (default: detected from its chat template).")]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error.")]
AllowedOriginsOpt = Annotated[str | None, typer.Option(
    "--allowed-origins", help="Comma-separated origins browsers may call from (CORS), or '*'; off by default.")]
ShutdownTimeoutOpt = Annotated[float, typer.Option(
    "--shutdown-timeout", help="Seconds running requests get to finish after SIGTERM/SIGINT; then they are ended.")]
RequestTimeoutOpt = Annotated[float, typer.Option(
    "--request-timeout", help="Seconds a client has to send a whole request (line, headers, body); then 408.")]
StreamWriteTimeoutOpt = Annotated[float, typer.Option(
    "--stream-write-timeout", help="Seconds a client may take nothing of a response (a stalled stream); then the "
                                   "connection is dropped and its request aborted.")]
CpuThreadsOpt = Annotated[int | None, typer.Option(
    "--cpu-threads", envvar="DEEPINFER_CPU_THREADS", min=1,
    help="torch threads on the CPU (default: the cores this process may use: its affinity and cgroup quota).")]
EngineProcessOpt = Annotated[bool, typer.Option(
    "--engine-process/--no-engine-process",
    help="Run the engine core in its own process (HTTP and tokenization never share its GIL).")]
ApiServerCountOpt = Annotated[int, typer.Option(
    "--api-server-count", min=1,
    help="API-server processes (HTTP, tokenization, detokenization) in front of one engine process; more than 1 "
         "implies --engine-process. Use more when one API server's CPU limits throughput at high concurrency.")]
DataParallelSizeOpt = Annotated[int, typer.Option(
    "--data-parallel-size", min=1,
    help="Engine replicas, each in its own engine process on its own GPU (replica i on cuda:i; all on the CPU "
         "with --device cpu); each request goes to the least-loaded one, or to the one that served its prefix. "
         "More than 1 implies --engine-process.")]
MaxConnectionsOpt = Annotated[int, typer.Option(
    "--max-connections", help="Open connections held at once; beyond it new ones get 503 and are closed.")]


@engine_flags("serve")
def serve(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    served_model_name: ServedNameOpt = None,
    max_body_bytes: MaxBodyOpt = "2MiB",
    max_prompt_tokens: MaxPromptOpt = None,
    tool_call_parser: ToolParserOpt = None,
    reasoning_parser: ReasoningParserOpt = None,
    allowed_origins: AllowedOriginsOpt = None,
    shutdown_timeout: ShutdownTimeoutOpt = 30.0,
    engine_process: EngineProcessOpt = False,
    api_server_count: ApiServerCountOpt = 1,
    data_parallel_size: DataParallelSizeOpt = 1,
    request_timeout: RequestTimeoutOpt = 30.0,
    stream_write_timeout: StreamWriteTimeoutOpt = 60.0,
    max_connections: MaxConnectionsOpt = 2048,
    cpu_threads: CpuThreadsOpt = None,
    log_level: LogLevelOpt = "info",
    *,
    engine: dict,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with /health and /metrics."""
    from deepinfer.core.config import parse_size
    from deepinfer.core.errors import DeepInferError
    from deepinfer.core.server.config import ServerConfig
    from deepinfer.core.server.run import run_server
    from deepinfer.core.weights.hub import parse_hub_id

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    hub_id = engine.get("model") if engine.get("model") and parse_hub_id(engine["model"]) else None
    config = engine_config(engine)
    if served_model_name is None and hub_id is not None and config.model != hub_id:
        served_model_name = hub_id.split(":")[0]  # clients name the model as they would on the Hub
    origins = [o.strip() for o in (allowed_origins or "").split(",") if o.strip()]
    try:
        server_config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                                     max_body_bytes=parse_size(max_body_bytes), max_prompt_tokens=max_prompt_tokens,
                                     allowed_origins=origins, shutdown_timeout_s=shutdown_timeout,
                                     request_timeout_s=request_timeout,
                                     stream_write_timeout_s=stream_write_timeout, max_connections=max_connections,
                                     tool_call_parser=tool_call_parser, engine_process=engine_process,
                                     api_server_count=api_server_count, data_parallel_size=data_parallel_size,
                                     reasoning_parser=reasoning_parser)
    except ValueError as err:
        fail(str(err))
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("deepinfer.server").warning(
            "serving on %s without --api-key: anyone who can reach this address can use the model", host)
    if _runs_on_cpu(config.device):
        from deepinfer.core.engine.worker.cpu_threads import set_cpu_threads

        logging.getLogger("deepinfer.server").info(set_cpu_threads(cpu_threads))
    try:
        code = run_server(config, server_config, log_level)
    except DeepInferError as err:
        fail(f"cannot serve: {err}")
    raise typer.Exit(code)


def _runs_on_cpu(device: str) -> bool:
    from deepinfer.core.engine.worker.startup import resolve_device
    from deepinfer.core.errors import DeepInferError

    try:
        return resolve_device(device).type == "cpu"
    except DeepInferError:  # a CUDA device that is not there: the engine reports it
        return False
