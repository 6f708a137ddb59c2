"""liger_torch.rope against HF's own apply_rotary_pos_emb (and a GPT-J formula) in float64, forward and backward."""

import pytest
import torch

import liger_torch
from helpers import assert_close

modeling = pytest.importorskip("transformers.models.llama.modeling_llama")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def gather(table, position_ids, batch):
    """Rows ``position_ids[b, t]`` of a (T, D) / (1 or B, T, D) table -> (B, T, D)."""
    if table.dim() == 2:
        table = table[None]
    if position_ids is None:
        return table.expand(batch, -1, -1)
    pos = position_ids if position_ids.dim() == 2 else position_ids[None]
    pos = pos.expand(batch, -1)
    return table.expand(batch, -1, -1)[torch.arange(batch)[:, None], pos]


def reference(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, interleaved=False, in_float64=True):
    """HF's apply_rotary_pos_emb (or the interleaved GPT-J formula) on float64 copies of the inputs, or
    (``in_float64=False``) on the inputs themselves: HF's eager rounding, which the kernel reproduces bitwise."""
    if in_float64:
        q, k, cos, sin = q.double(), k.double(), cos.double(), sin.double()
    c = gather(cos, position_ids, q.shape[0])
    s = gather(sin, position_ids, q.shape[0])
    if not interleaved:
        return modeling.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=unsqueeze_dim)
    c, s = c.unsqueeze(unsqueeze_dim), s.unsqueeze(unsqueeze_dim)
    return q * c + rotate_every_two(q) * s, k * c + rotate_every_two(k) * s


