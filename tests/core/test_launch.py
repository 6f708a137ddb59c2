"""liger_core's plain-Python launch logic: row folding by strides, promotion, plan validation, mode flag."""

import pytest

import liger_core
from liger_core import runtime
from liger_core.launch import ArrayInfo, Buf, Launch, NewBuffer, Plan, collapse_rows, contiguous_strides, promote


@pytest.mark.parametrize("shape,strides,expected", [
    ((7, 123), (123, 1), (7, 123, 123, 1)),
    ((2, 3, 5), (15, 5, 1), (6, 5, 5, 1)),
    ((7, 123), (200, 1), (7, 123, 200, 1)),           # rows of a wider buffer
    ((3, 1, 4, 8), (32, 99, 8, 1), (12, 8, 8, 1)),    # size-1 axes never matter
    ((5,), (1,), (1, 5, 5, 1)),
    ((4, 6), (0, 0), (4, 6, 0, 0)),                   # expanded: folds, but rows overlap
])
def test_collapse_rows(shape, strides, expected):
    assert collapse_rows(ArrayInfo(shape, strides, "float32")) == expected


def test_collapse_rows_refuses_axes_that_do_not_fold():
    assert collapse_rows(ArrayInfo((3, 5, 8), (8, 24, 1), "float32")) is None  # transposed leading axes


def test_contiguous_strides():
    assert contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert contiguous_strides(()) == ()


def test_promote_follows_torch_and_jax():
    assert promote("bfloat16", "bfloat16") == "bfloat16"
    assert promote("bfloat16", "float32") == "float32"
    assert promote("bfloat16", "float16") == "float32"
    assert promote("float16", "float64") == "float64"


def test_plan_rejects_reading_a_buffer_before_it_exists():
    launch = Launch(kernel="k", grid=(1,), args=(Buf("missing"),), outputs=(NewBuffer("y", (1,), "float32"),))
    with pytest.raises(AssertionError, match="before it exists"):
        Plan(inputs=("x",), launches=(launch,), outputs=("y",))


def test_plan_rejects_an_alias_the_launch_does_not_take():
    launch = Launch(kernel="k", grid=(1,), args=(Buf("x"),), outputs=(NewBuffer("y", (1,), "float32", alias="z"),))
    with pytest.raises(AssertionError, match="aliases"):
        Plan(inputs=("x", "z"), launches=(launch,), outputs=("y",))


def test_plan_rejects_outputs_never_written():
    launch = Launch(kernel="k", grid=(1,), args=(Buf("x"), 3, 1.5), outputs=(NewBuffer("y", (1,), "float32"),))
    with pytest.raises(AssertionError, match="never written"):
        Plan(inputs=("x",), launches=(launch,), outputs=("z",))


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("off", False),
                                            ("", None), ("auto", None)])
def test_mode_flag(value, expected):
    assert runtime._parse_flag(value) is expected


def test_mode_flag_rejects_garbage():
    with pytest.raises(ValueError, match="LIGER_INTERPRET"):
        runtime._parse_flag("maybe")


def test_mode_is_decided_once():
    assert runtime.interpreting() is liger_core.INTERPRET


def _norm_forward_launch(family, n_cols, chunk=None, block_m=None, dtypes=("bfloat16", "bfloat16", None)):
    """The launch of a norm forward plan on rows of ``n_cols``; ``dtypes``: x's, the residual's and the weight's
    (None: no weight; LayerNorm's bias as the weight)."""
    from liger_core import fused_add_rms_norm, layer_norm, rms_norm

    x, r = (ArrayInfo.contiguous((2, n_cols), d) for d in dtypes[:2])
    w = None if dtypes[2] is None else ArrayInfo.contiguous((n_cols,), dtypes[2])
    o = dict(chunk=chunk, block_m=block_m)
    plan = {"rms_norm": lambda: rms_norm.forward_plan(x, w, eps=1e-6, **o),
            "layer_norm": lambda: layer_norm.forward_plan(x, w, w, eps=1e-5, **o),
            "fused_add_rms_norm": lambda: fused_add_rms_norm.forward_plan(x, r, w, eps=1e-6, **o)}[family]()
    return plan.launches[0]


def _norm_forward_kernel(family, n_cols, chunk=None, block_m=None):
    """The kernel a norm forward plan (bf16 rows of ``n_cols``, no parameters) launches."""
    return _norm_forward_launch(family, n_cols, chunk, block_m).kernel.fn.__name__


