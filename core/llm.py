"""LLM: offline batch generation in the spirit of vLLM.

    from deepinfer import LLM, SamplingParams
    llm = LLM()                                   # the default model; or LLM("path", max_num_seqs=8, ...)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    print(outputs[0].text)

Every prompt is validated before anything runs, so a bad one raises (InvalidRequestError,
PromptTooLongError) without wasting the others' work. Prompts are fed to the engine as its
bounded waiting queue has room, and run together in continuous batches.
"""

from __future__ import annotations

from typing import Any

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.outputs import RequestOutput
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.errors import InvalidRequestError

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`engine_args` are EngineConfig fields (dtype, device, max_num_seqs, kv_cache_dtype, ...)."""
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config)

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
        params_list = _normalize_params(sampling_params, len(prompt_list))
        groups = [self.engine.make_request_group(prompt, params)
                  for prompt, params in zip(prompt_list, params_list)]
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

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.encode_chat(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params)


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
