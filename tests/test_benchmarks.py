"""benchmarks/: every module's smoke case end to end (tiny shapes; on the CPU the kernels run in Triton's
interpreter and the timing path is the host clock), the results file, and the report rendered from it (tables,
PNG plots, rows for points that failed, ran out of memory, were skipped or are not installed)."""

import json
import os
import shutil
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import harness, report  # noqa: E402
from benchmarks.__main__ import available_kernels, main  # noqa: E402
from benchmarks.bench_e2e import longest_fit, restored_module  # noqa: E402

STATUSES = {"ok", "oom", "error", "unavailable", "skipped"}
NEW_MODULES = {"kl_div", "jsd", "fused_linear_jsd", "medusa", "e2e"}

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False


@pytest.fixture(autouse=True)
def _reset_settings():
    yield
    harness.SETTINGS.update(smoke=False, quick=False)


def _load(out_dir):
    (path,) = [os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".json")]
    with open(path) as f:
        return path, json.load(f)


@pytest.mark.parametrize("limit,start,cap,gran,expected", [
    (100, 16, 1024, 4, (100, 104)),   # 16, 32, 64 fit, 128 does not; bisect down to 4 tokens
    (5000, 16, 1024, 16, (1024, None)),  # the cap fits
    (7, 16, 1024, 2, (6, 8)),          # the start does not fit: bisect below it
    (0, 16, 1024, 16, (0, 16)),        # nothing fits
    (48, 32, 128, 16, (48, 64)),       # the smoke run's simulated limit
])
def test_longest_fit_doubles_then_bisects(limit, start, cap, gran, expected):
    tried = []

    def fits(n):
        tried.append(n)
        return n <= limit

    assert longest_fit(fits, start, cap, gran) == expected
    assert len(tried) == len(set(tried)), f"a length was tried twice: {tried}"


def test_restored_module_undoes_module_and_class_patches():
    name = "benchmarks.bench_e2e"
    import benchmarks.bench_e2e as mod

    original = mod.Settings.__dict__.get("__init__")
    with restored_module(name):
        mod.NEW_GLOBAL = 1
        mod.MAX_POSITIONS = -1
        mod.Settings.extra = 2
    assert not hasattr(mod, "NEW_GLOBAL") and mod.MAX_POSITIONS == 262144
    assert not hasattr(mod.Settings, "extra") and mod.Settings.__dict__.get("__init__") is original


def test_smoke_run_of_every_module_and_its_report(tmp_path):
    assert NEW_MODULES <= set(available_kernels())
    out = tmp_path / "results"
    assert main(["run", "--smoke", "--no-isolate", "--fresh", "--out-dir", str(out), "--tag", "smoke"]) == 0
    path, results = _load(out)
    points = results["points"]
    assert results["ceilings"]["copy_GBps"] > 0 and results["ceilings"]["bf16_matmul_TFLOPs"] > 0
    assert results["runs"][0]["smoke"]
    assert {p["module"] for p in points} == set(available_kernels())
    assert {p["status"] for p in points} <= STATUSES
    assert not [p for p in points if p["status"] == "error"], [p.get("error") for p in points
                                                                if p["status"] == "error"]

    kernels = [p for p in points if p["kind"] == "kernel"]
    for p in kernels:
        assert p["params"], p
        if p["status"] == "ok":
            assert p["p20_ms"] <= p["median_ms"] <= p["p80_ms"] and p["reps"] >= 1
            assert p["floor_ms"] > 0 and p["of_floor"] > 0
    by_provider = {}
    for p in kernels:
        by_provider.setdefault(p["provider"], set()).add(p["status"])
    for ours in ("liger_torch", "liger_jax", "torch_eager", "xla"):
        assert by_provider[ours] == {"ok"}, (ours, by_provider[ours])
    assert by_provider["torch_compile"] == {"skipped"}  # not compiled in smoke runs
    if harness.device() == "cpu":
        assert by_provider["liger_kernel"] == {"unavailable"}
    medusa = [p for p in kernels if p["kernel"] == "medusa" and p["status"] == "ok"]
    assert {p["provider"] for p in medusa} >= {"liger_torch", "torch_eager", "liger_jax", "xla"}
    assert all(p["params"]["heads"] == 2 and p["TFLOPs"] > 0 for p in medusa)

    steps = {p["provider"]: p for p in points if p["kind"] == "e2e_step"}
    for provider in ("hf_eager", "hf+liger_torch", "flax_xla", "flax+liger_jax"):
        assert steps[provider]["status"] == "ok", steps[provider]
        assert steps[provider]["tokens_per_s"] > 0 and steps[provider]["shape"] == "1x16"
    assert steps["flax_xla"]["peak_GiB"] is not None  # XLA's compiled memory analysis
    longest = {p["provider"]: p for p in points if p["kind"] == "e2e_longest"}
    p = longest["hf_eager"]  # simulated OOM above 48 tokens: 32 fits, 64 does not, then 48 fits
    assert (p["status"], p["longest_fit"], p["first_oom"]) == ("ok", 48, 64), p
    assert [(t["seq"], t["status"]) for t in p["trials"]] == [(32, "ok"), (64, "oom"), (48, "ok")]
    if harness.device() == "cpu":
        assert steps["hf+liger_kernel"]["status"] == longest["hf+liger_kernel"]["status"] == "unavailable"

    md = open(path[:-5] + ".md").read()
    assert "## End-to-end training step" in md and "Longest sequence that fits" in md
    for kernel in {p["kernel"] for p in kernels}:
        assert f"## {kernel}\n" in md
    assert "| skipped |" in md and "n/a" in md and "floor ms" in md and "(p20-p80)" in md
    assert "48 | " in md  # the longest-sequence table
    if HAVE_MPL:
        plots = os.listdir(path[:-5] + "-plots")
        assert {f"{k}.png" for k in {p["kernel"] for p in kernels}} | {"e2e.png"} == set(plots)
        assert all(os.path.getsize(os.path.join(path[:-5] + "-plots", f)) > 1000 for f in plots)
        assert "-plots/rms_norm.png)" in md and "-plots/e2e.png)" in md