@pytest.mark.parametrize("family", ["rms_norm", "layer_norm", "fused_add_rms_norm"])
def test_norm_forwards_hold_rows_up_to_their_limit_and_chunk_wider_ones(family):
    """bf16 rows are held up to 32768 columns (16 warps; LayerNorm loads w and b after its reductions there) and
    swept in chunks past it; ``chunk`` overrides either way."""
    held_up_to = 32768
    held, chunked = f"_{family}_forward_kernel", f"_{family}_chunked_forward_kernel"
    assert _norm_forward_kernel(family, held_up_to) == held
    assert _norm_forward_kernel(family, held_up_to + 1) == chunked
    assert _norm_forward_kernel(family, 64, chunk=16) == chunked
    assert _norm_forward_kernel(family, 65536, chunk=0) == held
    for chunk in (24, 8, -16):
        with pytest.raises(ValueError, match="chunk must be 0"):
            _norm_forward_kernel(family, 64, chunk=chunk)
    for block_m in (3, 0, -2):  # rows a program, held or chunked: a tl.arange length
        with pytest.raises(ValueError, match="block_m must be a power of two"):
            _norm_forward_kernel(family, 64, chunk=16, block_m=block_m)


@pytest.mark.parametrize("n_cols,kernel", [(16384, "forward"), (16385, "chunked_forward"), (28671, "chunked_forward"),
                                           (28672, "forward"), (32768, "forward"), (32769, "chunked_forward")])
def test_layer_norm_holds_rows_past_16384_columns_only_from_28672(n_cols, kernel):
    """Narrower rows would pad a 32768-wide held block by up to 40%: chunks won there (H100, 4096 x 20496 and
    24576), the held row from 28672 columns (layer_norm._CHUNKED_BY_WIDTH)."""
    assert _norm_forward_kernel("layer_norm", n_cols) == f"_layer_norm_{kernel}_kernel"


@pytest.mark.parametrize("family,dtypes", [
    ("rms_norm", ("float32", "float32", None)), ("rms_norm", ("bfloat16", "bfloat16", "float32")),
    ("fused_add_rms_norm", ("bfloat16", "float32", "bfloat16")),
    ("fused_add_rms_norm", ("float16", "float16", "float32")), ("layer_norm", ("float32", "float32", None)),
    ("layer_norm", ("bfloat16", "bfloat16", "float32"))])
def test_norms_hold_rows_past_16384_columns_only_with_2_byte_operands(family, dtypes):
    """An fp32 weight or residual spilled a held 32768-column row (ptxas, 16 warps: 28-144 bytes a thread), and an
    fp32 x left no register spare: those rows go in chunks past 16384 columns, also at 32768 (where every family
    holds 2-byte rows; LayerNorm chunks 16385 columns whatever the dtypes)."""
    assert _norm_forward_launch(family, 16384, dtypes=dtypes).kernel.fn.__name__ == f"_{family}_forward_kernel"
    for n_cols in (16385, 32768):
        wider = _norm_forward_launch(family, n_cols, dtypes=dtypes).kernel.fn.__name__
        assert wider == f"_{family}_chunked_forward_kernel", n_cols
    half = tuple(None if d is None else "float16" for d in dtypes)
    assert _norm_forward_launch(family, 32768, dtypes=half).kernel.fn.__name__ == f"_{family}_forward_kernel"


@pytest.mark.parametrize("n_cols,warps", [(4096, 4), (16384, 8), (16385, 16), (32768, 16)])
def test_a_held_row_past_16384_columns_gets_16_warps(n_cols, warps):
    """64 fp32 values a thread at 32768 columns: at 8 warps ptxas took 225 registers, one program an SM."""
    assert _norm_forward_launch("rms_norm", n_cols).num_warps == warps


def _norm_backward_kernels(family, n_cols, column_block=None):
    """The kernels a norm backward plan (bf16 rows of ``n_cols``, with a weight) launches."""
    from liger_core import fused_add_rms_norm, layer_norm, rms_norm

    x, w = ArrayInfo.contiguous((2, n_cols), "bfloat16"), ArrayInfo.contiguous((n_cols,), "bfloat16")
    plan = {"rms_norm": lambda: rms_norm.backward_plan(x, x, w, num_sms=132, column_block=column_block),
            "layer_norm": lambda: layer_norm.backward_plan(x, x, w, None, num_sms=132, column_block=column_block),
            "fused_add_rms_norm": lambda: fused_add_rms_norm.backward_plan(
                x, None, x, w, x_dtype="bfloat16", residual_dtype="bfloat16", num_sms=132,
                column_block=column_block)}[family]()
    return [launch.kernel.fn.__name__ for launch in plan.launches], plan.launches


