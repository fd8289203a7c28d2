"""QuantLinear: a drop-in for nn.Linear whose weight is a W4A16/W3A16 PackedWeight."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.core.ops.quant_matmul import quant_matmul
from deepinfer.core.quant.packed import PackedWeight

# the integer dtype of the same width, used to move scales between devices without casting them
_SAME_WIDTH_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


class QuantLinear(nn.Module):
    """y = x @ W.T + bias with W held packed; the PackedWeight fields are buffers, so .to(device) moves them.

    State-dict keys are the PackedWeight field names (`qweight`, `scales`, `zeros`, and `input_perm`,
    `bias` when present), the same names the layered checkpoint stores under each linear.

    `packed` is built (and validated) once and reused by every forward until a buffer is replaced
    (`.to()`, assignment); in-place updates such as load_state_dict's copies keep it valid.
    """

    def __init__(self, packed: PackedWeight) -> None:
        super().__init__()
        self.bits = packed.bits
        self.group_size = packed.group_size
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.zero_mode = packed.zero_mode
        self.register_buffer("qweight", packed.qweight)  # int32 [N, K * bits // 32]
        self.register_buffer("scales", packed.scales)  # [N, K // G]
        self.register_buffer("zeros", packed.zeros)  # [N, K // G]
        self.register_buffer("input_perm", packed.input_perm)  # int32 [K] or None
        self.register_buffer("bias", packed.bias)  # [N] or None
        self._packed: PackedWeight | None = None

    @property
    def packed(self) -> PackedWeight:
        packed, buffers = self._packed, self._buffers
        if (packed is None or packed.qweight is not buffers["qweight"] or packed.scales is not buffers["scales"]
                or packed.zeros is not buffers["zeros"] or packed.input_perm is not buffers["input_perm"]
                or packed.bias is not buffers["bias"]):
            packed = self._packed = PackedWeight(
                qweight=buffers["qweight"],
                scales=buffers["scales"],
                zeros=buffers["zeros"],
                bits=self.bits,
                group_size=self.group_size,
                in_features=self.in_features,
                out_features=self.out_features,
                zero_mode=self.zero_mode,
                input_perm=buffers["input_perm"],
                bias=buffers["bias"],
            )
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return quant_matmul(x, self.packed)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .half() cast every floating buffer, but scales and zeros must keep the
        # dtype they were stored in (fp16, or fp32 where the source is not fp16-exact): they pass
        # through `fn` as integer views, which change device only. The bias follows the model dtype.
        stored = {name: self._buffers[name].dtype for name in ("scales", "zeros")}
        for name, dtype in stored.items():
            self._buffers[name] = self._buffers[name].view(_SAME_WIDTH_INT[dtype])
        try:
            super()._apply(fn, recurse)
        finally:
            for name, dtype in stored.items():
                self._buffers[name] = self._buffers[name].view(dtype)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, zero_mode={self.zero_mode}, "
                f"act_order={self.input_perm is not None}, bias={self.bias is not None}")
