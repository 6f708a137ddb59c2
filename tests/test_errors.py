"""Every validated condition of docs/errors.md, for both frontends: the documented exception and message, raised
before any kernel is launched, on the CPU and on the GPU.

docs/errors.md is the single source of the expected exception types and message fragments: this module parses
its tables, and holds only the inputs, one bad argument per row (everything else valid). A documented row
without an input here, or an input here without a row, fails ``test_every_documented_row_has_a_case``.
"""

import builtins
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import liger_core
import liger_torch
import liger_torch._launch

ON_GPU = not liger_core.INTERPRET
DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
_ROW = re.compile(r"^\|\s*`(?P<id>[a-z0-9_.]+)`\s*\|(?P<condition>[^|]*)\|(?P<torch>[^|]*)\|(?P<jax>[^|]*)\|\s*$")
_CELL = re.compile(r"^\s*`(?P<type>[A-Za-z]+Error)`:\s*`(?P<fragment>[^`]+)`")


def documented_rows():
    """{row id: {"torch": (exception type, fragment) or None, "jax": ...}} from the tables of docs/errors.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = _ROW.match(line)
        if not match:
            continue
        assert match["id"] not in rows, f"docs/errors.md: row {match['id']} appears twice"
        spec = {}
        for frontend in ("torch", "jax"):
            cell = match[frontend].strip()
            parsed = _CELL.match(cell)
            assert parsed or cell.startswith("—"), f"docs/errors.md row {match['id']}: cannot read {cell!r}"
            spec[frontend] = (getattr(builtins, parsed["type"]), parsed["fragment"]) if parsed else None
        rows[match["id"]] = spec
    assert len(rows) > 100, f"docs/errors.md: only {len(rows)} rows parsed; did the table format change?"
    return rows


ROWS = documented_rows()


# ------------------------------------------------------------------------------------------------ torch inputs
def T(d, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(d, dtype)


def I(d, *shape, dtype=torch.long):
    return torch.zeros(shape, dtype=dtype, device=d)


def logp(d, *shape):
    return torch.log_softmax(T(d, *shape), -1)


# Valid arguments of every function, by keyword; a case overrides one of them. The first is the first array.
TORCH_GOOD = {
    "rms_norm": lambda d: dict(x=T(d, 4, 8), weight=T(d, 8)),
    "layer_norm": lambda d: dict(x=T(d, 4, 8), weight=T(d, 8), bias=T(d, 8)),
    "fused_add_rms_norm": lambda d: dict(x=T(d, 4, 8), residual=T(d, 4, 8), weight=T(d, 8)),
    "rope": lambda d: dict(q=T(d, 2, 4, 7, 8), k=T(d, 2, 2, 7, 8), cos=T(d, 7, 8), sin=T(d, 7, 8)),
    "swiglu": lambda d: dict(a=T(d, 4, 8), b=T(d, 4, 8)),
    "geglu": lambda d: dict(a=T(d, 4, 8), b=T(d, 4, 8)),
    "swiglu_linear": lambda d: dict(a=T(d, 4, 8), b=T(d, 4, 8), weight=T(d, 5, 8), bias=T(d, 5)),
    "geglu_linear": lambda d: dict(a=T(d, 4, 8), b=T(d, 4, 8), weight=T(d, 5, 8), bias=T(d, 5)),
    "cross_entropy": lambda d: dict(logits=T(d, 4, 10), target=I(d, 4)),
    "fused_linear_cross_entropy": lambda d: dict(x=T(d, 4, 8), weight=T(d, 10, 8), target=I(d, 4)),
    "kl_div": lambda d: dict(input=logp(d, 2, 3), target=logp(d, 2, 3).exp()),
    "jsd": lambda d: dict(student_logprobs=logp(d, 2, 3), teacher_logprobs=logp(d, 2, 3)),
    "fused_linear_jsd": lambda d: dict(student_input=T(d, 4, 8), student_weight=T(d, 10, 8),
                                       teacher_input=T(d, 4, 6), teacher_weight=T(d, 10, 6)),
}


def torch_call(fn_name, d, **over):
    kwargs = TORCH_GOOD[fn_name](d)
    kwargs.update(over)
    return getattr(liger_torch, fn_name)(**kwargs)


def _on_every_function(make_bad):
    """A case that calls every function with its first array replaced by ``make_bad(good_first_array)``."""
    def case(d, fragment, error):
        for fn_name, good in TORCH_GOOD.items():
            first = next(iter(good(d)))
            with pytest.raises(error, match=re.escape(fragment)) as info:
                torch_call(fn_name, d, **{first: make_bad(good(d)[first])})
            assert first in str(info.value), f"{fn_name}: the message does not name {first}: {info.value}"
    return case


def _first_output(out):
    return out[0] if isinstance(out, tuple) else out


def _torch_second_derivative(d, fragment, error):
    """Every function: the gradient of its first input taken with create_graph, then differentiated again."""
    for fn_name, good in TORCH_GOOD.items():
        kwargs = good(d)
        first = next(iter(kwargs))
        x = kwargs[first].detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(_first_output(torch_call(fn_name, d, **{first: x})).sum(), x,
                                      create_graph=True)
        with pytest.raises(error, match=re.escape(fragment)):
            (grad * grad).sum().backward()


def _only(gpu):
    def wrap(case):
        def run(d, fragment, error):
            if gpu != ON_GPU:
                pytest.skip("applies only when the kernels are " + ("compiled for the GPU" if gpu else "interpreted"))
            case(d, fragment, error)
        return run
    return wrap


def _requires_grad(t):
    return t.requires_grad_(True)


class _Config(SimpleNamespace):
    pass


NAN, INF = float("nan"), float("inf")

TORCH_CASES = {
    "all.not_an_array": _on_every_function(lambda t: t.tolist()),
    "all.float64": _on_every_function(lambda t: t.double()),
    "all.unsupported_torch_dtype": _on_every_function(lambda t: t.to(torch.complex64)),
    "all.device_interpreter": _only(gpu=False)(_on_every_function(lambda t: torch.empty(t.shape, device="meta"))),
    "all.device_not_cuda": _only(gpu=True)(_on_every_function(lambda t: t.cpu())),
    "all.second_derivative": _torch_second_derivative,

    "rms_norm.x_scalar": ("rms_norm", lambda d: dict(x=T(d), weight=None)),
    "rms_norm.x_empty": ("rms_norm", lambda d: dict(x=T(d, 0, 8))),
    "rms_norm.x_int": ("rms_norm", lambda d: dict(x=I(d, 4, 8, dtype=torch.int32))),
    "rms_norm.weight_shape": ("rms_norm", lambda d: dict(weight=T(d, 7))),
    "rms_norm.weight_int": ("rms_norm", lambda d: dict(weight=I(d, 8))),
    "rms_norm.casting_mode": ("rms_norm", lambda d: dict(casting_mode="fp8")),
    "rms_norm.eps_negative": ("rms_norm", lambda d: dict(eps=-1e-6)),
    "rms_norm.eps_nan": ("rms_norm", lambda d: dict(eps=NAN)),
    "rms_norm.eps_none": ("rms_norm", lambda d: dict(eps=None)),
    "rms_norm.offset_nan": ("rms_norm", lambda d: dict(offset=INF)),

    "layer_norm.x_scalar": ("layer_norm", lambda d: dict(x=T(d), weight=None, bias=None)),
    "layer_norm.x_empty": ("layer_norm", lambda d: dict(x=T(d, 0, 8))),
    "layer_norm.x_int": ("layer_norm", lambda d: dict(x=I(d, 4, 8))),
    "layer_norm.weight_shape": ("layer_norm", lambda d: dict(weight=T(d, 9))),
    "layer_norm.bias_shape": ("layer_norm", lambda d: dict(bias=T(d, 1, 8))),
    "layer_norm.bias_int": ("layer_norm", lambda d: dict(bias=I(d, 8))),
    "layer_norm.eps_negative": ("layer_norm", lambda d: dict(eps=-1.0)),
    "layer_norm.eps_nan": ("layer_norm", lambda d: dict(eps=NAN)),

    "fused_add_rms_norm.x_int": ("fused_add_rms_norm", lambda d: dict(x=I(d, 4, 8))),
    "fused_add_rms_norm.residual_shape": ("fused_add_rms_norm", lambda d: dict(residual=T(d, 4, 1))),
    "fused_add_rms_norm.residual_int": ("fused_add_rms_norm", lambda d: dict(residual=I(d, 4, 8))),
    "fused_add_rms_norm.weight_shape": ("fused_add_rms_norm", lambda d: dict(weight=T(d, 4, 8))),
    "fused_add_rms_norm.casting_mode": ("fused_add_rms_norm", lambda d: dict(casting_mode="Llama")),
    "fused_add_rms_norm.eps_negative": ("fused_add_rms_norm", lambda d: dict(eps=-INF)),
    "fused_add_rms_norm.offset_nan": ("fused_add_rms_norm", lambda d: dict(offset=NAN)),

    "rope.q_not_4d": ("rope", lambda d: dict(q=T(d, 4, 7, 8))),
    "rope.q_int": ("rope", lambda d: dict(q=I(d, 2, 4, 7, 8))),
    "rope.k_empty": ("rope", lambda d: dict(k=T(d, 2, 0, 7, 8))),
    "rope.k_batch": ("rope", lambda d: dict(k=T(d, 3, 2, 7, 8))),
    "rope.k_seq": ("rope", lambda d: dict(k=T(d, 2, 2, 5, 8))),
    "rope.k_head_dim": ("rope", lambda d: dict(k=T(d, 2, 2, 7, 4))),
    "rope.head_dim_odd": ("rope", lambda d: dict(q=T(d, 2, 4, 7, 7), k=T(d, 2, 2, 7, 7), cos=T(d, 7, 7),
                                                 sin=T(d, 7, 7))),
    "rope.cos_rank": ("rope", lambda d: dict(cos=T(d, 8), sin=T(d, 8))),
    "rope.cos_int": ("rope", lambda d: dict(cos=I(d, 7, 8), sin=I(d, 7, 8))),
    "rope.sin_shape": ("rope", lambda d: dict(sin=T(d, 1, 7, 8))),
    "rope.sin_dtype": ("rope", lambda d: dict(sin=T(d, 7, 8, dtype=torch.bfloat16))),
    "rope.cos_head_dim": ("rope", lambda d: dict(cos=T(d, 7, 4), sin=T(d, 7, 4))),
    "rope.cos_batch": ("rope", lambda d: dict(cos=T(d, 3, 7, 8), sin=T(d, 3, 7, 8))),
    "rope.cos_length": ("rope", lambda d: dict(cos=T(d, 6, 8), sin=T(d, 6, 8))),
    "rope.position_ids_float": ("rope", lambda d: dict(position_ids=T(d, 7))),
    "rope.position_ids_shape": ("rope", lambda d: dict(position_ids=I(d, 2, 6))),
    "rope.unsqueeze_dim": ("rope", lambda d: dict(unsqueeze_dim=3)),
    "rope.cos_requires_grad": ("rope", lambda d: dict(cos=_requires_grad(T(d, 7, 8)))),
    "rope.interleaved_type": ("rope", lambda d: dict(interleaved="no")),

    "swiglu.a_scalar": ("swiglu", lambda d: dict(a=T(d), b=T(d))),
    "swiglu.a_empty": ("swiglu", lambda d: dict(a=T(d, 4, 0), b=T(d, 4, 0))),
    "swiglu.a_int": ("swiglu", lambda d: dict(a=I(d, 4, 8))),
    "swiglu.b_shape": ("swiglu", lambda d: dict(b=T(d, 8, 4))),
    "swiglu.b_dtype": ("swiglu", lambda d: dict(b=T(d, 4, 8, dtype=torch.float16))),
    "geglu.b_shape": ("geglu", lambda d: dict(b=T(d, 4, 9))),
    "geglu.approximate": ("geglu", lambda d: dict(approximate="erf")),
    "swiglu_linear.b_shape": ("swiglu_linear", lambda d: dict(b=T(d, 4, 9))),
    "swiglu_linear.weight_shape": ("swiglu_linear", lambda d: dict(weight=T(d, 8, 5))),
    "swiglu_linear.weight_int": ("swiglu_linear", lambda d: dict(weight=I(d, 5, 8))),
    "swiglu_linear.bias_shape": ("swiglu_linear", lambda d: dict(bias=T(d, 8))),
    "swiglu_linear.weight_dtype": ("swiglu_linear", lambda d: dict(weight=T(d, 5, 8, dtype=torch.float16))),
    "geglu_linear.approximate": ("geglu_linear", lambda d: dict(approximate="erf")),

    "cross_entropy.logits_3d": ("cross_entropy", lambda d: dict(logits=T(d, 2, 2, 10), target=I(d, 2, 2))),
    "cross_entropy.logits_scalar": ("cross_entropy", lambda d: dict(logits=T(d), target=I(d))),
    "cross_entropy.logits_empty": ("cross_entropy", lambda d: dict(logits=T(d, 0, 10), target=I(d, 0))),
    "cross_entropy.logits_int": ("cross_entropy", lambda d: dict(logits=I(d, 4, 10, dtype=torch.int32))),
    "cross_entropy.target_shape": ("cross_entropy", lambda d: dict(target=I(d, 5))),
    "cross_entropy.target_float": ("cross_entropy", lambda d: dict(target=I(d, 4, dtype=torch.bool))),
    "cross_entropy.target_out_of_range": ("cross_entropy", lambda d: dict(target=torch.tensor([0, 3, 10, 1],
                                                                                              device=d))),
    "cross_entropy.weight_shape": ("cross_entropy", lambda d: dict(weight=T(d, 9))),
    "cross_entropy.weight_int": ("cross_entropy", lambda d: dict(weight=I(d, 10))),
    "cross_entropy.reduction": ("cross_entropy", lambda d: dict(reduction="avg")),
    "cross_entropy.ignore_index_float": ("cross_entropy", lambda d: dict(ignore_index=-100.0)),
    "cross_entropy.ignore_index_huge": ("cross_entropy", lambda d: dict(ignore_index=2**64)),
    "cross_entropy.label_smoothing_range": ("cross_entropy", lambda d: dict(label_smoothing=NAN)),
    "cross_entropy.label_smoothing_str": ("cross_entropy", lambda d: dict(label_smoothing="0.1")),
    "cross_entropy.lse_square_scale_negative": ("cross_entropy", lambda d: dict(lse_square_scale=-1e-4)),
    "cross_entropy.lse_square_scale_nan": ("cross_entropy", lambda d: dict(lse_square_scale=NAN)),
    "cross_entropy.softcap_zero": ("cross_entropy", lambda d: dict(softcap=0.0)),
    "cross_entropy.softcap_inf": ("cross_entropy", lambda d: dict(softcap=INF)),
    "cross_entropy.return_z_loss_type": ("cross_entropy", lambda d: dict(return_z_loss="no")),
    "cross_entropy.weight_requires_grad": ("cross_entropy", lambda d: dict(weight=_requires_grad(T(d, 10).abs()))),

    "fused_linear_cross_entropy.x_int": ("fused_linear_cross_entropy", lambda d: dict(x=I(d, 4, 8))),
    "fused_linear_cross_entropy.x_empty": ("fused_linear_cross_entropy", lambda d: dict(x=T(d, 0, 8),
                                                                                       target=I(d, 0))),
    "fused_linear_cross_entropy.weight_hidden": ("fused_linear_cross_entropy", lambda d: dict(weight=T(d, 8, 10))),
    "fused_linear_cross_entropy.weight_dtype": ("fused_linear_cross_entropy",
                                                lambda d: dict(weight=T(d, 10, 8, dtype=torch.bfloat16))),
    "fused_linear_cross_entropy.bias_shape": ("fused_linear_cross_entropy", lambda d: dict(bias=T(d, 8))),
    "fused_linear_cross_entropy.bias_dtype": ("fused_linear_cross_entropy",
                                              lambda d: dict(bias=T(d, 10, dtype=torch.float16))),
    "fused_linear_cross_entropy.target_shape": ("fused_linear_cross_entropy", lambda d: dict(target=I(d, 4, 1))),
    "fused_linear_cross_entropy.target_float": ("fused_linear_cross_entropy", lambda d: dict(target=T(d, 4))),
    "fused_linear_cross_entropy.target_out_of_range": ("fused_linear_cross_entropy",
                                                       lambda d: dict(target=torch.tensor([0, -1, 2, 3], device=d))),
    "fused_linear_cross_entropy.ce_weight_shape": ("fused_linear_cross_entropy", lambda d: dict(ce_weight=T(d, 8))),
    "fused_linear_cross_entropy.chunk_size": ("fused_linear_cross_entropy", lambda d: dict(chunk_size=0)),
    "fused_linear_cross_entropy.chunk_size_type": ("fused_linear_cross_entropy", lambda d: dict(chunk_size=2.5)),
    "fused_linear_cross_entropy.accum_dtype_fp32_type": ("fused_linear_cross_entropy",
                                                         lambda d: dict(accum_dtype_fp32="no")),
    "fused_linear_cross_entropy.weight_empty": ("fused_linear_cross_entropy", lambda d: dict(weight=T(d, 0, 8))),
    "fused_linear_cross_entropy.ce_weight_requires_grad": ("fused_linear_cross_entropy",
                                                           lambda d: dict(ce_weight=_requires_grad(T(d, 10).abs()))),
    "fused_linear_cross_entropy.reduction": ("fused_linear_cross_entropy", lambda d: dict(reduction="batchmean")),
    "fused_linear_cross_entropy.softcap_nan": ("fused_linear_cross_entropy", lambda d: dict(softcap=NAN)),

    "kl_div.reduction": ("kl_div", lambda d: dict(reduction="avg")),
    "kl_div.input_empty": ("kl_div", lambda d: dict(input=T(d, 0, 3), target=T(d, 0, 3))),
    "kl_div.input_int": ("kl_div", lambda d: dict(input=I(d, 2, 3))),
    "kl_div.target_shape": ("kl_div", lambda d: dict(target=T(d, 1, 3))),
    "kl_div.target_int": ("kl_div", lambda d: dict(target=I(d, 2, 3))),
    "kl_div.target_requires_grad": ("kl_div", lambda d: dict(target=_requires_grad(T(d, 2, 3)))),
    "kl_div.log_target_type": ("kl_div", lambda d: dict(log_target="False")),

    "jsd.student_empty": ("jsd", lambda d: dict(student_logprobs=T(d, 2, 0), teacher_logprobs=T(d, 2, 0))),
    "jsd.student_int": ("jsd", lambda d: dict(student_logprobs=I(d, 2, 3))),
    "jsd.teacher_shape": ("jsd", lambda d: dict(teacher_logprobs=T(d, 2, 4))),
    "jsd.teacher_int": ("jsd", lambda d: dict(teacher_logprobs=I(d, 2, 3))),
    "jsd.labels_shape": ("jsd", lambda d: dict(labels=I(d, 3))),
    "jsd.labels_float": ("jsd", lambda d: dict(labels=T(d, 2))),
    "jsd.beta_range": ("jsd", lambda d: dict(beta=NAN)),
    "jsd.beta_str": ("jsd", lambda d: dict(beta="half")),
    "jsd.ignore_index_float": ("jsd", lambda d: dict(ignore_index=0.5)),
    "jsd.teacher_requires_grad": ("jsd", lambda d: dict(teacher_logprobs=_requires_grad(logp(d, 2, 3)))),

    "fused_linear_jsd.student_hidden": ("fused_linear_jsd", lambda d: dict(student_weight=T(d, 10, 7))),
    "fused_linear_jsd.teacher_hidden": ("fused_linear_jsd", lambda d: dict(teacher_weight=T(d, 10, 8))),
    "fused_linear_jsd.vocab": ("fused_linear_jsd", lambda d: dict(teacher_weight=T(d, 11, 6))),
    "fused_linear_jsd.teacher_rows": ("fused_linear_jsd", lambda d: dict(teacher_input=T(d, 5, 6))),
    "fused_linear_jsd.teacher_dtype": ("fused_linear_jsd",
                                       lambda d: dict(teacher_weight=T(d, 10, 6, dtype=torch.bfloat16))),
    "fused_linear_jsd.labels_shape": ("fused_linear_jsd", lambda d: dict(labels=I(d, 3))),
    "fused_linear_jsd.temperature_zero": ("fused_linear_jsd", lambda d: dict(temperature=0.0)),
    "fused_linear_jsd.temperature_nan": ("fused_linear_jsd", lambda d: dict(temperature=INF)),
    "fused_linear_jsd.beta_range": ("fused_linear_jsd", lambda d: dict(beta=-0.5)),
    "fused_linear_jsd.chunk_size": ("fused_linear_jsd", lambda d: dict(chunk_size=0)),
    "fused_linear_jsd.chunk_size_type": ("fused_linear_jsd", lambda d: dict(chunk_size=2.5)),
    "fused_linear_jsd.teacher_requires_grad": ("fused_linear_jsd",
                                               lambda d: dict(teacher_weight=_requires_grad(T(d, 10, 6)))),

    "modules.rms_norm_init_fn": lambda d: liger_torch.RMSNorm(8, init_fn="normal"),
    "modules.rms_norm_casting_mode": lambda d: liger_torch.RMSNorm(8, casting_mode="bf16"),
    "modules.rms_norm_hidden_size": lambda d: liger_torch.RMSNorm(-3),
    "modules.rms_norm_eps": lambda d: liger_torch.RMSNorm(8, eps=-1e-6),
    "modules.layer_norm_hidden_size": lambda d: liger_torch.LayerNorm(0),
    "modules.layer_norm_eps": lambda d: liger_torch.LayerNorm(8, eps=NAN),
    "modules.layer_norm_shape": lambda d: liger_torch.LayerNorm((4, 8)),
    "modules.layer_norm_input": lambda d: liger_torch.LayerNorm(8).to(d)(T(d, 4, 9)),
    "modules.cross_entropy_loss_options": lambda d: liger_torch.CrossEntropyLoss(reduction="avg"),
    "modules.cross_entropy_loss_in_place": lambda d: liger_torch.CrossEntropyLoss(in_place=1),
    "modules.kl_div_loss_log_target": lambda d: liger_torch.KLDivLoss(log_target="yes"),
    "modules.fused_linear_cross_entropy_loss_chunk_size": lambda d: liger_torch.FusedLinearCrossEntropyLoss(
        chunk_size=0),
    "modules.fused_linear_jsd_chunk_size": lambda d: liger_torch.FusedLinearJSD(chunk_size=-1),
    "modules.kl_div_loss_reduction": lambda d: liger_torch.KLDivLoss(reduction="avg"),
    "modules.jsd_beta": lambda d: liger_torch.JSD(beta=2.0),
    "modules.fused_linear_jsd_temperature": lambda d: liger_torch.FusedLinearJSD(temperature=-1.0),
    "modules.swiglu_mlp_activation": lambda d: liger_torch.SwiGLUMLP(
        _Config(hidden_size=8, intermediate_size=16, hidden_act="gelu")),
    "modules.geglu_mlp_activation": lambda d: liger_torch.GeGLUMLP(
        _Config(hidden_size=8, intermediate_size=16, hidden_activation="silu")),
}


# -------------------------------------------------------------------------------------------------- jax inputs
def _jax():
    import jax.numpy as jnp

    import liger_jax
    return jnp, liger_jax


def JT(*shape, dtype="float32"):
    return np.asarray(np.random.default_rng(0).standard_normal(shape), dtype=dtype)


def JI(*shape, dtype="int32"):
    return np.zeros(shape, dtype=dtype)


def jlogp(*shape):
    x = JT(*shape)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


JAX_GOOD = {
    "rms_norm": lambda: dict(x=JT(4, 8), scale=JT(8)),
    "layer_norm": lambda: dict(x=JT(4, 8), scale=JT(8), bias=JT(8)),
    "fused_add_rms_norm": lambda: dict(x=JT(4, 8), residual=JT(4, 8), scale=JT(8)),
    "rope": lambda: dict(q=JT(2, 7, 4, 8), k=JT(2, 7, 2, 8), cos=JT(7, 8), sin=JT(7, 8)),
    "swiglu": lambda: dict(a=JT(4, 8), b=JT(4, 8)),
    "geglu": lambda: dict(a=JT(4, 8), b=JT(4, 8)),
    "swiglu_linear": lambda: dict(a=JT(4, 8), b=JT(4, 8), kernel=JT(8, 5), bias=JT(5)),
    "geglu_linear": lambda: dict(a=JT(4, 8), b=JT(4, 8), kernel=JT(8, 5), bias=JT(5)),
    "cross_entropy": lambda: dict(logits=JT(4, 10), labels=JI(4)),
    "fused_linear_cross_entropy": lambda: dict(x=JT(4, 8), kernel=JT(8, 10), labels=JI(4)),
    "kl_div": lambda: dict(log_predictions=jlogp(2, 3), targets=np.exp(jlogp(2, 3))),
    "jsd": lambda: dict(student_logprobs=jlogp(2, 3), teacher_logprobs=jlogp(2, 3)),
    "fused_linear_jsd": lambda: dict(student_input=JT(4, 8), student_kernel=JT(8, 10), teacher_input=JT(4, 6),
                                     teacher_kernel=JT(6, 10)),
}


def jax_call(fn_name, **over):
    _, liger_jax = _jax()
    kwargs = JAX_GOOD[fn_name]()
    kwargs.update(over)
    return getattr(liger_jax, fn_name)(**kwargs)


def _jax_on_every_function(make_bad, x64=False):
    def case(fragment, error):
        from helpers import x64 as x64_context

        for fn_name, good in JAX_GOOD.items():
            first = next(iter(good()))
            with x64_context() if x64 else _nullcontext():
                with pytest.raises(error, match=re.escape(fragment)) as info:
                    jax_call(fn_name, **{first: make_bad(good()[first])})
            assert first in str(info.value), f"{fn_name}: the message does not name {first}: {info.value}"
    return case


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _jax_grad_wrt_cos():
    import jax

    args = JAX_GOOD["rope"]()
    _, liger_jax = _jax()
    cos = args.pop("cos")
    jax.grad(lambda c: liger_jax.rope(cos=c, **args)[0].sum())(cos)


def _jax_second_derivative(fragment, error):
    """Every function: the gradient of a sum of its first input's gradient (grad of grad)."""
    import jax

    _, liger_jax = _jax()
    for fn_name, good in JAX_GOOD.items():
        args = good()
        first = next(iter(args))
        x = args.pop(first)
        f = lambda v: _first_output(getattr(liger_jax, fn_name)(**{first: v}, **args)).sum()  # noqa: E731
        with pytest.raises(error, match=re.escape(fragment)):
            jax.grad(lambda v: (jax.grad(f)(v) ** 2).sum())(x)