@pytest.mark.parametrize("family", ["rms_norm", "layer_norm", "fused_add_rms_norm"])
def test_norm_backwards_split_rows_over_16384_columns_into_column_blocks(family):
    """Whole-row tiles up to 16384 columns; past them a row-sums launch, then 4096-column blocks on a third grid
    axis; ``column_block`` overrides either way, and must be 0 or a power of two."""
    kernels, _ = _norm_backward_kernels(family, 16384)
    assert len(kernels) == 2 and "row_" not in kernels[0], kernels
    kernels, launches = _norm_backward_kernels(family, 16385)
    assert len(kernels) == 3 and "row_" in kernels[0], kernels
    assert launches[1].grid[2] == 5 and launches[1].constexprs["BLOCK_N"] == 4096
    assert launches[1].grid[0] * launches[1].grid[2] <= 132  # one persistent program an SM
    assert "row_" in _norm_backward_kernels(family, 64, column_block=16)[0][0]
    assert "row_" not in _norm_backward_kernels(family, 65536, column_block=0)[0][0]
    for column_block in (24, 8, -16):
        with pytest.raises(ValueError, match="column_block must be 0"):
            _norm_backward_kernels(family, 64, column_block=column_block)


def test_rows_whose_columns_span_2_31_elements_do_not_fold():
    """The kernels index a row's columns in int32 (col * col_stride): a transposed view of a huge array, its
    columns strided by the row count, is refused (the torch frontend copies it; a plan raises, naming it)
    from (n_cols - 1) * col_stride >= 2**31 on, and kept below."""
    from liger_core import rms_norm

    below, at = 2**31 // 4095, 2**31 // 4095 + 1  # (4096 - 1) * stride just under / at 2**31
    assert collapse_rows(ArrayInfo((below, 4096), (1, below), "bfloat16")) == (below, 4096, 1, below)
    assert collapse_rows(ArrayInfo((at, 4096), (1, at), "bfloat16")) is None
    with pytest.raises(ValueError, match=r"x's leading dimensions .* 2\*\*31 elements"):
        rms_norm.forward_plan(ArrayInfo((at, 4096), (1, at), "bfloat16"), None, eps=1e-6)


def test_torch_copies_a_view_whose_columns_span_2_31_elements():
    torch = pytest.importorskip("torch")
    from liger_torch._launch import rowwise

    huge = torch.empty((4096, 600_000), device="meta", dtype=torch.bfloat16).t()  # no memory: meta tensors
    assert rowwise(huge).is_contiguous()
    kept = torch.empty((4096, 500_000), device="meta", dtype=torch.bfloat16).t()
    assert rowwise(kept).stride() == (1, 500_000)


def test_by_width_takes_the_first_entry_the_row_reaches():
    from liger_core.launch import by_width

    table = ((65536, "wide"), (32000, "mid"))
    assert [by_width(table, n) for n in (65536, 70000, 65535, 32000)] == ["wide", "wide", "mid", "mid"]
    assert by_width(table, 31999) is None and by_width(table, 31999, "narrow") == "narrow"


