"""scripts/profile_kernels.py's HLO listing (the evidence behind "XLA fuses the forward with the backward's row
sums" in docs/perf-log.md): with ``fusions`` it lists each fusion of the program's entry computation with its
operands, and only those of the entry computation."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import profile_kernels  # noqa: E402


class _Run:
    def __init__(self, compiled):
        self.compiled = compiled


def _rms_norm_fwd_bwd_program(n, h):
    import jax
    import jax.numpy as jnp

    def rms_norm(x, w):
        xf = x.astype(jnp.float32)
        return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)

    def program(x, w, dy):
        y, pullback = jax.vjp(rms_norm, x, w)
        return pullback(dy), y

    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    args = (jax.random.normal(k1, (n, h), jnp.bfloat16), jax.random.uniform(k2, (h,), jnp.bfloat16) + 0.5,
            jax.random.normal(k3, (n, h), jnp.bfloat16))
    return jax.jit(program).lower(*args).compile()


def test_fusions_are_listed_with_their_operands_only_when_asked(capsys):
    compiled = _rms_norm_fwd_bwd_program(7, 123)
    profile_kernels.hlo_summary(_Run(compiled), fusions=False)
    assert "fusion(" not in capsys.readouterr().out
    profile_kernels.hlo_summary(_Run(compiled), fusions=True)
    listed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    entry = compiled.as_text().split("\nENTRY", 1)[1].split("\n}", 1)[0]
    expected = [line for line in entry.splitlines() if " fusion(" in line]
    assert expected and len(listed) == len(expected)
    for line in listed:
        assert " fusion(" in line and "kind=" in line and "metadata=" not in line
        name = line.split(" = ", 1)[0]
        assert any(e.strip().startswith(name + " ") for e in expected)


def test_a_runner_without_a_program_lists_nothing(capsys):
    profile_kernels.hlo_summary(object(), fusions=True)
    assert capsys.readouterr().out == ""