def _synthetic_results():
    env = {"date": "2026-01-01", "gpu": "NVIDIA H200", "torch": "2.11.0"}
    ok = dict(kind="kernel", module="m", kernel="flce", pass_="fwd+bwd", dtype="bf16", framework="torch",
              bytes=0, flops=10**12, status="ok", median_ms=2.0, p20_ms=1.9, p80_ms=2.2, reps=10,
              peak_extra_MB=100.0, TFLOPs=500.0, floor_ms=1.5, of_floor=0.75)
    points = []
    for n in (1024, 2048, 4096):
        base = dict(ok, shape=f"{n}x4096", params={"tokens": n, "hidden": 4096})
        base["pass"] = base.pop("pass_")
        points.append(dict(base, provider="liger_torch"))
        if n == 4096:
            points.append(dict(base, provider="torch_eager", status="oom", error="CUDA out of memory"))
        else:
            points.append(dict(base, provider="torch_eager", median_ms=4.0, p20_ms=3.9, p80_ms=4.1,
                               peak_extra_MB=9000.0))
        points.append(dict(base, provider="liger_kernel", status="unavailable", error="ImportError"))
        points.append(dict(base, provider="xla", framework="jax", status="error", error="RuntimeError: boom"))
    # a point from a file written before points had params: sizes parsed from the shape label
    points.append({"kernel": "rope", "pass": "fwd", "shape": "B4 T4096 H32/8 D128", "provider": "liger_torch",
                   "status": "ok", "median_ms": 0.5, "p20_ms": 0.4, "p80_ms": 0.6, "peak_extra_MB": 0.0})
    e2e = dict(kind="e2e_step", module="e2e", model="llama-3.2-1b", framework="torch", dtype="bf16")
    for seq, batch in ((1024, 16), (4096, 4), (16384, 1)):
        shape = dict(e2e, batch=batch, seq=seq, shape=f"{batch}x{seq}", params={"seq": seq})
        points.append(dict(shape, provider="hf_eager", status="oom" if seq == 16384 else "ok",
                           tokens_per_s=48300.0, peak_GiB=61.2))
        points.append(dict(shape, provider="hf+liger_torch", status="ok", tokens_per_s=62200.0, peak_GiB=26.8))
    points.append(dict(e2e, kind="e2e_longest", provider="hf_eager", shape="longest", status="ok",
                       longest_fit=40960, first_oom=49152, peak_GiB=130.1, trials=[{"seq": 8192}] * 5))
    points.append(dict(e2e, kind="e2e_longest", provider="hf+liger_torch", shape="longest", status="ok",
                       longest_fit=131072, first_oom=None, peak_GiB=120.0, trials=[]))
    return {"schema": harness.SCHEMA, "environment": env, "ceilings": {"copy_GBps": 4272.1,
                                                                       "bf16_matmul_TFLOPs": 679.8},
            "machine": {"gpu_memory_GiB": 139.8}, "runs": [], "points": points}


