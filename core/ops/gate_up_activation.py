"""The merged gate/up projection of a gated MLP with the activation fused into the product's epilogue.

A decode step runs the W4 gate/up product on the tcs kernel and then act_and_mul_kernel, which reads the [T, 2I]
product back and writes act(gate) * up [T, I]: a kernel launch and its round trips per layer. Where the fused
kernel serves (kernels/quant_matmul.py: gate_up_act_unsupported_reason, gate_up_act_takes), the product's epilogue
does that work instead, with the same roundings, so the result is the unfused one bit for bit. Everywhere else
(other weights, more tokens, the CPU) the caller runs the two ops.
"""

from __future__ import annotations

import torch

from deepinfer.core.ops import dispatch


def gate_up_act_and_mul(x: torch.Tensor, gate_up_proj: torch.nn.Module, activation: str) -> torch.Tensor | None:
    """x [T, hidden] through the merged projection `gate_up_proj` ([gate | up] outputs, 2I) -> act(gate) * up
    [T, I] as `gate_up_proj(x)` + act_and_mul would give, or None where the fused kernel does not serve (the caller
    then runs those two)."""
    from deepinfer.kernels import registry
    from deepinfer.kernels.quant_matmul import gate_up_act_takes

    op = registry.get("quant_matmul_act_and_mul")
    served = dispatch.fused_product_inputs(
        op.name, x, gate_up_proj, gate_up_act_takes, (activation,), (),
        lambda packed: op.unsupported_reason(packed.qweight, packed.bits, packed.group_size, packed.in_features,
                                             activation))
    if served is None:
        return None
    x, packed = served
    return op.launch(x, packed.qweight, packed.scales, packed.zeros, packed.bias, packed.group_size, packed.zero_mode,
                     packed.integer_zeros, activation)
