"""Where do Hugging Face's torch model and the Flax model diverge? A per-layer table of differences.

    python -m liger_jax.parity <hf-folder-or-model_type> [--layers N] [--use-kernels all|none|rms_norm,rope,...]
                               [--torch-kernels] [--seq N] [--batch N] [--seed N] [--threshold REL]

``<hf-folder>``: a local folder with ``config.json`` and ``*.safetensors`` (loaded in fp32; ``--layers N`` keeps
only its first N decoder layers). ``<model_type>`` (llama, mistral, qwen2, qwen3, gemma): a tiny random model
(hidden 64, 4 heads, 2 KV heads, vocab 257; its norm weights perturbed so their gradients are not degenerate).
The Flax model gets the same weights (:func:`liger_jax.models.from_hf`); both run the same token batch forward
and backward through the mean next-token loss. ``--torch-kernels`` patches the torch model with liger_torch.

Rows, in this order: forward activations (embeddings, each decoder layer's output, the final norm, logits,
loss); backward: the loss's gradient with respect to each of those activations, from the top down; the gradient
of every parameter. Each row has ``diff = max |flax - torch|`` and ``rel = diff / max |torch|`` (normwise: an
elementwise ratio explodes where values cross zero); rows with ``rel`` above ``--threshold`` are marked, and
the first marked row of each section is named at the end: that is where to look.

Everything runs in fp32, matmuls at full fp32 precision on both sides (no TF32).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

TINY = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512)
MARK = "<<"


@dataclasses.dataclass
class Row:
    section: str  # "forward", "backward" or "params"
    name: str
    shape: tuple
    ref_max: float  # max |torch|
    diff: float  # max |flax - torch|

    @property
    def rel(self) -> float:
        if self.ref_max == 0:
            return 0.0 if self.diff == 0 else float("inf")
        return self.diff / self.ref_max


def _row(section, name, ours, ref) -> Row:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        raise ValueError(f"{name}: flax shape {ours.shape} != torch shape {ref.shape}")
    return Row(section, name, ref.shape, float(np.max(np.abs(ref), initial=0.0)),
               float(np.max(np.abs(ours - ref), initial=0.0)))


# ---------------------------------------------------------------------------------------------------------
# the two sides


def build_hf(model: str, *, layers: int | None = None, seed: int = 0):
    """The HF torch causal LM in fp32 with eager attention: a local folder, or a tiny random ``model_type``."""
    import torch
    import transformers

    if os.path.isdir(model):
        config = transformers.AutoConfig.from_pretrained(model)
        if layers is not None:
            config.num_hidden_layers = layers
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, config=config, attn_implementation="eager")
        return hf.float().eval()
    from .models.hf import SUPPORTED

    if model not in SUPPORTED:
        raise SystemExit(f"liger_jax.parity: {model!r} is neither a folder nor a model_type of {SUPPORTED}")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model, num_hidden_layers=2 if layers is None else layers, **TINY)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms start at ones (gemma: zeros): perturb them so their gradients say something
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


def make_batch(vocab_size: int, batch: int, seq: int, seed: int = 0):
    """Random token ids (B, T) and labels (the ids, the first two of row 0 ignored: a masked prompt)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (batch, seq))
    labels = ids.copy()
    labels[0, :2] = -100
    return ids, labels


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def torch_side(hf, ids, labels) -> dict:
    """Activations, their gradients, logits, loss and parameter gradients of the torch model (numpy, fp32)."""
    import torch

    device = next(hf.parameters()).device
    ids_t, labels_t = torch.as_tensor(ids, device=device), torch.as_tensor(labels, device=device)
    with torch.no_grad():  # patched models return no logits when given labels: a separate eval forward
        logits = hf(input_ids=ids_t).logits.float().cpu().numpy()

    base = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.model
    acts, grads, hooks = {}, {}, []

    def keep(name, tensor):
        acts[name] = tensor
        if tensor.requires_grad:  # a copy: liger_torch's RMSNorm backward writes its dx over the incoming dy
            tensor.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))

    def embeddings_hook(module, args, kwargs):
        keep("embeddings", args[0] if args else kwargs["hidden_states"])

    hooks.append(base.layers[0].register_forward_pre_hook(embeddings_hook, with_kwargs=True))
    for i, layer in enumerate(base.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: keep(f"layers.{i}", _first(out))))
    hooks.append(base.norm.register_forward_hook(lambda m, a, out: keep("norm", _first(out))))
    try:
        hf.zero_grad(set_to_none=True)
        out = hf(input_ids=ids_t, labels=labels_t)
        out.loss.backward()
    finally:
        for hook in hooks:
            hook.remove()

    def np32(t):
        return t.detach().float().cpu().numpy()

    return {"acts": {k: np32(v) for k, v in acts.items()}, "act_grads": {k: np32(v) for k, v in grads.items()},
            "logits": logits, "loss": out.loss.item(),
            "param_grads": {n: np32(p.grad) for n, p in hf.named_parameters() if p.grad is not None}}


