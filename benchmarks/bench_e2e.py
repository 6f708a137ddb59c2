"""End-to-end: a training step (forward, backward, AdamW) of a Llama-family model, bf16, random init, random
tokens (never zeros).

- Hugging Face transformers (sdpa attention, fused AdamW, no gradient checkpointing), three providers, each in
  a fresh model: ``hf_eager``, ``hf+liger_torch`` (``liger_torch.apply_liger_kernel(model)``) and
  ``hf+liger_kernel`` (Liger-Kernel's ``apply_liger_kernel_to_llama(model=...)``, when importable; the
  module-level patches it also makes are undone after the task). For each: tokens/s and peak memory at each
  sequence length with the same tokens per step (16 x 1024 ... 1 x 16384; 1 x 65536 on top), then, in another
  fresh model, the longest sequence (batch 1) that fits: doubling until out of memory, then bisection.
- The Flax model ``liger_jax.models.LlamaForCausalLM`` with ``use_kernels=False`` (``flax_xla``) and ``True``
  (``flax+liger_jax``), optax AdamW, a jitted step with donated parameters and optimizer state, on the same
  shapes (fewer of them: every shape is a compilation).

Models: Llama-3.2-1B's shape and a Llama-3-8B-shaped model with 8 of its 32 layers (the full one leaves no room
for activations at these lengths on one GPU). A point that runs out of memory is recorded as ``oom``, its memory
freed, and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import statistics
import time

from .harness import Task, classify, device, free_memory, percentile

LLAMA_MODULE = "transformers.models.llama.modeling_llama"
_LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
               rms_norm_eps=1e-5)
MODELS = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                         tie_word_embeddings=True),
    "llama-3-8b-8L": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, head_dim=128,
                          tie_word_embeddings=False),
}
SMOKE_MODELS = {"tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
                             rms_norm_eps=1e-5, tie_word_embeddings=False)}
HF_PROVIDERS = ("hf_eager", "hf+liger_torch", "hf+liger_kernel")
FLAX_PROVIDERS = ("flax_xla", "flax+liger_jax")
MAX_POSITIONS = 262144


@dataclasses.dataclass
class Settings:
    models: dict
    seqs: tuple            # sequence lengths of the sweep
    tokens_per_step: int   # batch = tokens_per_step // seq (at least 1)
    flax_seqs: tuple
    warmup: int
    steps: int
    search_start: int      # the longest-sequence search: first length, cap, and bisection granularity
    search_cap: int
    search_granularity: int
    simulate_oom_above: int | None = None  # smoke runs on the CPU: lengths above this "run out of memory"


def settings(quick: bool, smoke: bool) -> Settings:
    if smoke:
        return Settings(SMOKE_MODELS, (16,), 16, (16,), 0, 1, 32, 128, 16, simulate_oom_above=48)
    if quick:
        return Settings(MODELS, (1024, 4096, 16384, 65536), 16384, (4096,), 2, 3, 16384, 131072, 16384)
    return Settings(MODELS, (1024, 2048, 4096, 8192, 16384, 65536), 16384, (1024, 4096, 16384), 2, 5, 8192,
                    MAX_POSITIONS, 4096)


def longest_fit(fits, start: int, cap: int, granularity: int):
    """The longest length ``n`` (a multiple of ``granularity``) with ``fits(n)``, searching by doubling from
    ``start`` up to ``cap`` and then bisecting between the last length that fit and the first that did not.
    Returns (longest that fit or 0, shortest that did not or None when ``cap`` fit)."""
    lo, hi, n = 0, None, start
    while True:
        if fits(n):
            lo = n
            if n >= cap:
                break
            n = min(2 * n, cap)
        else:
            hi = n
            break
    while hi is not None and hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo or mid >= hi:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


@contextlib.contextmanager
def restored_module(name: str):
    """Undo, on exit, every change to the module ``name`` and to the classes defined in it (Liger-Kernel's
    ``apply_liger_kernel_to_llama`` patches the modeling module even when given a model)."""
    module = importlib.import_module(name)
    saved = dict(vars(module))
    classes = {k: dict(vars(v)) for k, v in saved.items() if isinstance(v, type) and v.__module__ == name}
    try:
        yield module
    finally:
        for k in [k for k in vars(module) if k not in saved]:
            delattr(module, k)
        for k, v in saved.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)
        for k, attrs in classes.items():
            cls = saved[k]
            for a in [a for a in vars(cls) if a not in attrs and not a.startswith("__")]:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(cls, a)
            for a, v in attrs.items():
                if not a.startswith("__") and vars(cls).get(a) is not v:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(cls, a, v)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face (torch)


def e2e_dtype() -> str:
    """bf16 on the GPU; fp32 on the CPU (smoke runs: the interpreter emulates bf16 slowly)."""
    return "bf16" if device() == "cuda" else "fp32"


def build_hf(spec: dict, provider: str):
    import torch
    import transformers

    dtype = torch.bfloat16 if e2e_dtype() == "bf16" else torch.float32
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**spec, max_position_embeddings=MAX_POSITIONS, use_cache=False)
    dev = device()
    context = torch.device(dev) if dev == "cuda" else contextlib.nullcontext()
    with context:  # initialise on the GPU directly (a 1B model initialised on the host takes a while)
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers 4.x
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype,
                                                                  attn_implementation="sdpa")
    if next(model.parameters()).device.type != dev or next(model.parameters()).dtype != dtype:
        model = model.to(dev, dtype)
    if provider == "hf+liger_torch":
        import liger_torch

        liger_torch.apply_liger_kernel(model)
    elif provider == "hf+liger_kernel":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    elif provider != "hf_eager":
        raise KeyError(provider)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=dev == "cuda")
    return model, opt


def _hf_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_measure(model, opt, batch, seq, vocab, cfg: Settings, warmup, steps) -> dict:
    """Train ``warmup`` + ``steps`` steps at (batch, seq); the timed steps' times and peak memory, or the
    failure. Memory is freed after either."""
    import torch

    out = {"batch": batch, "seq": seq, "shape": f"{batch}x{seq}", "tokens": batch * seq, "params": {"seq": seq}}
    batches = None
    try:
        if cfg.simulate_oom_above is not None and seq > cfg.simulate_oom_above:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated above {cfg.simulate_oom_above} "
                                              f"tokens in smoke mode)")
        batches = [torch.randint(0, vocab, (batch, seq), device=device()) for _ in range(2)]
        for i in range(warmup):
            _hf_step(model, opt, batches[i % 2])
        _sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            losses.append(_hf_step(model, opt, batches[i % 2]))
            _sync()
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        out.update(status="ok", step_ms=round(1e3 * median, 2), p20_ms=round(1e3 * percentile(times, 0.2), 2),
                   p80_ms=round(1e3 * percentile(times, 0.8), 2), steps=steps,
                   tokens_per_s=round(batch * seq / median, 1), loss=round(losses[-1], 4))
        out["peak_GiB"] = (round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
                           else None)
    except Exception as err:
        out["status"], out["error"] = classify(err)
        if out["status"] == "error":
            import traceback

            traceback.print_exc()
    finally:
        batches = None
        opt.zero_grad(set_to_none=True)
        free_memory()
    return out


def hf_sweep_task(model_name, spec, provider, cfg: Settings) -> Task:
    meta = {"kind": "e2e_step", "model": model_name, "provider": provider, "framework": "torch",
            "shape": "sweep", "dtype": e2e_dtype()}

    def run(ceilings):
        base = {k: v for k, v in meta.items() if k != "shape"}
        with restored_module(LLAMA_MODULE):
            try:
                model, opt = build_hf(spec, provider)
            except Exception as err:  # not installed, or it does not build: every point says so
                status, message = classify(err)
                free_memory()
                return [dict(base, batch=max(1, cfg.tokens_per_step // s), seq=s, params={"seq": s},
                             shape=f"{max(1, cfg.tokens_per_step // s)}x{s}", status=status, error=message)
                        for s in cfg.seqs]
            points = []
            for seq in cfg.seqs:
                batch = max(1, cfg.tokens_per_step // seq)
                points.append(dict(base, **hf_measure(model, opt, batch, seq, spec["vocab_size"], cfg,
                                                      cfg.warmup, cfg.steps)))
            model = opt = None
            return points

    return Task(f"e2e hf {model_name} {provider} sweep", run, meta)


def hf_longest_task(model_name, spec, provider, cfg: Settings) -> Task:
    meta = {"kind": "e2e_longest", "model": model_name, "provider": provider, "framework": "torch",
            "shape": "longest", "dtype": e2e_dtype()}

    def run(ceilings):
        point = dict(meta, cap=cfg.search_cap, granularity=cfg.search_granularity)
        with restored_module(LLAMA_MODULE):
            try:
                model, opt = build_hf(spec, provider)
            except Exception as err:
                point["status"], point["error"] = classify(err)
                return [point]
            # one short step first: AdamW's state exists before the search, and the kernels are compiled
            warm = hf_measure(model, opt, 1, min(1024, cfg.search_start), spec["vocab_size"],
                              dataclasses.replace(cfg, simulate_oom_above=None), 0, 1)
            if warm["status"] != "ok":
                point.update(status=warm["status"], error=warm.get("error"))
                return [point]
            trials = []

            def fits(seq):
                r = hf_measure(model, opt, 1, seq, spec["vocab_size"], cfg, 0, 1)
                trials.append({"seq": seq, "status": r["status"], "peak_GiB": r.get("peak_GiB"),
                               "step_s": None if r["status"] != "ok" else round(r["step_ms"] / 1e3, 2)})
                if r["status"] == "error":
                    raise RuntimeError(r.get("error"))
                return r["status"] == "ok"

            lo, hi = longest_fit(fits, cfg.search_start, cfg.search_cap, cfg.search_granularity)
            at_lo = [t for t in trials if t["seq"] == lo and t["status"] == "ok"]
            point.update(status="ok", longest_fit=lo, first_oom=hi, trials=trials,
                         peak_GiB=at_lo[-1]["peak_GiB"] if at_lo else None)
            model = opt = None
            return [point]

    return Task(f"e2e hf {model_name} {provider} longest", run, meta)


# ---------------------------------------------------------------------------------------------------------
# Flax (jax)


def _flax_config(spec: dict):
    from liger_jax.models import LlamaConfig

    return LlamaConfig(vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
                       intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
                       num_attention_heads=spec["num_attention_heads"],
                       num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
                       rms_norm_eps=spec["rms_norm_eps"], rope_theta=spec["rope_theta"],
                       tie_word_embeddings=spec["tie_word_embeddings"], max_position_embeddings=MAX_POSITIONS)


def flax_init(spec: dict, use_kernels: bool):
    """A fresh bf16 model, split into (graphdef, params, rest), optax AdamW's state, and the jitted step
    ``(params, opt_state, rest, ids) -> (params, opt_state, loss)`` with params and state donated."""
    import jax
    import optax
    import jax.numpy as jnp
    from flax import nnx

    from liger_jax.models import LlamaForCausalLM

    dtype = jnp.bfloat16 if e2e_dtype() == "bf16" else jnp.float32
    model = LlamaForCausalLM(_flax_config(spec), use_kernels=use_kernels, dtype=dtype, param_dtype=dtype,
                             rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-5, weight_decay=0.01)
    opt_state = tx.init(params)

    def loss_fn(p, r, ids):
        return nnx.merge(graphdef, p, r).loss(ids, ids)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, r, ids):
        loss, grads = jax.value_and_grad(loss_fn)(p, r, ids)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    return {"params": params, "opt_state": opt_state, "rest": rest, "step": step}


def _xla_peak_gib(compiled):
    try:
        m = compiled.memory_analysis()
        total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes)
        return round(total / 2**30, 2)
    except Exception:
        return None


def flax_sweep_task(model_name, spec, provider, cfg: Settings) -> Task:
    meta = {"kind": "e2e_step", "model": model_name, "provider": provider, "framework": "jax", "shape": "sweep",
            "dtype": e2e_dtype()}

    def run(ceilings):
        import jax
        import jax.numpy as jnp

        base = {k: v for k, v in meta.items() if k != "shape"}
        state = None
        points = []
        for seq in cfg.flax_seqs:
            batch = max(1, cfg.tokens_per_step // seq)
            point = dict(base, batch=batch, seq=seq, shape=f"{batch}x{seq}", tokens=batch * seq,
                         params={"seq": seq})
            compiled = None
            try:
                if state is None:
                    state = flax_init(spec, provider == "flax+liger_jax")
                k1, k2 = jax.random.split(jax.random.key(seq))
                batches = [jax.random.randint(k, (batch, seq), 0, spec["vocab_size"], dtype=jnp.int32)
                           for k in (k1, k2)]
                compiled = state["step"].lower(state["params"], state["opt_state"], state["rest"],
                                               batches[0]).compile()
                point["peak_GiB"] = _xla_peak_gib(compiled)
                times, loss = [], None
                for i in range(cfg.warmup + cfg.steps):
                    t0 = time.perf_counter()
                    state["params"], state["opt_state"], loss = compiled(state["params"], state["opt_state"],
                                                                         state["rest"], batches[i % 2])
                    jax.block_until_ready((state["params"], loss))
                    if i >= cfg.warmup:
                        times.append(time.perf_counter() - t0)
                median = statistics.median(times)
                point.update(status="ok", step_ms=round(1e3 * median, 2),
                             p20_ms=round(1e3 * percentile(times, 0.2), 2),
                             p80_ms=round(1e3 * percentile(times, 0.8), 2), steps=cfg.steps,
                             tokens_per_s=round(batch * seq / median, 1), loss=round(float(loss), 4))
            except Exception as err:
                point["status"], point["error"] = classify(err)
                state = None  # donated buffers may be gone: the next length starts from a fresh model
                if point["status"] == "error":
                    import traceback

                    traceback.print_exc()
            finally:
                compiled = None
                free_memory()
            points.append(point)
        return points

    return Task(f"e2e flax {model_name} {provider} sweep", run, meta)


def tasks(quick: bool = False, smoke: bool = False) -> list[Task]:
    cfg = settings(quick, smoke)
    out = []
    for name, spec in cfg.models.items():
        out += [hf_sweep_task(name, spec, p, cfg) for p in HF_PROVIDERS]
        # smoke runs search with HF eager only (the search is the same code for every provider) and
        # Liger-Kernel (its "not installed" path on the CPU)
        out += [hf_longest_task(name, spec, p, cfg) for p in HF_PROVIDERS
                if not smoke or p != "hf+liger_torch"]
    for name, spec in cfg.models.items():
        out += [flax_sweep_task(name, spec, p, cfg) for p in FLAX_PROVIDERS]
    return out
