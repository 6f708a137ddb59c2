"""The device of tests/conftest.py's ``device`` fixture, for hypothesis tests, which cannot take that
function-scoped fixture: tests/property/conftest.py reads ``ON_GPU`` off the loaded tests/conftest.py plugin
and hands it here before any test module is imported."""

ON_GPU = None


def set_on_gpu(value):
    global ON_GPU
    ON_GPU = bool(value)


def device():
    assert ON_GPU is not None, "tests/conftest.py was not loaded: run these tests through pytest"
    return "cuda" if ON_GPU else "cpu"