def test_render_is_a_function_of_the_json_and_shows_failures(tmp_path):
    path = tmp_path / "h200-2026-01-01.json"
    path.write_text(json.dumps(_synthetic_results()))
    assert main(["render", str(path)]) == 0
    md = (tmp_path / "h200-2026-01-01.md").read_text()
    if HAVE_MPL:
        links = {k: f"h200-2026-01-01-plots/{k}.png" for k in ("flce", "rope", "e2e")}
        assert md == report.render_markdown(_synthetic_results(), links)
    assert "| fwd+bwd | 4096x4096 | 1.500 | 2.000 (75%) | OOM | n/a | error |" in md
    # the summary line: ours vs eager where both ran, and where eager did not
    assert "fwd+bwd 2048x4096: liger_torch 2.000 ms vs torch_eager 4.000 ms (2.00x)" in md
    assert "fwd+bwd: torch_eager OOM at 4096x4096 where liger_torch ran" in md
    assert "## Failures" in md and "RuntimeError: boom" in md and "CUDA out of memory" in md
    assert "62.2k tok/s, 26.8 GiB" in md and "| OOM |" in md
    assert "| llama-3.2-1b | hf+liger_torch | >= 131072 |" in md and "| 40960 | 130.1 | 49152 | 5 |" in md
    assert "copy 4272.1 GB/s" in md
    if HAVE_MPL:
        assert sorted(os.listdir(tmp_path / "h200-2026-01-01-plots")) == ["e2e.png", "flce.png", "rope.png"]
    assert report.params_of({"shape": "16384x4096"}) == {"d0": 16384, "d1": 4096}
    assert report.params_of({"shape": "B4 T4096 H32/8 D128"}) == {"B": 4, "T": 4096, "H": 32, "D": 128}


def test_render_of_an_earlier_results_file(tmp_path):
    src = os.path.join(REPO, "benchmarks", "results", "h200-2026-12-02-quick.json")
    if not os.path.exists(src):
        pytest.skip("no earlier results file")
    dst = tmp_path / "old.json"
    shutil.copy(src, dst)
    md = open(report.render_files(str(dst), plots=False)).read()
    assert "## rms_norm" in md and "## fused_linear_cross_entropy" in md and "(p20-p80)" in md


def test_time_limit_skips_and_a_second_run_merges(tmp_path):
    args = ["run", "--smoke", "--no-isolate", "--out-dir", str(tmp_path), "--kernels", "kl_div", "--match",
            "torch_eager"]
    assert main(args + ["--time-limit", "0"]) == 0
    _, first = _load(tmp_path)
    assert [p["status"] for p in first["points"]] == ["skipped"]
    assert main(args) == 0
    path, second = _load(tmp_path)
    assert [p["status"] for p in second["points"]] == ["ok"] and len(second["runs"]) == 2
    assert "kl_div" in open(path[:-5] + ".md").read()


def test_reverse_runs_each_modules_tasks_last_first(tmp_path):
    """``--reverse`` (for telling order effects from the ops' own times) measures the same points, last first,
    in a worker process too."""
    args = ["run", "--smoke", "--fresh", "--out-dir", str(tmp_path), "--kernels", "kl_div", "--match",
            "(liger_torch|torch_eager)$"]
    orders = []
    for extra in ([], ["--reverse"], ["--reverse", "--isolate"]):
        assert main(args + ["--no-isolate"] * ("--isolate" not in extra) + extra) == 0
        _, results = _load(tmp_path)
        orders.append([(p["provider"], p["status"]) for p in results["points"]])
    assert len(orders[0]) == 2 and all(status == "ok" for _, status in orders[0])
    assert orders[1] == orders[2] == orders[0][::-1]