def test_vectors_and_heads_whose_elements_span_2_31_elements_are_refused():
    """Parameter vectors (norm weight and bias, class weights) and RoPE's head_dim axis are indexed in int32
    (col * stride) too: a view strided past 2**31 elements is a ValueError naming it, not a wild read; a stride
    just below is planned."""
    from liger_core import cross_entropy, layer_norm, rms_norm, rope

    x = ArrayInfo((7, 4096), (4096, 1), "float32")
    below, at = 2**31 // 4095, 2**31 // 4095 + 1

    def vector(stride, n=4096):
        return ArrayInfo((n,), (stride,), "float32")

    rms_norm.forward_plan(x, vector(below), eps=1e-6)
    layer_norm.forward_plan(x, vector(below), vector(below), eps=1e-6)
    cross_entropy.forward_plan(x, ArrayInfo((7,), (1,), "int64"), vector(below))
    for plan, name in ((lambda: rms_norm.forward_plan(x, vector(at), eps=1e-6), "weight"),
                       (lambda: rms_norm.backward_plan(x, x, vector(at), num_sms=132), "weight"),
                       (lambda: layer_norm.forward_plan(x, vector(1), vector(at), eps=1e-6), "bias"),
                       (lambda: cross_entropy.forward_plan(x, ArrayInfo((7,), (1,), "int64"), vector(at)),
                        "weight")):
        with pytest.raises(ValueError, match=rf"^{name}'s last dimension \(4096 elements strided by {at}\)"):
            plan()

    q = ArrayInfo((2, 4, 8, 128), (4096, 1024, 128, 1), "float32")  # (B, H, T, D)
    table = ArrayInfo((8, 128), (128, 1), "float32")
    rope.forward_plan(q, q, table, table, head_axis=1)
    d_strided = ArrayInfo((2, 4, 8, 128), (1, 2, 8, 2**31 // 127 + 1), "float32")  # head_dim outermost in memory
    for args, name in (((d_strided, q, table, table), "q"), ((q, d_strided, table, table), "k")):
        with pytest.raises(ValueError, match=rf"^{name}'s last dimension"):
            rope.forward_plan(*args, head_axis=1)
    strided_table = ArrayInfo((8, 128), (1, 2**31 // 127 + 1), "float32")
    with pytest.raises(ValueError, match=r"^cos's last dimension"):
        rope.forward_plan(q, q, strided_table, strided_table, head_axis=1)


def test_grids_past_cuda_axis_limits():
    """A launch whose grid exceeds CUDA's limits (65535 on axes 1 and 2) is a ValueError when planned, never a
    failed launch; KL divergence over a flattened 1.2G-element array (73k forward chunks, 293k backward blocks)
    plans one grid axis."""
    from liger_core import kl_div

    with pytest.raises(ValueError, match=r"grid \(1, 65536\) exceeds CUDA's limits"):
        Launch(kernel=None, grid=(1, 65536), args=(), outputs=())
    Launch(kernel=None, grid=(2**31 - 1, 65535, 65535), args=(), outputs=())
    from liger_core import rms_norm

    with pytest.raises(ValueError, match="a vmapped batch of 70000 blocks is more than the 65535"):
        rms_norm.backward_plan(*[ArrayInfo((70000, 8), (8, 1), "float32")] * 2, None, num_sms=132, groups=70000)
    flat = ArrayInfo((1_200_000_000,), (1,), "float32")
    for plan in (kl_div.forward_plan(flat, flat, reduction="sum"),
                 kl_div.forward_plan(flat, flat, reduction="none"),
                 kl_div.backward_plan(ArrayInfo((), (), "float32"), flat, flat, reduction="sum")):
        main = plan.launches[0]
        assert len(main.grid) == 1 and main.constexprs["FLAT_GRID"], main.grid


def test_option_checks_name_the_remedy_for_a_traced_value():
    """A jax tracer passed as a scalar option (an option made an argument of a jitted function) gets the remedy
    in its TypeError; a plain wrong value does not."""
    from liger_core.launch import as_real, check_int

    jax = pytest.importorskip("jax")
    for check, name in ((as_real, "label_smoothing"), (check_int, "ignore_index")):
        with pytest.raises(TypeError, match=rf"^{name} must be .* pass a Python number \(static under jax.jit\)"):
            jax.jit(lambda v: check(v, name))(1)
        with pytest.raises(TypeError) as info:
            check("1", name)
        assert "static" not in str(info.value)


def test_a_kernel_taking_align_must_list_its_aligned_arguments():
    """ALIGN comes from the kernel's ``name = aligned(name, ALIGN)`` lines (launch.aligned_args); a kernel that
    hands its strides to a helper instead has none, and alignment() of nothing would claim 16 for any stride
    (wrong gradients from a 123-column row, seen with such a helper): the Launch refuses it."""
    import triton
    import triton.language as tl

    from liger_core.tl_math import aligned

    @triton.jit
    def hidden_strides(X, row_stride, ALIGN: tl.constexpr):
        strides = (aligned(row_stride, ALIGN),)
        tl.store(X + strides[0], 0.0)

    @triton.jit
    def listed_strides(X, row_stride, ALIGN: tl.constexpr):
        row_stride = aligned(row_stride, ALIGN)
        tl.store(X + row_stride, 0.0)

    with pytest.raises(AssertionError, match="no `name = aligned"):
        Launch(kernel=hidden_strides, grid=(1,), args=(Buf("x"), 123), outputs=())
    assert Launch(kernel=listed_strides, grid=(1,), args=(Buf("x"), 123), outputs=()).constexprs["ALIGN"] == 1
    assert Launch(kernel=listed_strides, grid=(1,), args=(Buf("x"), 128), outputs=()).constexprs["ALIGN"] == 16