def flax_side(model, ids, labels) -> dict:
    """The same quantities for the Flax model: one jitted forward + backward; activation gradients through zero
    ``taps`` added at each activation."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from .models.hf import state_dict_from_flax
    from .models.llama import tap_names

    names = tap_names(model.config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids, labels = jnp.asarray(ids), jnp.asarray(labels)
    width = (ids.shape[0], ids.shape[1], model.config.hidden_size)
    dtype = model.model.dtype or jnp.float32
    taps = [jnp.zeros(width, dtype) for _ in names]

    def loss(p, t):
        m = nnx.merge(graphdef, p, rest)
        h, hidden = m.model(ids, output_hidden_states=True, taps=t)
        return m.loss_from_hidden(h, labels), (hidden, m.logits(h))

    with jax.default_matmul_precision("highest"):
        (value, (hidden, logits)), (param_grads, tap_grads) = jax.jit(
            jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, taps)

    def np32(a):
        return np.asarray(a.astype(jnp.float32))

    return {"acts": dict(zip(names, map(np32, hidden))), "act_grads": dict(zip(names, map(np32, tap_grads))),
            "logits": np32(logits), "loss": float(value),
            "param_grads": state_dict_from_flax(nnx.merge(graphdef, param_grads, rest))}


def compare(hf, flax_model, ids, labels) -> list[Row]:
    """The rows of the table for one batch (see the module docstring)."""
    from .models.llama import tap_names

    ref, ours = torch_side(hf, ids, labels), flax_side(flax_model, ids, labels)
    names = tap_names(flax_model.config)
    missing = [n for n in names if n not in ref["acts"]]
    if missing:
        raise RuntimeError(f"the torch model's hooks did not see {missing}")
    rows = [_row("forward", n, ours["acts"][n], ref["acts"][n]) for n in names]
    rows.append(_row("forward", "logits", ours["logits"], ref["logits"]))
    rows.append(_row("forward", "loss", ours["loss"], ref["loss"]))
    rows += [_row("backward", n, ours["act_grads"][n], ref["act_grads"][n]) for n in reversed(names)
             if n in ref["act_grads"]]
    only = set(ref["param_grads"]) ^ set(ours["param_grads"])
    if only:
        raise RuntimeError(f"parameters on one side only: {sorted(only)}")
    rows += [_row("params", n, ours["param_grads"][n], g) for n, g in ref["param_grads"].items()]
    return rows


# ---------------------------------------------------------------------------------------------------------
# the table

TITLES = {"forward": "forward: activations",
          "backward": "backward: gradient of the loss w.r.t. each activation (top down)",
          "params": "parameter gradients"}


def first_divergence(rows: list[Row], threshold: float) -> dict:
    """{section: the first row whose rel exceeds threshold} (sections without one are left out)."""
    out = {}
    for row in rows:
        if row.rel > threshold and row.section not in out:
            out[row.section] = row
    return out


def format_table(rows: list[Row], threshold: float, header: str = "") -> str:
    width = max(len(r.name) for r in rows) + 2
    lines = [header] if header else []
    lines.append(f"diff = max |flax - torch|, rel = diff / max |torch|; {MARK}: rel > {threshold:g}")
    for section, title in TITLES.items():
        lines += ["", title, f"{'':{width}}{'shape':>16}  {'max |torch|':>11}  {'diff':>9}  {'rel':>9}"]
        for r in (r for r in rows if r.section == section):
            mark = f"  {MARK}" if r.rel > threshold else ""
            lines.append(f"{r.name:{width}}{str(r.shape):>16}  {r.ref_max:11.4g}  {r.diff:9.2e}  {r.rel:9.2e}{mark}")
    first = first_divergence(rows, threshold)
    lines.append("")
    if not first:
        lines.append(f"no divergence above rel {threshold:g}")
    for section, row in first.items():
        lines.append(f"first divergence ({section}): {row.name} (rel {row.rel:.2e})")
    return "\n".join(lines)


def _kernels(spec: str):
    from .models.llama import Kernels

    if spec in ("all", "none"):
        return spec == "all"
    names = [s.strip() for s in spec.split(",") if s.strip()]
    return Kernels.of(dict.fromkeys(names, True))


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m liger_jax.parity", description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a local HF folder (config.json + *.safetensors) or a model_type")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the folder's; 2)")
    parser.add_argument("--use-kernels", default="all",
                        help="liger_jax kernels of the Flax model: all, none or a comma list of "
                             "rms_norm,rope,swiglu,geglu,loss (default: all)")
    parser.add_argument("--torch-kernels", action="store_true", help="patch the torch model with liger_torch")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=1e-4, help="rel above which a row is marked")
    args = parser.parse_args(argv)
    if args.seq < 1 or args.batch < 1:
        parser.error("--seq and --batch must be positive")

    import liger_core
    from .models import from_hf

    use_kernels = _kernels(args.use_kernels)
    hf = build_hf(args.model, layers=args.layers, seed=args.seed)
    flax_model = from_hf(hf, use_kernels=use_kernels)  # before patching: the same weights either way
    if not liger_core.INTERPRET:
        hf = hf.cuda()
    if args.torch_kernels:
        from liger_torch.transformers import apply_liger_kernel

        hf = apply_liger_kernel(hf)
    ids, labels = make_batch(hf.config.vocab_size, args.batch, args.seq, args.seed)
    rows = compare(hf, flax_model, ids, labels)
    kernels = flax_model.kernels
    on = [f.name for f in dataclasses.fields(kernels) if getattr(kernels, f.name)]
    header = (f"liger_jax.parity: {args.model} ({hf.config.model_type}, {hf.config.num_hidden_layers} layers), "
              f"batch {args.batch} x {args.seq}, fp32\n"
              f"torch: HF eager{' + liger_torch kernels' if args.torch_kernels else ''} | "
              f"flax: kernels {', '.join(on) or 'none'}")
    print(format_table(rows, args.threshold, header))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
