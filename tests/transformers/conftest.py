"""Every test here leaves transformers' modeling modules as it found them (module-level patches are undone)."""

import warnings

import pytest

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*InterpreterModeWarning.*")


@pytest.fixture(autouse=True)
def no_leaked_patches():
    from liger_torch.transformers import patched_families, revert_liger_kernel

    assert patched_families() == [], "a previous test leaked module-level patches"
    yield
    leaked = patched_families()
    revert_liger_kernel()
    assert leaked == [], f"test leaked module-level patches of {leaked}"