def test_merge_keeps_the_latest_measured_point_of_each_key(tmp_path):
    """``merge``: a later file's point replaces an earlier one, unless the later run only skipped it; points
    only in one file are kept; each names its file; the runs are listed together."""
    base = _synthetic_results()
    first, second = json.loads(json.dumps(base)), json.loads(json.dumps(base))
    first["runs"], second["runs"] = [{"started": "a", "argv": ["run"]}], [{"started": "b", "argv": ["run"]}]
    ok = [i for i, p in enumerate(base["points"]) if p["status"] == "ok"]
    second["points"][ok[0]]["median_ms"] = 123.0               # measured again: replaces
    second["points"][ok[1]] = {**second["points"][ok[1]], "status": "skipped", "median_ms": None}  # kept old
    del second["points"][ok[2]]                                  # absent from the later run: kept
    second["points"].append({**base["points"][ok[0]], "shape": "1x1", "median_ms": 7.0})  # new
    paths = []
    for name, results in (("first", first), ("second", second)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(results, f)
    out = str(tmp_path / "merged.json")
    assert main(["merge", out, *paths]) == 0
    merged = json.load(open(out))
    by_key = {harness.point_key(p): p for p in merged["points"]}
    assert len(merged["points"]) == len(base["points"]) + 1 and [r["started"] for r in merged["runs"]] == ["a", "b"]
    expected = ((123.0, "second.json"), (base["points"][ok[1]]["median_ms"], "first.json"),
                (base["points"][ok[2]]["median_ms"], "first.json"))
    for i, (median, source) in zip(ok[:3], expected):
        point = by_key[harness.point_key(base["points"][i])]
        assert (point["median_ms"], point["source"], point["status"]) == (median, source, "ok")
    assert by_key[harness.point_key({**base["points"][ok[0]], "shape": "1x1"})]["median_ms"] == 7.0
    assert os.path.exists(out[:-5] + ".md")
    with pytest.raises(SystemExit):
        main(["merge", str(tmp_path / "merged.md"), *paths])


def test_isolated_worker_process(tmp_path):
    args = ["run", "--smoke", "--isolate", "--fresh", "--out-dir", str(tmp_path), "--kernels", "jsd", "--match",
            "torch_eager"]
    assert main(args) == 0
    _, results = _load(tmp_path)
    assert [(p["provider"], p["status"], p["module"]) for p in results["points"]] == [("torch_eager", "ok", "jsd")]
    assert results["ceilings"]["copy_GBps"] > 0


def test_an_older_results_file_is_kept(tmp_path):
    old = tmp_path / "test-gpu-2026-01-01.json"
    old.write_text(json.dumps({"environment": {}, "points": []}))  # schema 1: no "schema" key
    harness_env = harness.environment
    try:  # a fixed GPU name and date (on a GPU machine the runner would otherwise name the file after its GPU)
        harness.environment = lambda: dict(harness_env(), date="2026-01-01", gpu="Test GPU")
        assert main(["run", "--smoke", "--no-isolate", "--out-dir", str(tmp_path), "--kernels", "jsd",
                     "--match", "torch_eager"]) == 0
    finally:
        harness.environment = harness_env
    assert json.loads(old.read_text()) == {"environment": {}, "points": []}
    assert json.loads((tmp_path / "test-gpu-2026-01-01-2.json").read_text())["points"][0]["status"] == "ok"


def test_fwd_bwd_runner_restores_what_an_op_overwrites_and_accumulates_nothing():
    """An op that writes its gradient over its input and over the incoming gradient (as the in-place kernels do)
    is timed on the original values every repetition, and no ``.grad`` is accumulated (no AccumulateGrad copy)."""
    import torch

    class InPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            x.detach().mul_(-1)  # writes over its input, behind autograd's back
            return y

        @staticmethod
        def backward(ctx, g):
            return g.mul_(2)  # writes dx over dy

    x = torch.randn(5, 3, requires_grad=True)
    g = torch.randn(5, 3)
    x0, g0 = x.detach().clone(), g.clone()
    run = harness.torch_fwd_bwd(InPlace.apply, (x,), g)
    for _ in range(3):
        run.prepare()
        assert torch.equal(x.detach(), x0) and torch.equal(g, g0)
        run()
        assert not torch.equal(x.detach(), x0) and not torch.equal(g, g0)
    assert x.grad is None


def in_place_and_read_only(a, b):
    """An op that updates ``a`` in place (row 3 set to 1) and reads ``b`` into a fresh output (2 b), the latter
    opaque to XLA, like a kernel launch."""
    import jax
    import numpy as np

    doubled = jax.pure_callback(lambda v: np.asarray(v) * 2.0, jax.ShapeDtypeStruct(b.shape, b.dtype), b)
    return a.at[3].set(1.0), doubled


def test_donating_jax_runner_gives_each_call_fresh_arguments():
    """The runner for inputs larger than L2: the program takes its arguments donated, each call consumes a copy
    made by ``prepare`` (so the caller's arrays stay valid and every call sees the original values), and the
    extra memory counts an output that reuses a donated buffer once, not twice."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.harness import donating_jax_runner, time_jax

    x = jax.random.normal(jax.random.key(3), (64, 32), jnp.float32)
    run = donating_jax_runner(lambda a: a * 2.0 + 1.0, x)
    run.prepare(3)
    outs = [run() for _ in range(3)]
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2.0 + 1.0)
    assert not x.is_deleted()
    out = run()  # an empty pool is refilled
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2.0 + 1.0)
    assert len(time_jax(run)) >= 1
    assert run.peak_extra_MB is None or run.peak_extra_MB <= x.nbytes / 2**20 + 1e-9


def test_donating_jax_runner_donates_only_what_removes_a_copy():
    """An argument the op updates in place is donated (no defensive copy left in the program); one the op only
    reads is not, since jax would tie it to a same-shaped output and XLA would add a copy into it (measured: the
    jax rms_norm forward doubled on the H200 with every argument donated)."""
    import jax
    import numpy as np

    from benchmarks.harness import donating_jax_runner, hlo_copy_bytes

    x = jax.random.normal(jax.random.key(5), (64, 32), jax.numpy.float32)
    y = jax.random.normal(jax.random.key(6), (64, 32), jax.numpy.float32)

    fn = in_place_and_read_only
    assert hlo_copy_bytes(jax.jit(fn).lower(x, y).compile()) > 0  # the plain program copies a
    run = donating_jax_runner(fn, x, y)
    assert run.donated == (0,)
    assert hlo_copy_bytes(jax.jit(fn, donate_argnums=(0,)).lower(x, y).compile()) == 0
    a, b = run()
    expected_a = np.asarray(x).copy()
    expected_a[3] = 1.0
    np.testing.assert_array_equal(np.asarray(a), expected_a)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(y) * 2.0)
    assert not x.is_deleted() and not y.is_deleted()


@pytest.mark.parametrize("l2", [1, 2**20], ids=["donating", "chained"])
def test_jax_fwd_bwd_output_order_with_fewer_copies(monkeypatch, l2):
    """An op that writes its forward over its input and its backward over the cotangent (RoPE's kernels): with
    the gradients first, jax ties the donated input to the gradient and XLA copies twice; the runner times the
    order without copies, and its results are the op's. Large inputs (one call per program) and small ones
    (chained calls) alike."""
    import jax
    import numpy as np

    from benchmarks import harness

    monkeypatch.setattr(harness, "device", lambda: "cuda")  # the GPU's paths
    monkeypatch.setattr(harness, "smoke", lambda: False)
    monkeypatch.setattr(harness, "l2_bytes", lambda: l2)
    x = jax.random.normal(jax.random.key(7), (64, 48), jax.numpy.float32)
    g = jax.random.normal(jax.random.key(8), (64, 48), jax.numpy.float32)

    def f(v):  # an in-place update of its operand, forward and backward
        return v.at[:, 0].set(1.0)

    def grads_first(args, d):
        out, pullback = jax.vjp(f, *args)
        return pullback(d), out

    assert harness.jax_runner(grads_first, (x,), g).copy_bytes > 0
    run = harness.jax_pass_runner(f, (x,), g, "fwd+bwd")
    assert run.copy_bytes == 0
    out, (dx,) = first_call(run)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f(x)))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(g.at[:, 0].set(0.0)))


def test_report_compares_the_frontends_with_the_timers_divided_out():
    """The jax-vs-torch table: same kernel, pass and shape, both ok; the adjusted ratio uses the point's own
    run's ceilings when a merged file carries them, else the file's."""
    def point(provider, ms, shape="64x64", status="ok", **extra):
        return {"kind": "kernel", "kernel": "rms_norm", "pass": "fwd", "shape": shape, "provider": provider,
                "framework": "jax" if provider == "liger_jax" else "torch", "status": status, "median_ms": ms,
                "p20_ms": ms, "p80_ms": ms, "reps": 10, **extra}

    results = {"ceilings": {"copy_GBps": 4000.0, "jax_copy_GBps": 3600.0}, "points": [
        point("liger_torch", 1.0), point("liger_jax", 1.2),
        point("liger_torch", 2.0, "128x64"), point("liger_jax", 2.0, "128x64",
                                                   ceilings={"copy_GBps": 4000.0, "jax_copy_GBps": 2000.0}),
        point("liger_torch", 1.0, "256x64"), point("liger_jax", None, "256x64", status="oom"),
    ]}
    md = report.render_markdown(results)
    assert "## JAX frontend against torch frontend" in md
    assert "| rms_norm | fwd | 64x64 | 1.000 | 1.200 | 1.20 | 1.08 |" in md
    assert "| rms_norm | fwd | 128x64 | 2.000 | 2.000 | 1.00 | 0.50 |" in md
    assert "256x64 |" not in md.split("## JAX frontend")[1]


def test_small_jax_inputs_are_called_in_turn_by_one_program(monkeypatch):
    """Inputs that fit in L2: one program calls the op on each copy in turn, the calls ordered by optimization
    barriers (no fusion of the copies' ops into one kernel), and the timer divides by the calls per run."""
    import jax
    import numpy as np

    from benchmarks import harness

    monkeypatch.setattr(harness, "device", lambda: "cuda")
    monkeypatch.setattr(harness, "smoke", lambda: False)
    monkeypatch.setattr(harness, "l2_bytes", lambda: 4096)  # a 2 KB input: 8 copies
    x = jax.random.normal(jax.random.key(9), (16, 32), jax.numpy.float32)
    run = harness.jax_runner(lambda v: (v * 2.0, v.sum()), x)
    assert run.calls_per_run == 8 and run.peak_extra_MB is not None
    outs = run.per_call(run())
    assert len(outs) == 8
    for doubled, total in outs:
        np.testing.assert_allclose(np.asarray(doubled), np.asarray(x) * 2.0)
        np.testing.assert_allclose(float(total), float(x.sum()), rtol=1e-6)
    assert run.lowered.as_text().count("optimization_barrier") == 8
    monkeypatch.setattr(harness, "smoke", lambda: True)  # the timer divides a run's time by its calls
    monkeypatch.setattr(harness, "_time_host", lambda run, *a, **k: [8.0, 16.0])
    assert harness.time_jax(run) == [1.0, 2.0]


def test_chained_jax_runner_donates_what_an_op_writes_over(monkeypatch):
    """Small inputs, chained: an operand the op updates in place is donated in every set (so the program holds
    no copy of it), each run gets fresh copies from ``prepare``, and an operand only read is kept."""
    import jax
    import numpy as np

    from benchmarks import harness

    monkeypatch.setattr(harness, "device", lambda: "cuda")
    monkeypatch.setattr(harness, "smoke", lambda: False)
    monkeypatch.setattr(harness, "l2_bytes", lambda: 8192)  # two 2 KB inputs: 8 copies
    x = jax.random.normal(jax.random.key(11), (16, 32), jax.numpy.float32)
    y = jax.random.normal(jax.random.key(12), (16, 32), jax.numpy.float32)

    fn = in_place_and_read_only
    run = harness.jax_runner(fn, x, y)
    assert run.calls_per_run == 8 and run.donated == (0,) and run.copy_bytes == 0
    expected_a = np.asarray(x).copy()
    expected_a[3] = 1.0
    run.prepare(2)
    for _ in range(3):  # two prepared runs, then one from an empty pool
        outs = run.per_call(run())
        assert len(outs) == 8
        for a, b in outs:
            np.testing.assert_array_equal(np.asarray(a), expected_a)
            np.testing.assert_array_equal(np.asarray(b), np.asarray(y) * 2.0)
    assert not x.is_deleted() and not y.is_deleted()
    assert run.peak_extra_MB is not None


def test_jax_copy_ceiling_is_measured_with_the_jax_timer(monkeypatch):
    """The jax columns' timer on an elementwise op: a positive bandwidth where jax has a GPU (faked here, on
    small bytes), None where it has none."""
    import jax

    from benchmarks import harness

    assert harness._jax_copy_gbps(src_bytes=2**16) is None or jax.default_backend() == "gpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gbps = harness._jax_copy_gbps(src_bytes=2**16)
    assert gbps is not None and gbps > 0


def test_report_shows_run_notes_and_the_jax_copy_ceiling():
    """A note added to a run afterwards (a superseded column) and the jax timer's copy ceiling reach the report."""
    results = _synthetic_results()
    results["ceilings"]["jax_copy_GBps"] = 3801.5
    results["runs"] = [{"started": "2026-01-01T10:00:00", "argv": ["run", "--quick"], "note": "jax columns redone"}]
    md = report.render_markdown(results, {})
    assert "Note on the run of 2026-01-01T10:00:00: jax columns redone" in md
    assert "3801.5 GB/s" in md


def first_call(run):
    """The outputs of one call of ``fn`` from a jax runner (on a GPU, a chained runner returns every call's)."""
    out = run()
    return run.per_call(out)[0] if getattr(run, "calls_per_run", 1) > 1 else out


def test_jax_fwd_bwd_runner_keeps_the_forward():
    """jax "fwd+bwd" returns the forward's output with the gradients, so XLA cannot drop a forward that the
    backward alone does not need (here a linear map, whose pullback ignores the forward)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.harness import jax_pass_runner

    x = jax.random.normal(jax.random.key(8), (16, 8), jnp.float32)
    d = jax.random.normal(jax.random.key(9), (16, 8), jnp.float32)
    (grad,), out = first_call(jax_pass_runner(lambda a: a * 3.0, (x,), d, "fwd+bwd"))  # gradients first
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * 3.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(d) * 3.0, rtol=1e-6)


def test_jax_fwd_bwd_runner_returns_only_the_chosen_gradients():
    """``returned_grads`` leaves out a gradient that is the same array as another (a residual add's): the
    program returns the forward's outputs and the chosen gradients, in their order."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.harness import jax_pass_runner

    k = jax.random.split(jax.random.key(10), 4)
    x, r, w = (jax.random.normal(k[i], (16, 8), jnp.float32) for i in range(3))
    d = jax.random.normal(k[3], (16, 8), jnp.float32)
    f = lambda a, b, s: (a + b) * s
    grads, out = first_call(jax_pass_runner(f, (x, r, w), d, "fwd+bwd", returned_grads=(0, 2)))
    assert len(grads) == 2
    np.testing.assert_allclose(np.asarray(out), np.asarray((x + r) * w), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(d * w), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(d * (x + r)), rtol=1e-6)


def test_jax_loss_runner_returns_the_loss_with_the_gradients():
    """A loss's "fwd+bwd" keeps its forward: KL's gradient (-target) does not need the forward, and with
    ``jax.grad`` alone the jax column timed the backward alone (it came out faster than the floor of both)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.harness import jax_loss_runner

    a = jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (6, 10)), -1)
    t = jax.nn.softmax(jax.random.normal(jax.random.key(4), (6, 10)), -1)
    kl = lambda x, y: jnp.sum(y * (jnp.log(y) - x))
    (grad_a, grad_t), loss = first_call(jax_loss_runner(kl, (a, t), "fwd+bwd", argnums=(0, 1)))
    np.testing.assert_allclose(float(loss), float(kl(a, t)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_a), -np.asarray(t), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_t), np.asarray(jnp.log(t) - a + 1.0), rtol=1e-5)
    np.testing.assert_allclose(float(first_call(jax_loss_runner(kl, (a, t), "fwd"))), float(kl(a, t)), rtol=1e-6)


def test_profile_idle_report_counts_gaps_between_device_activities():
    """scripts/profile_e2e.py's idle accounting: overlapping activities are busy once, gaps are grouped by the
    activity that ended last before them and the one after."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "profile_e2e.py")
    spec = importlib.util.spec_from_file_location("profile_e2e", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    events = [("d", 55_000, 70_000), ("a", 0, 10_000), ("b", 10_000, 20_000), ("c", 50_000, 60_000),
              ("a", 100_000, 110_000), ("e", 111_000, 112_000)]
    lines = module.idle_report(events, steps=1)
    assert lines[0].startswith("GPU span 0.1 ms/step: busy 0.1, idle 0.1 (54.5%)"), lines[0]
    assert lines[2:] == ["    0.03      1  b -> c", "    0.03      1  d -> a"]  # the 1 us gap is below 2 us
