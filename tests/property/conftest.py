"""Hypothesis settings for the property-based suite.

A fixed, small number of examples per test by default (bounded CPU runtime in CI); more with
LIGER_HYPOTHESIS_EXAMPLES=N. Hypothesis draws its own random seed per run and, on failure, prints the
falsifying example plus a ``@reproduce_failure`` blob; replay a whole run with ``pytest --hypothesis-seed=S``.
No example database is written (database=None), so runs leave no files behind.
"""

import os
from pathlib import Path

import tempfile

from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

# Hypothesis caches source constants under its home directory (./.hypothesis by default): keep the checkout
# clean unless the caller chose a directory.
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "liger-hypothesis"))

settings.register_profile(
    "liger",
    max_examples=int(os.environ.get("LIGER_HYPOTHESIS_EXAMPLES", "10")),
    deadline=None,  # the Triton interpreter is slow and its first call per kernel slower still
    database=None,
    print_blob=True,
    derandomize=False,
    # conftest's autouse poison_outputs fixture is function scoped; it only sets a global flag, which is the
    # same for every example, so sharing it across examples is harmless.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("LIGER_HYPOTHESIS_PROFILE", "liger"))


def pytest_configure(config):
    """Hand tests/conftest.py's ON_GPU to property_helpers (hypothesis tests cannot take the ``device``
    fixture). pytest_configure is historic, so this runs even when this conftest is loaded mid-collection."""
    import property_helpers

    parent = str(Path(__file__).resolve().parents[1] / "conftest.py")
    for plugin in config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None)
        if path and str(Path(path).resolve()) == parent:
            property_helpers.set_on_gpu(plugin.ON_GPU)
