"""The vocabulary head's product: hidden [N, H] x weight [V, H] -> logits [N, V] float32.

On the CPU a decode step reads the whole head, 113 MB in fp32 for SmolLM2's 49152 x 576 tied embedding: more
time than all its int4 layers together, since the product is bound by memory bandwidth. Under the CPU layouts that
already round activations to bf16 (DEEPINFER_CPU_WEIGHTS `packed` or `int4`, core/ops/quant_matmul_cpu.py) the head
runs on an fp16 copy made once, with the hidden state rounded to fp16: half the bytes, a GGUF's fp16 embedding kept
exactly, logits within fp16 rounding of the input (tests/test_logits_head.py). `dense` and every other device
keep the plain product in the weight's dtype, the reference's bits.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from deepinfer.core.ops.quant_matmul_cpu import cpu_weights_mode

# id(weight) -> (weakref to it, its _version when copied, the fp16 copy)
_fp16_copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def logits_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] @ weight[V, H].T as float32 logits [N, V]."""
    if hidden.device.type != "cpu" or weight.dtype != torch.float32 or cpu_weights_mode() == "dense":
        return F.linear(hidden, weight).float()
    return F.linear(hidden.to(torch.float16), _fp16_copy(weight)).float()


def _fp16_copy(weight: torch.Tensor) -> torch.Tensor:
    """The weight in fp16, made on first use and again after an in-place write (a load fills weights in place)."""
    key = id(weight)
    entry = _fp16_copies.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != weight._version:
        copy = weight.detach().to(torch.float16)
        entry = _fp16_copies[key] = (weakref.ref(weight, lambda _, key=key: _fp16_copies.pop(key, None)),
                                     weight._version, copy)
    return entry[2]