def _jax_grad_wrt(fn_name, arg, **extra):
    """A case: ``jax.grad`` of the function's (first) output with respect to ``arg``, a constant of the op."""
    def case():
        import jax

        _, liger_jax = _jax()
        args = {**JAX_GOOD[fn_name](), **extra}
        value = args.pop(arg)
        jax.grad(lambda v: getattr(liger_jax, fn_name)(**{arg: v}, **args).sum())(value)
    return case


def _nnx(name, *args, call=None, **kwargs):
    def case():
        from flax import nnx

        import liger_jax.nnx as lnnx
        module = getattr(lnnx, name)(*args, rngs=nnx.Rngs(0), **kwargs)
        if call is not None:
            call(module)
    return case


JAX_CASES = {
    "all.not_an_array": _jax_on_every_function(lambda a: a.tolist()),
    "all.float64": _jax_on_every_function(lambda a: a.astype("float64"), x64=True),

    "rms_norm.x_scalar": ("rms_norm", lambda: dict(x=JT(), scale=None)),
    "rms_norm.x_empty": ("rms_norm", lambda: dict(x=JT(0, 8))),
    "rms_norm.x_int": ("rms_norm", lambda: dict(x=JI(4, 8))),
    "rms_norm.weight_shape": ("rms_norm", lambda: dict(scale=JT(7))),
    "rms_norm.weight_int": ("rms_norm", lambda: dict(scale=JI(8))),
    "rms_norm.casting_mode": ("rms_norm", lambda: dict(casting_mode="fp8")),
    "rms_norm.eps_negative": ("rms_norm", lambda: dict(epsilon=-1e-6)),
    "rms_norm.eps_nan": ("rms_norm", lambda: dict(epsilon=NAN)),
    "rms_norm.eps_none": ("rms_norm", lambda: dict(epsilon=None)),
    "rms_norm.offset_nan": ("rms_norm", lambda: dict(offset=NAN)),

    "layer_norm.x_scalar": ("layer_norm", lambda: dict(x=JT(), scale=None, bias=None)),
    "layer_norm.x_empty": ("layer_norm", lambda: dict(x=JT(0, 8))),
    "layer_norm.x_int": ("layer_norm", lambda: dict(x=JI(4, 8))),
    "layer_norm.weight_shape": ("layer_norm", lambda: dict(scale=JT(9))),
    "layer_norm.bias_shape": ("layer_norm", lambda: dict(bias=JT(1, 8))),
    "layer_norm.bias_int": ("layer_norm", lambda: dict(bias=JI(8))),
    "layer_norm.eps_negative": ("layer_norm", lambda: dict(epsilon=-1.0)),
    "layer_norm.eps_nan": ("layer_norm", lambda: dict(epsilon=INF)),

    "fused_add_rms_norm.x_int": ("fused_add_rms_norm", lambda: dict(x=JI(4, 8))),
    "fused_add_rms_norm.residual_shape": ("fused_add_rms_norm", lambda: dict(residual=JT(4, 1))),
    "fused_add_rms_norm.residual_int": ("fused_add_rms_norm", lambda: dict(residual=JI(4, 8))),
    "fused_add_rms_norm.weight_shape": ("fused_add_rms_norm", lambda: dict(scale=JT(4, 8))),
    "fused_add_rms_norm.casting_mode": ("fused_add_rms_norm", lambda: dict(casting_mode="Llama")),
    "fused_add_rms_norm.eps_negative": ("fused_add_rms_norm", lambda: dict(epsilon=-1.0)),
    "fused_add_rms_norm.offset_nan": ("fused_add_rms_norm", lambda: dict(offset=-INF)),

    "rope.q_not_4d": ("rope", lambda: dict(q=JT(7, 4, 8))),
    "rope.q_int": ("rope", lambda: dict(q=JI(2, 7, 4, 8))),
    "rope.k_empty": ("rope", lambda: dict(k=JT(2, 7, 0, 8))),
    "rope.k_batch": ("rope", lambda: dict(k=JT(3, 7, 2, 8))),
    "rope.k_seq": ("rope", lambda: dict(k=JT(2, 5, 2, 8))),
    "rope.k_head_dim": ("rope", lambda: dict(k=JT(2, 7, 2, 4))),
    "rope.head_dim_odd": ("rope", lambda: dict(q=JT(2, 7, 4, 7), k=JT(2, 7, 2, 7), cos=JT(7, 7), sin=JT(7, 7))),
    "rope.cos_rank": ("rope", lambda: dict(cos=JT(1, 1, 7, 8), sin=JT(1, 1, 7, 8))),
    "rope.cos_int": ("rope", lambda: dict(cos=JI(7, 8), sin=JI(7, 8))),
    "rope.sin_shape": ("rope", lambda: dict(sin=JT(1, 7, 8))),
    "rope.sin_dtype": ("rope", lambda: dict(sin=JT(7, 8, dtype="float16"))),
    "rope.cos_head_dim": ("rope", lambda: dict(cos=JT(7, 16), sin=JT(7, 16))),
    "rope.cos_batch": ("rope", lambda: dict(cos=JT(3, 7, 8), sin=JT(3, 7, 8))),
    "rope.cos_length": ("rope", lambda: dict(cos=JT(6, 8), sin=JT(6, 8))),
    "rope.position_ids_float": ("rope", lambda: dict(position_ids=JT(7))),
    "rope.position_ids_shape": ("rope", lambda: dict(position_ids=JI(3, 7))),
    "rope.cos_requires_grad": _jax_grad_wrt_cos,
    "all.second_derivative": _jax_second_derivative,
    "cross_entropy.weight_requires_grad": _jax_grad_wrt("cross_entropy", "weight", weight=JT(10) ** 2),
    "fused_linear_cross_entropy.ce_weight_requires_grad": _jax_grad_wrt("fused_linear_cross_entropy", "ce_weight",
                                                                         ce_weight=JT(10) ** 2),
    "kl_div.target_requires_grad": _jax_grad_wrt("kl_div", "targets"),
    "jsd.teacher_requires_grad": _jax_grad_wrt("jsd", "teacher_logprobs"),
    "fused_linear_jsd.teacher_requires_grad": _jax_grad_wrt("fused_linear_jsd", "teacher_kernel"),
    "rope.interleaved_type": ("rope", lambda: dict(interleaved="no")),

    "swiglu.a_scalar": ("swiglu", lambda: dict(a=JT(), b=JT())),
    "swiglu.a_empty": ("swiglu", lambda: dict(a=JT(0, 8), b=JT(0, 8))),
    "swiglu.a_int": ("swiglu", lambda: dict(a=JI(4, 8))),
    "swiglu.b_shape": ("swiglu", lambda: dict(b=JT(4, 1))),
    "swiglu.b_dtype": ("swiglu", lambda: dict(b=JT(4, 8, dtype="float16"))),
    "geglu.b_shape": ("geglu", lambda: dict(b=JT(8))),
    "geglu.approximate": ("geglu", lambda: dict(approximate=False)),
    "swiglu_linear.b_shape": ("swiglu_linear", lambda: dict(b=JT(4, 9))),
    "swiglu_linear.weight_shape": ("swiglu_linear", lambda: dict(kernel=JT(5, 8))),
    "swiglu_linear.weight_int": ("swiglu_linear", lambda: dict(kernel=JI(8, 5))),
    "swiglu_linear.bias_shape": ("swiglu_linear", lambda: dict(bias=JT(8))),
    "geglu_linear.approximate": ("geglu_linear", lambda: dict(approximate="erf")),

    "cross_entropy.logits_scalar": ("cross_entropy", lambda: dict(logits=JT(), labels=JI())),
    "cross_entropy.logits_empty": ("cross_entropy", lambda: dict(logits=JT(0, 10), labels=JI(0))),
    "cross_entropy.logits_int": ("cross_entropy", lambda: dict(logits=JI(4, 10))),
    "cross_entropy.target_shape": ("cross_entropy", lambda: dict(labels=JI(2, 2))),
    "cross_entropy.target_float": ("cross_entropy", lambda: dict(labels=JT(4))),
    "cross_entropy.target_out_of_range": ("cross_entropy", lambda: dict(labels=np.array([0, 3, 10, 1]))),
    "cross_entropy.weight_shape": ("cross_entropy", lambda: dict(weight=JT(11))),
    "cross_entropy.weight_int": ("cross_entropy", lambda: dict(weight=JI(10))),
    "cross_entropy.reduction": ("cross_entropy", lambda: dict(reduction="MEAN")),
    "cross_entropy.ignore_index_float": ("cross_entropy", lambda: dict(ignore_index=-100.0)),
    "cross_entropy.ignore_index_huge": ("cross_entropy", lambda: dict(ignore_index=-(2**63) - 1)),
    "cross_entropy.label_smoothing_range": ("cross_entropy", lambda: dict(label_smoothing=1.5)),
    "cross_entropy.label_smoothing_str": ("cross_entropy", lambda: dict(label_smoothing="0.1")),
    "cross_entropy.lse_square_scale_negative": ("cross_entropy", lambda: dict(lse_square_scale=-1.0)),
    "cross_entropy.lse_square_scale_nan": ("cross_entropy", lambda: dict(lse_square_scale=INF)),
    "cross_entropy.softcap_zero": ("cross_entropy", lambda: dict(softcap=-30.0)),
    "cross_entropy.softcap_inf": ("cross_entropy", lambda: dict(softcap=NAN)),
    "cross_entropy.return_z_loss_type": ("cross_entropy", lambda: dict(return_z_loss="no")),
    "cross_entropy.labels_beyond_int32": ("cross_entropy", lambda: dict(labels=np.array([0, 3, 2**32 + 1, 9]))),

    "fused_linear_cross_entropy.x_int": ("fused_linear_cross_entropy", lambda: dict(x=JI(4, 8))),
    "fused_linear_cross_entropy.x_empty": ("fused_linear_cross_entropy", lambda: dict(x=JT(0, 8), labels=JI(0))),
    "fused_linear_cross_entropy.weight_hidden": ("fused_linear_cross_entropy", lambda: dict(kernel=JT(10, 8))),
    "fused_linear_cross_entropy.weight_transposed": ("fused_linear_cross_entropy",
                                                     lambda: dict(kernel=JT(8, 10), transpose=True)),
    "fused_linear_cross_entropy.weight_dtype": ("fused_linear_cross_entropy",
                                                lambda: dict(kernel=JT(8, 10, dtype="float16"))),
    "fused_linear_cross_entropy.bias_shape": ("fused_linear_cross_entropy", lambda: dict(bias=JT(8))),
    "fused_linear_cross_entropy.bias_dtype": ("fused_linear_cross_entropy",
                                              lambda: dict(bias=JT(10, dtype="float16"))),
    "fused_linear_cross_entropy.target_shape": ("fused_linear_cross_entropy", lambda: dict(labels=JI(5))),
    "fused_linear_cross_entropy.target_float": ("fused_linear_cross_entropy", lambda: dict(labels=JT(4))),
    "fused_linear_cross_entropy.target_out_of_range": ("fused_linear_cross_entropy",
                                                       lambda: dict(labels=np.array([0, -1, 2, 3]))),
    "fused_linear_cross_entropy.ce_weight_shape": ("fused_linear_cross_entropy", lambda: dict(ce_weight=JT(1))),
    "fused_linear_cross_entropy.chunk_size": ("fused_linear_cross_entropy", lambda: dict(chunk_size=-4)),
    "fused_linear_cross_entropy.chunk_size_type": ("fused_linear_cross_entropy", lambda: dict(chunk_size=True)),
    "fused_linear_cross_entropy.accum_dtype_fp32_type": ("fused_linear_cross_entropy",
                                                         lambda: dict(accum_dtype_fp32="yes")),
    "fused_linear_cross_entropy.weight_empty": ("fused_linear_cross_entropy", lambda: dict(kernel=JT(8, 0))),
    "fused_linear_cross_entropy.dtype": ("fused_linear_cross_entropy", lambda: dict(dtype="int32")),
    "fused_linear_cross_entropy.reduction": ("fused_linear_cross_entropy", lambda: dict(reduction=None)),
    "fused_linear_cross_entropy.softcap_nan": ("fused_linear_cross_entropy", lambda: dict(softcap=NAN)),

    "kl_div.reduction": ("kl_div", lambda: dict(reduction="average")),
    "kl_div.input_empty": ("kl_div", lambda: dict(log_predictions=JT(2, 0), targets=JT(2, 0))),
    "kl_div.input_int": ("kl_div", lambda: dict(log_predictions=JI(2, 3))),
    "kl_div.target_shape": ("kl_div", lambda: dict(targets=JT(2, 1))),
    "kl_div.target_int": ("kl_div", lambda: dict(targets=JI(2, 3))),
    "kl_div.log_target_type": ("kl_div", lambda: dict(log_target="False")),

    "jsd.student_empty": ("jsd", lambda: dict(student_logprobs=JT(0, 3), teacher_logprobs=JT(0, 3))),
    "jsd.student_int": ("jsd", lambda: dict(student_logprobs=JI(2, 3))),
    "jsd.teacher_shape": ("jsd", lambda: dict(teacher_logprobs=JT(3, 3))),
    "jsd.teacher_int": ("jsd", lambda: dict(teacher_logprobs=JI(2, 3))),
    "jsd.labels_shape": ("jsd", lambda: dict(labels=JI(2, 3))),
    "jsd.labels_float": ("jsd", lambda: dict(labels=JT(2))),
    "jsd.beta_range": ("jsd", lambda: dict(beta=1.01)),
    "jsd.beta_str": ("jsd", lambda: dict(beta="0.5")),
    "jsd.ignore_index_float": ("jsd", lambda: dict(ignore_index=None)),

    "fused_linear_jsd.student_hidden": ("fused_linear_jsd", lambda: dict(student_kernel=JT(7, 10))),
    "fused_linear_jsd.teacher_hidden": ("fused_linear_jsd", lambda: dict(teacher_kernel=JT(8, 10))),
    "fused_linear_jsd.vocab": ("fused_linear_jsd", lambda: dict(teacher_kernel=JT(6, 11))),
    "fused_linear_jsd.teacher_rows": ("fused_linear_jsd", lambda: dict(teacher_input=JT(2, 2, 6))),
    "fused_linear_jsd.teacher_dtype": ("fused_linear_jsd", lambda: dict(teacher_kernel=JT(6, 10, dtype="float16"))),
    "fused_linear_jsd.labels_shape": ("fused_linear_jsd", lambda: dict(labels=JI(4, 1))),
    "fused_linear_jsd.temperature_zero": ("fused_linear_jsd", lambda: dict(temperature=-2.0)),
    "fused_linear_jsd.temperature_nan": ("fused_linear_jsd", lambda: dict(temperature=NAN)),
    "fused_linear_jsd.beta_range": ("fused_linear_jsd", lambda: dict(beta=3)),
    "fused_linear_jsd.chunk_size": ("fused_linear_jsd", lambda: dict(chunk_size=-1)),
    "fused_linear_jsd.chunk_size_type": ("fused_linear_jsd", lambda: dict(chunk_size=True)),

    "modules.nnx_rms_norm_axes": _nnx("RMSNorm", 8, reduction_axes=0),
    "modules.nnx_rms_norm_axis_name": _nnx("RMSNorm", 8, axis_name="batch"),
    "modules.nnx_layer_norm_mask": _nnx("LayerNorm", 8, call=lambda m: m(JT(4, 8), mask=np.ones((4, 8), bool))),
    "modules.nnx_geglu_approximate": _nnx("GeGLUMLP", 8, 16, approximate="exact"),
    "modules.rms_norm_hidden_size": _nnx("RMSNorm", 0),
    "modules.rms_norm_eps": _nnx("RMSNorm", 8, epsilon=-1e-6),
    "modules.layer_norm_hidden_size": _nnx("LayerNorm", -1),
    "modules.layer_norm_eps": _nnx("LayerNorm", 8, epsilon=-1.0),
}


