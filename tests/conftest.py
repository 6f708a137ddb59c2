"""Shared fixtures: the device the kernels run on, fresh seeds, and poisoned outputs."""

import os
import random

import pytest

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU: keep jax from probing for one
    # A 4-device CPU mesh for the sharding tests (must be set before jax initialises its backend).
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# Several test workers share one GPU with torch: jax must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import liger_core  # noqa: E402  (decides interpreter mode before anything defines kernels)
import liger_torch._launch  # noqa: E402

ON_GPU = not liger_core.INTERPRET

if not ON_GPU:
    import interpreter_bounds

    interpreter_bounds.install()  # a load or store outside every argument's storage fails the test

if ON_GPU:
    import jax

    # XLA computes fp32 matmuls in TF32 on NVIDIA GPUs by default (~1e-3 relative error); the tests compare the
    # kernels (and the matmuls the fused losses and the Flax MLPs run through XLA) with float64 references,
    # so they ask for full fp32 matmuls, as torch's default already is.
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs in scripts/gpu_check.sh on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture
def seed(request):
    """A fresh seed per test, printed on failure so a failing draw can be replayed (LIGER_TEST_SEED=...)."""
    value = int(os.environ.get("LIGER_TEST_SEED", random.SystemRandom().randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value}")
    return value


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(liger_torch._launch, "POISON_OUTPUTS", True)


def _lagged_from(monkeypatch, from_cols):
    """Cross-entropy's lagged kernel as the default from ``from_cols`` columns up (None: never), the plan caches
    cleared on the way in and out."""
    from liger_core import cross_entropy

    def clear():
        cross_entropy.forward_plan.cache_clear()
        cross_entropy.chunk_plan.cache_clear()

    clear()
    monkeypatch.setitem(cross_entropy.LAGGED, "from_cols", from_cols)
    yield
    monkeypatch.undo()
    clear()


@pytest.fixture
def lagged_from_65536(monkeypatch):
    """Cross-entropy's lagged kernel from 65536 columns up (``LAGGED``), whatever the library's default: the
    frontends' tests of wide rows stay on it."""
    yield from _lagged_from(monkeypatch, 65536)


@pytest.fixture
def lagged_off(monkeypatch):
    """Cross-entropy's two-pass kernel at every width."""
    yield from _lagged_from(monkeypatch, None)


@pytest.fixture
def norm_lagged(monkeypatch):
    """Set the lagged norm backward's knobs (``liger_core.rms_norm.LAGGED_BACKWARD``) for one test:
    ``norm_lagged(rows=4, lag_bytes=1, ...)``; the plan caches cleared on the way in and out."""
    from liger_core import fused_add_rms_norm, rms_norm

    def clear():
        rms_norm.backward_plan.cache_clear()
        fused_add_rms_norm.backward_plan.cache_clear()

    def set_knobs(**knobs):
        for name, value in knobs.items():
            assert name in rms_norm.LAGGED_BACKWARD, name
            monkeypatch.setitem(rms_norm.LAGGED_BACKWARD, name, value)
        clear()

    clear()
    yield set_knobs
    monkeypatch.undo()
    clear()