def hf_tables(batch, seq, dim, dtype, gen, offset=0):
    """cos/sin as HF's rotary embedding builds them (both halves equal), possibly at shifted positions."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    pos = torch.arange(seq, dtype=torch.float64)[None] + offset + torch.randint(0, 50, (batch, 1), generator=gen)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def run(fn, q, k, gq, gk, *args, **kwargs):
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    qo, ko = fn(q, k, *args, **kwargs)
    torch.autograd.backward((qo, ko), (gq, gk))
    return qo, ko, q.grad, k.grad


RESULT_NAMES = ("q_embed", "k_embed", "dq", "dk")


def term_sizes(q, k, cos, sin, gq, gk, **kwargs):
    """|cos term| + |sin term| of each result of ``run(reference, ...)``, in float64. HF rounds each product to
    the dtype before it adds the two, so a result's rounding error scales with its terms, which may cancel to a
    far smaller sum (arbitrary tables, or a rotation's two halves)."""
    parts = [run(reference, q, k, gq.double(), gk.double(), c, s, **kwargs)
             for c, s in ((cos, torch.zeros_like(sin)), (torch.zeros_like(cos), sin))]
    return [a.detach().abs() + b.detach().abs() for a, b in zip(*parts)]


def check_against_references(ours, q, k, cos, sin, gq, gk, dtype, **kwargs):
    """``ours`` (the results of ``run(liger_torch.rope, ...)``) against HF's formula in float64, bounded by the
    size of the terms, and, for half-precision results, bit for bit against HF's formula run in the inputs'
    dtypes (fp32 results may differ in the last bit: the GPU contracts a product and the sum into one FMA)."""
    want = run(reference, q, k, gq.double(), gk.double(), cos, sin, **kwargs)
    sizes = term_sizes(q, k, cos, sin, gq, gk, **kwargs)
    hf = run(reference, q, k, gq.clone(), gk.clone(), cos, sin, in_float64=False, **kwargs)
    for got, ref, size, eager, name in zip(ours, want, sizes, hf, RESULT_NAMES):
        assert_close(got, ref, dtype, name, magnitude=size)
        if got.dtype != torch.float32:
            assert got.dtype == eager.dtype and torch.equal(got, eager), f"{name}: not bitwise HF's eager result"


def check(q, k, cos, sin, dtype, gen, **kwargs):
    out_shape_q, out_shape_k = q.shape, k.shape
    gq = torch.randn(out_shape_q, generator=gen).to(q.device, torch.promote_types(q.dtype, cos.dtype))
    gk = torch.randn(out_shape_k, generator=gen).to(q.device, torch.promote_types(k.dtype, cos.dtype))
    ours = run(liger_torch.rope, q, k, gq.clone(), gk.clone(), cos, sin, **kwargs)
    assert ours[0].dtype == torch.promote_types(q.dtype, cos.dtype) and ours[2].dtype == q.dtype
    check_against_references(ours, q, k, cos, sin, gq, gk, dtype, **kwargs)


# (B, T, D) with (H_q, H_kv): 1 token, 7 tokens, head_dim 64 / 128 / 96 (not a power of 2), GQA ratios 1, 4, 8;
# 123 tokens with 6 / 3 heads: several token blocks and head groups per program grid, the last of each partial.
CASES = [((1, 1, 64), (4, 4)), ((1, 7, 128), (8, 2)), ((2, 3, 96), (8, 1)), ((1, 7, 64), (16, 2)),
         ((2, 123, 64), (6, 3))]


@pytest.mark.parametrize("shape,heads", CASES, ids=[f"{s}-{h}" for s, h in CASES])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward(shape, heads, interleaved, dtype, device, seed):
    batch, seq, dim = shape
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    q = torch.randn(batch, hq, seq, dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, hk, seq, dim, generator=gen).to(device, dtype)
    cos, sin = hf_tables(batch, seq, dim, dtype, gen)
    check(q, k, cos.to(device), sin.to(device), dtype, gen, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
def test_arbitrary_cos_sin_use_the_transposed_map(interleaved, device, seed):
    """cos/sin whose halves differ (not a rotation): the backward is the exact transpose, not sin -> -sin."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 5, 16, generator=gen).to(device)
    k = torch.randn(2, 1, 5, 16, generator=gen).to(device)
    cos = torch.randn(2, 5, 16, generator=gen).to(device)
    sin = torch.randn(2, 5, 16, generator=gen).to(device)
    check(q, k, cos, sin, torch.float32, gen, interleaved=interleaved)


@pytest.mark.parametrize("pos_shape,table_batch", [("bt", 1), ("bt", 2), ("1t", 2), ("t", 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_ids_gather_rows(pos_shape, table_batch, dtype, device, seed):
    """position_ids that are not 0..T-1 (shuffled, repeated, offset) pick rows of longer cos/sin tables."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq, dim, table = 2, 4, 64, 23
    q = torch.randn(batch, 4, seq, dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, 2, seq, dim, generator=gen).to(device, dtype)
    cos, sin = hf_tables(max(table_batch, 1), table, dim, dtype, gen)
    if table_batch == 0:
        cos, sin = cos[0], sin[0]
    shape = {"bt": (batch, seq), "1t": (1, seq), "t": (seq,)}[pos_shape]
    position_ids = torch.randint(0, table, shape, generator=gen)
    assert not torch.equal(position_ids.reshape(-1, seq)[0], torch.arange(seq))
    check(q, k, cos.to(device), sin.to(device), dtype, gen, position_ids=position_ids.to(device))


def test_bthd_layout_with_unsqueeze_dim_2(device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 7, 8, 64, generator=gen).to(device)
    k = torch.randn(2, 7, 1, 64, generator=gen).to(device)
    cos, sin = hf_tables(2, 7, 64, torch.float32, gen)
    check(q, k, cos.to(device), sin.to(device), torch.float32, gen, unsqueeze_dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype, device, seed):
    """HF's q/k are transposes of (B, T, H, D) projections; here also a head_dim slice and strided cos/sin."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 7, 8, 64, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(2, 7, 2, 96, generator=gen).to(device, dtype)[..., 16:80].transpose(1, 2)
    cos, sin = hf_tables(2, 14, 64, dtype, gen)
    cos, sin = cos.to(device)[:, ::2], sin.to(device)[:, 1::2]
    assert not (q.is_contiguous() or k.is_contiguous() or cos.is_contiguous())
    check(q, k, cos, sin, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_keep_the_inputs_layout(dtype, device, seed):
    """As HF's elementwise formula does (its outputs keep q's memory format): a transposed (B, T, H, D) buffer
    gives embeddings laid out as (B, T, H, D) too, which attention reads without a copy; a sliced (not dense) k
    gives a contiguous output. Values are checked by test_non_contiguous_inputs."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 7, 8, 64, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(2, 7, 2, 96, generator=gen).to(device, dtype)[..., 16:80].transpose(1, 2)
    cos, sin = (t.to(device) for t in hf_tables(2, 7, 64, dtype, gen))
    q_embed, k_embed = liger_torch.rope(q, k, cos, sin)
    hf_q, _ = reference(q, k, cos, sin)
    assert q_embed.stride() == hf_q.stride() == q.stride()
    assert k_embed.is_contiguous()
    assert_close(q_embed, hf_q, dtype, "q_embed")


def test_mixed_dtypes_follow_hf_promotion(device, seed):
    """bf16 q/k with fp32 cos/sin: HF returns fp32 embeddings; the gradients come back in bf16."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 7, 64, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(1, 1, 7, 64, generator=gen).to(device, torch.bfloat16)
    cos, sin = hf_tables(1, 7, 64, torch.float32, gen)
    check(q, k, cos.to(device), sin.to(device), torch.bfloat16, gen)


def test_in_place_backward_writes_over_grads_and_is_optional(device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 7, 64, generator=gen).to(device).requires_grad_(True)
    k = torch.randn(2, 2, 7, 64, generator=gen).to(device).requires_grad_(True)
    cos, sin = (t.to(device) for t in hf_tables(2, 7, 64, torch.float32, gen))
    gq, gk = torch.randn(q.shape, generator=gen).to(device), torch.randn(k.shape, generator=gen).to(device)
    for in_place in (True, False):
        q.grad = k.grad = None
        gq_in, gk_in = gq.clone(), gk.clone()
        torch.autograd.backward(liger_torch.rope(q, k, cos, sin, in_place=in_place), (gq_in, gk_in))
        assert torch.equal(gq_in, q.grad) == in_place and torch.equal(gk_in, k.grad) == in_place
        assert torch.equal(gq_in, gq) != in_place


def test_expanded_and_missing_grads(device, seed):
    """q_embed.sum() hands in a stride-0 gradient (not written in place); k_embed unused: dk is zero."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 7, 64, generator=gen).to(device).requires_grad_(True)
    k = torch.randn(2, 2, 7, 64, generator=gen).to(device).requires_grad_(True)
    cos, sin = (t.to(device) for t in hf_tables(2, 7, 64, torch.float32, gen))
    liger_torch.rope(q, k, cos, sin)[0].sum().backward()
    ref_q = q.detach().double().requires_grad_(True)
    reference(ref_q, k.detach(), cos, sin)[0].sum().backward()
    assert_close(q.grad, ref_q.grad, torch.float32, "dq")
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_matches_hf_in_a_llama_attention_shape(device, seed):
    """cos/sin straight from transformers' LlamaRotaryEmbedding, bf16, GQA 4."""
    config = modeling.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64)
    rotary = modeling.LlamaRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 256, generator=gen).to(torch.bfloat16)
    position_ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 10, 11, 12, 40]])
    cos, sin = rotary(x, position_ids)
    q = torch.randn(2, 4, 7, 64, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(2, 1, 7, 64, generator=gen).to(device, torch.bfloat16)
    check(q, k, cos.to(device), sin.to(device), torch.bfloat16, gen)


def _args(device, **over):
    base = dict(q=torch.randn(2, 4, 7, 64, device=device), k=torch.randn(2, 2, 7, 64, device=device),
                cos=torch.randn(2, 7, 64, device=device), sin=torch.randn(2, 7, 64, device=device))
    base.update({name: value(device) for name, value in over.items()})
    return base


@pytest.mark.parametrize("over,error,match", [
    (dict(cos=lambda d: torch.randn(2, 6, 64, device=d), sin=lambda d: torch.randn(2, 6, 64, device=d)),
     ValueError, "cos has 6 positions but q has 7 tokens"),
    (dict(q=lambda d: torch.randn(2, 4, 7, 63, device=d), k=lambda d: torch.randn(2, 2, 7, 63, device=d),
          cos=lambda d: torch.randn(2, 7, 63, device=d), sin=lambda d: torch.randn(2, 7, 63, device=d)),
     ValueError, "head_dim .* must be even"),
    (dict(k=lambda d: torch.randn(3, 2, 7, 64, device=d)), ValueError, "k must have q's batch size"),
    (dict(k=lambda d: torch.randn(2, 2, 5, 64, device=d)), ValueError, "k must have q's sequence length"),
    (dict(k=lambda d: torch.randn(2, 2, 7, 32, device=d)), ValueError, "k must have q's head_dim"),
    (dict(q=lambda d: torch.randn(2, 7, 64, device=d)), ValueError, "q must be 4-d"),
    (dict(sin=lambda d: torch.randn(1, 7, 64, device=d)), ValueError, "sin must have the shape of cos"),
    (dict(sin=lambda d: torch.randn(2, 7, 64, device=d, dtype=torch.float16)), TypeError, "sin must have cos's dtype"),
    (dict(cos=lambda d: torch.randn(2, 7, 32, device=d), sin=lambda d: torch.randn(2, 7, 32, device=d)),
     ValueError, "cos must have q's head_dim"),
    (dict(cos=lambda d: torch.randn(3, 7, 64, device=d), sin=lambda d: torch.randn(3, 7, 64, device=d)),
     ValueError, "cos's batch dimension"),
    (dict(q=lambda d: torch.ones(2, 4, 7, 64, device=d, dtype=torch.int32)), TypeError, "q must have a floating"),
    (dict(k=lambda d: torch.randn(2, 0, 7, 64, device=d)), ValueError, "k must not be empty"),
    (dict(position_ids=lambda d: torch.zeros(2, 7, device=d)), TypeError, "position_ids must have an integer"),
    (dict(position_ids=lambda d: torch.zeros(2, 6, dtype=torch.long, device=d)), ValueError, "position_ids must have shape"),
    (dict(cos=lambda d: [1.0]), TypeError, "cos must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(over, error, match, device):
    with pytest.raises(error, match=match):
        liger_torch.rope(**_args(device, **over))


def test_bad_unsqueeze_dim_and_cos_with_grad(device):
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        liger_torch.rope(**_args(device), unsqueeze_dim=3)
    args = _args(device)
    args["cos"].requires_grad_(True)
    with pytest.raises(ValueError, match="^cos requires grad, but liger_torch.rope differentiates q and k only"):
        liger_torch.rope(**args)
    with torch.no_grad():
        liger_torch.rope(**args)


@pytest.mark.parametrize("groups_per_program", [2, 4, 64])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("positions", [False, True])
def test_several_head_groups_per_program_give_the_same_bits(groups_per_program, interleaved, positions, monkeypatch,
                                                            request, device, seed):
    """Programs rotating several head groups in turn with one cos/sin tile (the tuning knob of
    scripts/tune_rope.py; 6 q + 3 k heads are 5 groups, so the last program's block is partial) write exactly
    what one group per program writes, forward and backward, with and without position ids (the tile is then
    converted before the head loop instead of in each group)."""
    import liger_core.rope

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, 37, 64, generator=gen).to(device)
    k = torch.randn(2, 3, 37, 64, generator=gen).to(device)
    gq, gk = torch.randn(q.shape, generator=gen).to(device), torch.randn(k.shape, generator=gen).to(device)
    cos, sin = hf_tables(2, 37 + 5 * positions, 64, torch.float32, gen)
    extra = dict(position_ids=torch.randint(0, 42, (2, 37), generator=gen).to(device)) if positions else {}
    results = []
    monkeypatch.setattr(liger_core.rope, "_MIN_PROGRAMS", 1)  # these few tokens would split the heads again
    request.addfinalizer(liger_core.rope._plan.cache_clear)  # no plan of these settings outlives the test
    for groups in (1, groups_per_program):
        monkeypatch.setattr(liger_core.rope, "_GROUPS_PER_PROGRAM", groups)
        liger_core.rope._plan.cache_clear()  # plans are cached by their arguments, not by module settings
        results.append(run(liger_torch.rope, q, k, gq.clone(), gk.clone(), cos.to(device), sin.to(device),
                           interleaved=interleaved, **extra))
    for a, b in zip(*results):
        assert torch.equal(a, b)