# ------------------------------------------------------------------------------------------------------ tests
def test_every_documented_row_has_a_case():
    for frontend, cases in (("torch", TORCH_CASES), ("jax", JAX_CASES)):
        documented = {row for row, spec in ROWS.items() if spec[frontend] is not None}
        assert not documented - set(cases), f"{frontend}: documented rows without a test: {sorted(documented - set(cases))}"
        assert not set(cases) - documented, (f"{frontend}: tested conditions missing from docs/errors.md (or marked "
                                             f"'—' there): {sorted(set(cases) - documented)}")
    assert all(spec["torch"] or spec["jax"] for spec in ROWS.values())


AFTER_A_GRADIENT = {"all.second_derivative"}


@pytest.fixture
def no_launch(monkeypatch, request):
    """Any kernel launch fails the test: every error must come before the first launch. The exceptions are the
    torch frontend's target checks: a kernel that only reads the targets and counts the invalid ones into a
    fresh buffer (liger_core.cross_entropy.denominators_launch), and, for a bad target value, the loss's own
    kernels, queued before the host reads that count (they read an invalid target as no class: a NaN row; the
    synchronize below catches any asynchronous error they would leave); and a second derivative, which by its
    nature comes after a forward and a first backward (rows in AFTER_A_GRADIENT)."""
    launch_for_real = liger_torch._launch._launch
    row = request.node.callspec.params.get("row", "")
    target_values = row.endswith(".target_out_of_range")
    if row in AFTER_A_GRADIENT:
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched before the error was raised")

    def refuse_but_the_target_check(launch, *args, **kwargs):
        if launch.kernel is liger_core.cross_entropy._denominators_kernel or target_values:
            return launch_for_real(launch, *args, **kwargs)
        return refuse()

    monkeypatch.setattr(liger_torch._launch, "_launch", refuse_but_the_target_check)
    if ON_GPU:
        import liger_jax._launch

        monkeypatch.setattr(liger_jax._launch, "_run_triton_call", refuse)
    yield
    if ON_GPU:
        torch.cuda.synchronize()  # a bad input must not leave an asynchronous CUDA error behind either


