"""Train a Llama-family Flax model with AdamW, data-parallel over all local devices.

    python examples/flax_train.py                              # tiny llama, kernels on, 20 steps
    python examples/flax_train.py --compare                    # with and without kernels: per-step losses
    python examples/flax_train.py --model-type gemma --fsdp --dtype bfloat16 --remat
    python examples/flax_train.py --hf path/to/hf-folder --seq 512 --batch 8 --steps 50

The data is synthetic and learnable, as in scripts/demo.py: a fixed cycle of four random batches (the first
tokens of row 0 are a masked prompt), so the loss falls as the model memorises them. ``--hf`` starts from a local
Hugging Face checkpoint (config.json + *.safetensors); otherwise a random model of ``--model-type`` with the
``--size`` preset. The batch is split over the mesh axis "data"; ``--fsdp`` also splits parameters and optimizer
state.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from liger_jax.models import LlamaForCausalLM, config_from_hf, from_hf
from liger_jax.models.train import Trainer, make_mesh

SIZES = {  # hidden, intermediate, layers, heads, kv heads, head_dim, vocab
    "tiny": (64, 128, 2, 4, 2, 16, 257),
    "small": (512, 1408, 8, 8, 4, 64, 32000),
    "1b": (2048, 8192, 16, 32, 8, 64, 128256),  # Llama-3.2-1B's shape
}


def build(args, use_kernels):
    dtype = jnp.dtype(args.dtype)
    if args.hf:
        return from_hf(args.hf, use_kernels=use_kernels, dtype=dtype, remat=args.remat)
    hidden, inter, layers, heads, kv, head_dim, vocab = SIZES[args.size]
    hf_config = dict(model_type=args.model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     head_dim=head_dim, max_position_embeddings=max(2048, args.seq))
    config = config_from_hf(hf_config)
    return LlamaForCausalLM(config, use_kernels=use_kernels, dtype=dtype, remat=args.remat,
                            rngs=nnx.Rngs(args.seed))


def batches(vocab, batch, seq, steps, seed):
    """A cycle of four fixed random batches, the same for every run with the same seed."""
    rng = np.random.default_rng(seed)
    cycle = []
    for _ in range(4):
        ids = rng.integers(0, vocab, (batch, seq))
        labels = ids.copy()
        labels[0, : seq // 4] = -100  # a masked prompt: not scored
        cycle.append({"input_ids": ids, "labels": labels})
    for step in range(steps):
        yield cycle[step % 4]


def train(args, use_kernels):
    model = build(args, use_kernels)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(args.lr, weight_decay=0.01,
                                        mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)))
    trainer = Trainer(model, optimizer, mesh=make_mesh(), fsdp=args.fsdp)
    losses, start = [], None
    for step, batch in enumerate(batches(model.config.vocab_size, args.batch, args.seq, args.steps, args.seed)):
        loss = float(trainer.step(batch))
        if step == 0:
            start = time.perf_counter()  # step 0 includes compilation
        losses.append(loss)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"  step {step:4d}  loss {loss:.4f}")
    elapsed = time.perf_counter() - start if args.steps > 1 else float("nan")
    tokens = args.batch * args.seq * (args.steps - 1)
    print(f"  {tokens / elapsed:,.0f} tokens/s after compilation ({len(jax.local_devices())} devices)")
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf", help="a local HF folder to start from (config.json + *.safetensors)")
    parser.add_argument("--model-type", default="llama", help="llama, mistral, qwen2, qwen3 or gemma")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: 2 per device)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", default="float32", help="compute dtype (parameters stay fp32)")
    parser.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state too")
    parser.add_argument("--remat", action="store_true", help="rematerialise each decoder layer")
    parser.add_argument("--no-kernels", action="store_true", help="the pure-XLA model")
    parser.add_argument("--compare", action="store_true", help="train with and without kernels, compare losses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()
    args.batch = args.batch or 2 * len(jax.local_devices())

    runs = [False, True] if args.compare else [not args.no_kernels]
    losses = {}
    for use_kernels in runs:
        print(f"{'liger_jax kernels' if use_kernels else 'pure XLA'}:")
        losses[use_kernels] = train(args, use_kernels)
    if args.compare:
        diff = np.abs(np.array(losses[True]) - np.array(losses[False]))
        print(f"largest per-step loss difference, kernels vs XLA: {diff.max():.3g} (step {int(diff.argmax())})")


if __name__ == "__main__":
    main()
