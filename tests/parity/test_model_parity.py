"""Model-level parity: HF's torch model (unpatched, and patched with liger_torch) vs the Flax model (with and
without the liger_jax kernels) on the same weights and the same token batch.

Each family is a tiny fp32 model with random weights from a fixed torch seed (norm weights perturbed, so a wrong
norm mapping or gradient shows), eager HF attention, a batch with masked labels and (gemma) padding tokens.
Compared elementwise against helpers.assert_close's fp32 bound, unwidened: |ours - ref| <= 1e-5 + 1e-5 |ref|
for the logits (HF: eval forward without labels), for the loss, and for the gradient of every parameter (worst
seen on these shapes, CPU: logits 2.0%, loss 1.5%, parameter gradients 1.8% of that bound).

Families: llama (untied, GQA), qwen3 (q/k norm, tied head), gemma (offset norm in fp32, GeGLU tanh, scaled
embeddings, tied head, padding_idx), mistral (sliding window shorter than the sequence), qwen2 (q/k/v biases).
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import liger_core
from helpers import assert_close

from liger_jax.models import from_hf
from liger_torch.transformers import apply_liger_kernel, patched_families

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, inside Triton's interpreter

F32 = torch.float32
TINY = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True)),
    "gemma": (transformers.GemmaConfig, dict(pad_token_id=0)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=4)),
    "qwen2": (transformers.Qwen2Config, {}),
}
B, T = 2, 11


def _hf_model(family, device):
    config_cls, overrides = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **overrides}),
                                                          attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms start at ones (gemma: zeros) and biases at zeros: perturb them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.to(device)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (B, T), generator=g)
    ids[0, 6] = ids[1, 2] = 0  # gemma's pad_token_id: the embedding row gets no gradient from these
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    labels[1, 5] = -100
    return ids, labels


def _torch_run(model, ids, labels):
    """(eval logits, loss, {param name: grad}) as numpy (patched models return no logits with labels)."""
    device = next(model.parameters()).device
    ids, labels = ids.to(device), labels.to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().cpu().numpy() for n, p in model.named_parameters()}
    return logits.cpu().numpy(), out.loss.item(), grads


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_refs(request):
    """The family's HF model and its results unpatched and patched (instance patching: modules untouched)."""
    device = "cpu" if liger_core.INTERPRET else "cuda"
    family = request.param
    hf = _hf_model(family, device)
    ids, labels = _batch()
    refs = {"hf": _torch_run(hf, ids, labels)}
    patched = apply_liger_kernel(copy.deepcopy(hf))
    assert any("_liger_base" in type(m).__dict__ for m in patched.modules()), "nothing was patched"
    assert patched_families() == []
    refs["hf+liger"] = _torch_run(patched, ids, labels)
    return family, hf.cpu(), ids, labels, refs


def _flax_run(model, ids, labels):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):  # one trace for both: the logits from the same hidden states as the loss
        m = nnx.merge(graphdef, p, rest)
        h = m.model(ids)
        return m.loss_from_hidden(h, labels), m.logits(h)

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, value, nnx.merge(graphdef, grads, rest)


def _flax_grad(grads, hf_name):
    """The Flax gradient of an HF parameter, in HF's layout (Linear: (out, in))."""
    *path, leaf = hf_name.split(".")
    module = grads
    for part in path:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    if isinstance(module, nnx.Linear):
        return np.asarray(getattr(module, "kernel" if leaf == "weight" else "bias")[...]).T
    if isinstance(module, nnx.Embed):
        return np.asarray(module.embedding[...])
    return np.asarray(getattr(module, "bias" if leaf == "bias" else "scale")[...])


@pytest.mark.parametrize("use_kernels", [False, True], ids=["xla", "kernels"])
def test_flax_matches_hf_unpatched_and_patched(family_refs, use_kernels):
    family, hf, ids, labels, refs = family_refs
    model = from_hf(hf, use_kernels=use_kernels)
    logits, loss, grads = _flax_run(model, jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy()))
    for ref_name, (ref_logits, ref_loss, ref_grads) in refs.items():
        name = f"{family} flax({'kernels' if use_kernels else 'xla'}) vs {ref_name}"
        assert_close(logits, ref_logits, F32, f"{name}: logits")
        assert_close(loss, ref_loss, F32, f"{name}: loss")
        tied = model.config.tie_word_embeddings
        expected = set(ref_grads) - ({"lm_head.weight"} if tied else set())
        assert len(expected) == len(jax.tree.leaves(nnx.state(grads, nnx.Param))), f"{name}: parameter count"
        for param in sorted(expected):
            assert_close(_flax_grad(grads, param), ref_grads[param], F32, f"{name}: grad {param}")


# ---------------------------------------------------------------------------------------------------------
# python -m liger_jax.parity


def test_parity_command_lists_every_layer_with_small_differences(capsys):
    from liger_jax import parity

    rows = parity.main(["qwen3", "--layers", "3", "--seq", "8"])
    table = capsys.readouterr().out
    names = {(r.section, r.name) for r in rows}
    activations = ["embeddings", "layers.0", "layers.1", "layers.2", "norm"]
    assert {("forward", n) for n in activations + ["logits", "loss"]} <= names
    assert {("backward", n) for n in activations} <= names
    hf_params = {n for n, _ in parity.build_hf("qwen3", layers=3).named_parameters()}
    assert {n for s, n in names if s == "params"} == hf_params
    for row in rows:  # fp32 on both sides, kernels on the Flax side: rounding-level differences only
        assert row.rel < 1e-5, f"{row.section} {row.name}: rel {row.rel:.2e}"
        assert row.ref_max > 0, f"{row.section} {row.name}: the torch side is all zeros"
    for name in activations + sorted(hf_params):
        assert f"\n{name} " in table
    assert "no divergence above" in table


def test_parity_names_the_layer_where_a_perturbed_weight_diverges():
    from liger_jax import parity

    hf = parity.build_hf("llama", layers=3)
    model = from_hf(hf, use_kernels=False)
    down = model.model.layers[1].mlp.down_proj.kernel
    down[...] = down[...] * 1.05  # a 5% error in one weight of layer 1
    ids, labels = parity.make_batch(hf.config.vocab_size, 2, 8)
    rows = parity.compare(hf, model, ids, labels)
    forward = {r.name: r for r in rows if r.section == "forward"}
    assert forward["embeddings"].rel < 1e-6 and forward["layers.0"].rel < 1e-5
    assert forward["layers.1"].rel > 1e-3
    assert parity.first_divergence(rows, 1e-4)["forward"].name == "layers.1"
    params = {r.name: r for r in rows if r.section == "params"}
    assert params["model.layers.2.mlp.down_proj.weight"].rel > 1e-4  # downstream of the error: its input moved
    assert "first divergence (forward): layers.1" in parity.format_table(rows, 1e-4)


def test_parity_command_on_a_folder_with_patched_torch(tmp_path, capsys):
    """A saved HF folder (gemma), cut to its first layer, against the liger_torch-patched torch model."""
    from liger_jax import parity

    parity.build_hf("gemma", layers=2, seed=3).save_pretrained(tmp_path)
    rows = parity.main([str(tmp_path), "--layers", "1", "--torch-kernels", "--use-kernels", "none", "--seq", "8"])
    assert "HF eager + liger_torch kernels" in capsys.readouterr().out
    assert [r.name for r in rows if r.section == "forward"] == ["embeddings", "layers.0", "norm", "logits", "loss"]
    assert not any(".layers.1." in r.name for r in rows)
    for row in rows:
        assert row.rel < 1e-5, f"{row.section} {row.name}: rel {row.rel:.2e}"