def _run_case(case, args, fragment, error):
    if isinstance(case, tuple):
        fn_name, over = case
        call = (lambda: torch_call(fn_name, args[0], **over(args[0]))) if args else (
            lambda: jax_call(fn_name, **over()))
    elif case.__code__.co_argcount == len(args):  # a plain call
        call = lambda: case(*args)  # noqa: E731
    else:  # a case that checks by itself (several functions, or only in one mode)
        case(*args, fragment, error)
        return
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value), f"message {str(info.value)!r} lacks {fragment!r}"


@pytest.mark.parametrize("row", sorted(r for r, spec in ROWS.items() if spec["torch"]))
def test_torch_bad_input_raises_the_documented_error(row, device, no_launch):
    error, fragment = ROWS[row]["torch"]
    _run_case(TORCH_CASES[row], (device,), fragment, error)


@pytest.mark.parametrize("row", sorted(r for r, spec in ROWS.items() if spec["jax"]))
def test_jax_bad_input_raises_the_documented_error(row, no_launch):
    error, fragment = ROWS[row]["jax"]
    _run_case(JAX_CASES[row], (), fragment, error)


def test_torch_scalar_options_accept_numpy_scalars(device):
    """numpy scalars are numbers: they pass the checks (and reach the kernels as Python scalars)."""
    x, t = T(device, 4, 10), torch.tensor([1, 2, -100, 9], device=device)
    want = liger_torch.cross_entropy(x, t, label_smoothing=0.1)
    got = liger_torch.cross_entropy(x, t, ignore_index=np.int64(-100), label_smoothing=np.float32(0.1))
    assert torch.equal(got, want)


