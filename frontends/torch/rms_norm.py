"""RMSNorm for torch: autograd wiring around :mod:`liger_core.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from liger_core import rms_norm as core

from ._launch import check_tensors, info, num_sms, optional_info, rowwise, run_plan


class LigerRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place):
        x = rowwise(x)
        plan = core.forward_plan(info(x), optional_info(weight), eps=eps, offset=offset, casting_mode=casting_mode)
        y, rstd = run_plan(plan, x=x, weight=weight)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting_mode, ctx.in_place = offset, casting_mode, in_place
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, rstd = ctx.saved_tensors
        dy = rowwise(grad_output)
        plan = core.backward_plan(info(dy), info(x), optional_info(weight), offset=ctx.offset,
                                  casting_mode=ctx.casting_mode, num_sms=num_sms(x.device), in_place=ctx.in_place)
        grads = run_plan(plan, dy=dy, x=x, weight=weight, rstd=rstd)
        dw = grads[1] if weight is not None else None
        return grads[0], dw, None, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0,
             casting_mode: str = "llama", in_place: bool = True) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x * rstd * (offset + weight)``.

    ``casting_mode`` is ``"llama"`` (HF LlamaRMSNorm), ``"gemma"`` (all fp32; use offset=1.0 for Gemma) or
    ``"none"``. With ``in_place`` the backward writes dx over the incoming gradient when that is safe (same
    dtype, dense); turn it off when the gradient of the output is shared with another branch (Gemma 2/3
    post-norms feeding a residual sum).
    """
    check_tensors(x=x, weight=weight)
    return LigerRMSNormFunction.apply(x, weight, float(eps), float(offset), casting_mode, bool(in_place))


class RMSNorm(nn.Module):
    """Drop-in for ``LlamaRMSNorm`` (attributes ``weight`` and ``variance_epsilon``, same state_dict keys)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 in_place: bool = True, init_fn: str = "ones", device=None, dtype=None):
        super().__init__()
        if init_fn not in ("ones", "zeros"):
            raise ValueError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")
        if casting_mode not in core.CASTING_MODES:
            raise ValueError(f"casting_mode must be one of {tuple(core.CASTING_MODES)}, got {casting_mode!r}")
        fill = torch.ones if init_fn == "ones" else torch.zeros
        self.weight = nn.Parameter(fill(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode,
                        self.in_place)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, "
                f"casting_mode={self.casting_mode!r}, in_place={self.in_place}")
