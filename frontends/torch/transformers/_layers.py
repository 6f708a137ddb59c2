"""Kernel-backed forwards for the submodules of Hugging Face decoder models.

Each function here becomes the ``forward`` (or ``_apply_gate``) of a subclass of the model's own class (see
``_patching.liger_subclass``): the module keeps its constructor, attributes, parameters and state_dict keys and
only computes with the kernels. Anything the kernels do not cover (an activation they lack, cos/sin that need a
gradient, transposed expert weights) falls back to the original method.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rms_norm import rms_norm
from ..rope import rope
from ..swiglu import gated_down, geglu, swiglu


def activation_kind(act) -> str | None:
    """The gated kernel for an HF activation module: ``"silu"``, ``"gelu_tanh"``, ``"gelu"`` or None."""
    name = type(act).__name__
    if name in ("SiLU", "SiLUActivation"):
        return "silu"
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"):
        return "gelu_tanh"
    if name == "GELU":  # torch.nn.GELU
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    if name == "GELUActivation" and getattr(act, "act", F.gelu) is F.gelu:
        return "gelu"
    return None


def gated(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    """act(a) * b with the kernel. in_place: a and b are the caller's own projection outputs (the kernel turns
    it off by itself when they share memory, e.g. two halves of one gate_up projection)."""
    if kind == "silu":
        return swiglu(a, b, in_place=True)
    return geglu(a, b, approximate="tanh" if kind == "gelu_tanh" else "none", in_place=True)


def gated_then_down(a: torch.Tensor, b: torch.Tensor, kind: str, down) -> torch.Tensor:
    """down(act(a) * b): the product is recomputed in the backward instead of saved when ``down`` is a plain
    ``nn.Linear`` (:func:`liger_torch.swiglu.gated_down`), in place as :func:`gated`."""
    return gated_down(a, b, down, kind, in_place=True)


def rms_norm_forward(self, hidden_states):
    eps = getattr(self, "variance_epsilon", None)
    if eps is None:
        eps = self.eps
    # in place: the backward writes dx over the incoming gradient only where nothing else holds it
    return rms_norm(hidden_states, self.weight, eps, self._liger_offset, self._liger_casting_mode, True)


def gated_mlp_forward(self, x):
    """gate_proj / up_proj / down_proj MLPs (LlamaMLP, GemmaMLP, ...)."""
    kind = activation_kind(self.act_fn)
    if kind is None:
        return self._liger_base.forward(self, x)
    return gated_then_down(self.gate_proj(x), self.up_proj(x), kind, self.down_proj)


def fused_gate_up_mlp_forward(self, hidden_states):
    """Phi3MLP: one gate_up_proj whose first half is the gate."""
    kind = activation_kind(self.activation_fn)
    if kind is None:
        return self._liger_base.forward(self, hidden_states)
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return gated_then_down(gate, up, kind, self.down_proj)


def experts_apply_gate(self, gate_up_out):
    """The gating step of transformers' fused-tensor experts (MixtralExperts, Qwen3MoeExperts) under the
    ``grouped_mm`` / ``batched_mm`` implementations (and the eager loop below): [gate; up] -> act(gate) * up."""
    kind = activation_kind(self.act_fn)
    if kind is None or not getattr(self, "is_concatenated", True):
        return self._liger_base._apply_gate(self, gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return gated(gate, up, kind)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Eager per-expert loop with the kernel gate; other experts implementations (``grouped_mm``, ...) are
    transformers' own and reach the kernel through ``_apply_gate``."""
    impl = getattr(getattr(self, "config", None), "_experts_implementation", None)
    if (impl not in (None, "eager") or getattr(self, "is_transposed", False) or getattr(self, "has_bias", False)
            or not getattr(self, "has_gate", True) or not hasattr(self, "gate_up_proj")):
        return self._liger_base.forward(self, hidden_states, top_k_index, top_k_weights)
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():
        if expert >= self.num_experts:  # expert-parallel sentinel for experts held elsewhere
            continue
        token, slot = torch.where(top_k_index == expert)
        h = F.linear(hidden_states[token], self.gate_up_proj[expert])
        h = F.linear(experts_apply_gate(self, h), self.down_proj[expert])
        out.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def make_rope(original):
    """A drop-in for a modeling module's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, including
    partial rotary (cos narrower than the head: the rest of the head passes through, as in Phi3)."""

    def liger_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if (unsqueeze_dim not in (1, 2) or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
                or cos.shape[-1] > q.shape[-1] or cos.shape[-1] % 2):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        rot = cos.shape[-1]
        if rot == q.shape[-1]:
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        q_rot, k_rot = rope(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim=unsqueeze_dim)
        return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)

    liger_apply_rotary_pos_emb._liger_original = original
    return liger_apply_rotary_pos_emb