def test_good_inputs_work_after_every_bad_one(device):
    """The process (and the GPU) are fine after all the bad inputs: every function then computes a finite result."""
    for row, case in TORCH_CASES.items():
        if isinstance(case, tuple):
            with pytest.raises(ROWS[row]["torch"][0]):
                torch_call(case[0], device, **case[1](device))
    for fn_name in TORCH_GOOD:
        out = torch_call(fn_name, device)
        for t in (out if isinstance(out, tuple) else (out,)):
            assert torch.isfinite(t).all(), fn_name
    if ON_GPU:
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------- policies instead of errors
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fn", ["cross_entropy", "fused_linear_cross_entropy"])
def test_jax_out_of_range_label_under_jit_is_nan_not_a_crash(fn):
    """Traced labels cannot be checked eagerly: a bad label's row is NaN (loss and gradient), the other rows are
    untouched, and nothing reads outside the logits (the kernel clamps the index before its load)."""
    import jax

    args = JAX_GOOD[fn]()
    first = next(iter(args))
    labels = np.array([1, 2**30, 3, -7], dtype=np.int32)  # far outside the 10 classes, both ways
    del args["labels"]

    def loss(x, lab, reduction):
        return jax_call(fn, **{first: x, "labels": lab, "reduction": reduction})

    rows = jax.jit(lambda x, lab: loss(x, lab, "none"))(args[first], labels)
    rows = np.asarray(rows)
    assert np.isnan(rows[[1, 3]]).all() and np.isfinite(rows[[0, 2]]).all()
    grad = np.asarray(jax.jit(jax.grad(lambda x, lab: loss(x, lab, "sum")))(args[first], labels))
    # d loss / d logits is row-wise, and so is x's gradient (dlogits @ W): only the bad rows are NaN
    assert np.isnan(grad[[1, 3]]).all() and np.isfinite(grad[[0, 2]]).all()
    assert math.isnan(float(jax.jit(lambda x, lab: loss(x, lab, "mean"))(args[first], labels)))


