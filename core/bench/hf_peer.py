"""The HF transformers peer: the same shape and prompts through `model.generate`, statically batched.

This is what one gets without a serving engine: `concurrency` prompts go in as one batch, the
next batch starts when the whole previous one is done. For dummy-weight shapes the model is built
from the same config.json with random weights directly on the device (bf16/fp16 on a GPU, fp32
on the CPU); both sides ignore EOS so every request produces exactly `output_len` tokens.

Timing matches the engine's client-side definitions (core/bench/latency.py): a request is sent
when its batch starts, and every request of a batch receives each token when the step that made
it ends. A stopping criterion stamps the end of each step after a device synchronize (generate
already synchronizes there to check its own stopping condition, so this adds almost nothing).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from deepinfer.core.bench.latency import RequestTiming
from deepinfer.core.errors import InvalidRequestError


def resolve_peer_dtype(dtype: str, device: str):
    """The engine's dtype rule: 'auto' is bf16 on a GPU that has it (else fp16), fp32 on the CPU."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def peer_source(config, device: str) -> dict:
    """What the HF peer loads for an engine config: the same config.json, random weights for dummy runs."""
    if config.dummy_weights and config.shape is not None:
        from deepinfer.core.models.loader import shape_file_path

        return {"device": device, "dtype": config.dtype, "config_json": str(shape_file_path(config.shape))}
    model_dir = Path(config.model).expanduser() if config.model is not None else None
    if model_dir is None or not (model_dir / "config.json").is_file():
        raise InvalidRequestError(
            "--peer hf needs --dummy-weights --shape NAME or an HF model directory (with config.json); "
            f"got model {config.model!r}")
    if config.dummy_weights:
        return {"device": device, "dtype": config.dtype, "config_json": str(model_dir / "config.json")}
    return {"device": device, "dtype": config.dtype, "model_dir": str(model_dir)}


def load_hf_peer(config_json: str | Path | None, model_dir: str | Path | None, device: str, dtype):
    """An HF causal LM: random weights from `config_json`, else the checkpoint in `model_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if config_json is not None:
        fields = json.loads(Path(config_json).read_text())
        fields = {k: v for k, v in fields.items() if not k.startswith("_")}  # notes like "_source"
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise InvalidRequestError(f"{config_json}: no model_type, cannot build the HF peer")
        config = AutoConfig.for_model(model_type, **fields)
        # Building on the device skips a CPU init + copy of every weight (minutes for a 7B body).
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval()


def _step_clock(times: list[float], device: str):
    """A stopping criterion that never stops, only stamps the end of every generate step."""
    import torch
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


def generate_batch(model, prompts: list[list[int]], output_len: int, device: str) -> tuple[float, list[float]]:
    """One static batch: (sent at, end time of each of the `output_len` steps)."""
    import torch
    from transformers import StoppingCriteriaList

    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise InvalidRequestError("the HF peer batches prompts of one length only (no padding)")
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)  # [batch, prompt_len]
    step_times: list[float] = []
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    sent = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
            max_new_tokens=output_len, min_new_tokens=output_len,  # EOS suppressed until the fixed length
            pad_token_id=pad if pad is not None else 0,
            stopping_criteria=StoppingCriteriaList([_step_clock(step_times, device)]))
    produced = output.shape[1] - input_ids.shape[1]
    if produced != output_len or len(step_times) != output_len:
        raise RuntimeError(f"HF peer produced {produced} tokens in {len(step_times)} steps, expected {output_len}")
    return sent, step_times


def run_peer_level(model, prompts: list[list[int]], output_len: int, concurrency: int,
                   device: str, label: str) -> tuple[list[RequestTiming], float]:
    """All prompts in static batches of `concurrency`: (per-request timings, wall seconds)."""
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        batch = prompts[first:first + concurrency]
        sent, step_times = generate_batch(model, batch, output_len, device)
        for offset, prompt in enumerate(batch):
            timing = RequestTiming(f"{label}-{first + offset}", len(prompt), sent)
            for t in step_times:
                timing.record(t, 1)
            timings.append(timing)
    return timings, time.perf_counter() - start


def warm_up_peer(model, prompt: list[int], device: str) -> None:
    """One short generate so the first measured batch pays no CUDA/cuBLAS start-up cost."""
    generate_batch(model, [prompt], 2, device)
