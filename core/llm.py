"""LLM: offline batch generation in the spirit of vLLM.

    from deepinfer import LLM, SamplingParams
    llm = LLM()                                   # the default model; or LLM("path", max_num_seqs=8, ...)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    print(outputs[0].text)

Sampling fields a SamplingParams leaves unset (temperature, top_p, top_k, min_p,
repetition_penalty) take the model's defaults (its generation_config.json or GGUF metadata), with
`override_generation_config={...}` over them: `llm.sampling_defaults` says which and from where.

`LLM(..., engine_process=True)` runs the engine core in its own process (core/engine/frontend/core_client.py);
this process then tokenizes, detokenizes and matches stop strings, and `generate` gives the same outputs.
`llm.shutdown()` stops that process (it also ends with this one).

Every prompt is validated before anything runs, so a bad one raises (InvalidRequestError,
PromptTooLongError) without wasting the others' work. Prompts are fed to the engine as its
bounded waiting queue has room, and run together in continuous batches.

Structured outputs: `SamplingParams(structured_outputs={"json": schema})` (or regex, choice,
grammar, json_object). Tools: `llm.chat(messages, params, tools=[...], tool_choice="required")`
renders them with the model's template and, for "required" or a named function, constrains the
reply to calls; `llm.parse_tool_calls(output)` reads the calls back (docs/STRUCTURED_OUTPUTS.md).

Reasoning models: each sample `llm.chat` returns is a ChatCompletionOutput, its thinking in
`reasoning_content` and its answer in `content` (core/reasoning; the parser is detected from the
chat template, or `reasoning_parser="qwen3" | "deepseek_r1" | "none"`); `chat_template_kwargs`
reach the template (`{"enable_thinking": False}`), a constraint starts after the reasoning, and
`thinking_token_budget=N` ends the reasoning after N tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from deepinfer.core.chat_output import ChatCompletionOutput
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.outputs import RequestOutput
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingDefaults, SamplingParams
from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.reasoning import ReasoningSplit, make_reasoning_parser
from deepinfer.core.structured.params import StructuredOutputsParams
from deepinfer.core.structured.tool_parsers import ToolCall, ToolParser, make_tool_parser
from deepinfer.core.structured.tools import ToolPlan, render_chat

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, engine_process: bool = False, **engine_args: Any) -> None:
        """`engine_args` are EngineConfig fields (dtype, device, max_num_seqs, kv_cache_dtype, ...).
        `engine_process`: the engine core in its own process (an EngineCoreClient), else in this thread."""
        self.config = EngineConfig(model=model, **engine_args)
        self._loop: asyncio.AbstractEventLoop | None = None  # drives the engine process's client
        if engine_process:
            from deepinfer.core.engine.frontend.core_client import EngineCoreClient

            self.engine = EngineCoreClient(self.config)
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.engine.start())
        else:
            self.engine = LLMEngine(self.config)

    def shutdown(self) -> None:
        """Stop the engine process (with `engine_process`), or a tensor-parallel engine's other ranks."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self.engine.shutdown())
            self._loop.close()
        elif self._loop is None:
            self.engine.close()

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What unset sampling fields take, and where each value came from (model, flag, built-in)."""
        return self.engine.sampling_defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams holding the defaults (vLLM's name), to start from with dataclasses.replace."""
        return SamplingParams().with_defaults(self.sampling_defaults)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given."""
        prompt_list = _normalize_prompts(prompts)
        params_list = [params.with_defaults(self.sampling_defaults)
                       for params in _normalize_params(sampling_params, len(prompt_list))]
        groups = [self.engine.make_request_group(prompt, params)
                  for prompt, params in zip(prompt_list, params_list)]
        if self._loop is not None:
            return self._loop.run_until_complete(self._generate_in_engine_process(groups))
        results: dict[str, RequestOutput] = {}
        pending = list(reversed(groups))
        while pending or self.engine.has_unfinished_requests():
            while pending and self.engine.scheduler.has_room(len(pending[-1].samples)):
                self.engine.add_request_group(pending.pop())
            outputs, _ = self.engine.step()
            for output in outputs:
                if output.finished:
                    results[output.request_id] = output
        return [results[group.request_id] for group in groups]

    async def _generate_in_engine_process(self, groups: list) -> list[RequestOutput]:
        """Feed the groups to the engine process as its waiting queue has room (at most
        max_waiting_requests samples not finished), each one's final output in the order given."""
        results: dict[str, RequestOutput] = {}
        finished: asyncio.Queue = asyncio.Queue()  # (group, error or None) as each one ends

        async def follow(stream, group) -> None:
            try:
                async for output in stream:  # the last one is the finished output
                    results[group.request_id] = output
            except BaseException as err:  # noqa: BLE001 -- raised below, on the caller's side
                finished.put_nowait((group, err))
            else:
                finished.put_nowait((group, None))

        pending, tasks, running, open_samples = list(reversed(groups)), set(), 0, 0
        while pending or running:
            while pending and open_samples + len(pending[-1].samples) <= self.config.max_waiting_requests:
                group = pending.pop()
                running, open_samples = running + 1, open_samples + len(group.samples)
                task = asyncio.ensure_future(follow(self.engine.add_request_group(group), group))
                tasks.add(task)  # the event loop keeps only weak references to tasks
                task.add_done_callback(tasks.discard)
            group, error = await finished.get()
            if error is not None:
                raise error
            running, open_samples = running - 1, open_samples - len(group.samples)
        return [results[group.request_id] for group in groups]

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_parser: str | None = None,
        thinking_token_budget: int | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        `tools`, `tool_choice`, `parallel_tool_calls`: as in OpenAI's API; `tool_call_parser`: the
        call format (a TOOL_PARSERS name; default: detected from the template);
        `chat_template_kwargs`: more template variables; `reasoning_parser`: see the module docstring;
        `thinking_token_budget`: at most this many tokens of reasoning, then its end marker is forced."""
        tokenizer = self.engine.tokenizer
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for c in conversations for m in c)
        plan = parser = None
        if tools is not None or tool_choice is not None or has_tool_turns:
            parser = self._tool_parser(tool_call_parser)
            try:
                plan = ToolPlan.make(tools, tool_choice, parallel_tool_calls, parser)
            except (TypeError, ValueError) as err:
                raise InvalidRequestError(str(err)) from None
        try:
            thinking = make_reasoning_parser(reasoning_parser, tokenizer)
        except ValueError as err:
            raise InvalidRequestError(str(err)) from None
        texts = [tokenizer.apply_chat_template(conversation, template_variables=chat_template_kwargs)
                 if parser is None else render_chat(tokenizer, conversation, True, parser, plan, chat_template_kwargs)
                 for conversation in conversations]
        splits = [ReasoningSplit(thinking, thinking.opening(text)) if thinking is not None else None
                  for text in texts]
        params_list = _normalize_params(sampling_params, len(texts))
        if plan is not None and plan.constraint is not None:
            if any(p.structured_outputs is not None for p in params_list):
                raise InvalidRequestError("tool_choice 'required' or a named function cannot be combined with "
                                          "structured_outputs")
            params_list = [replace(p, structured_outputs=plan.constraint) for p in params_list]
        if plan is not None and plan.parses_calls and parser.needs_special_tokens:
            params_list = [replace(p, skip_special_tokens=False) for p in params_list]
        params_list = [self._after_reasoning(p, split, thinking_token_budget) for p, split in zip(params_list, splits)]
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(prompts, params_list)
        for output, split in zip(outputs, splits):
            output.outputs = [ChatCompletionOutput.of(c, split) for c in output.outputs]
        return outputs

    def _after_reasoning(self, params: SamplingParams, split: ReasoningSplit | None,
                         budget: int | None) -> SamplingParams:
        """`params` with its constraint starting after the reasoning, which `budget` caps (and the markers
        kept in the text)."""
        if split is None:
            return params
        if split.parser.needs_special_tokens(self.engine.tokenizer):
            params = replace(params, skip_special_tokens=False)
        try:
            span = split.grammar_span(self.engine.tokenizer, budget)
        except ValueError as err:
            raise InvalidRequestError(str(err)) from None
        if span is None:
            return params
        if params.structured_outputs is not None:
            return replace(params, structured_outputs=replace(params.structured_outputs, reasoning=span))
        if budget is not None:  # the budget alone: the gate with a free answer
            return replace(params, structured_outputs=StructuredOutputsParams(reasoning=span))
        return params

    def _tool_parser(self, name: str | None = None) -> ToolParser:
        """The tool-call parser `name`, or the one the chat template's format calls for."""
        try:
            return make_tool_parser(name, self.engine.tokenizer)
        except ValueError as err:
            raise InvalidRequestError(str(err)) from None

    def parse_tool_calls(self, output: RequestOutput, index: int = 0,
                         tool_call_parser: str | None = None) -> tuple[str | None, list[ToolCall]]:
        """A chat output's reply (sample `index`) -> (content outside the calls or None, the tool calls)."""
        return self._tool_parser(tool_call_parser).extract(output.outputs[index].text)


def _normalize_prompts(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"prompts must be a string, a list of strings or token id lists, "
                                  f"got {type(prompts).__name__}")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    return list(prompts)


def _normalize_params(params, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise InvalidRequestError(f"got {len(params)} sampling params for {num_prompts} prompts")
    return list(params)