# ---------------------------------------------------------------------------------------------- known gaps
_POSITIONS_SCRIPT = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    frontend = sys.argv[1]
    import numpy as np
    position_ids = np.array([0, 1, 2, 3, 4, 5, 10**6])  # 7 tokens, cos/sin have 7 rows
    try:
        if frontend == "torch":
            import torch, liger_torch
            d = "cpu" if liger_torch.INTERPRET else "cuda"
            q, k = torch.randn(2, 4, 7, 8, device=d), torch.randn(2, 2, 7, 8, device=d)
            cos, sin = torch.randn(7, 8, device=d), torch.randn(7, 8, device=d)
            out = liger_torch.rope(q, k, cos, sin, torch.from_numpy(position_ids).to(d))
            float(out[0].sum())
        else:
            import liger_jax
            r = np.random.default_rng(0)
            out = liger_jax.rope(r.standard_normal((2, 7, 4, 8)), r.standard_normal((2, 7, 2, 8)),
                                 r.standard_normal((7, 8)), r.standard_normal((7, 8)), position_ids=position_ids)
            float(out[0].sum())
    except ValueError as err:
        print("RAISED:", err)
        sys.exit(0)
    print("NO ERROR")
    sys.exit(3)
""")


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_out_of_range_position_ids_raise(frontend):
    """Run in a subprocess: today the bad read kills the process, which must not take pytest with it."""
    proc = subprocess.run([sys.executable, "-c", _POSITIONS_SCRIPT, frontend], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-2000:]}"
    assert "RAISED: position_ids has values outside [0, 7)" in proc.stdout, proc.stdout
