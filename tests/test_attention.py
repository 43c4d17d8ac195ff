"""Paged attention: the decode kernel and the gather fallback agree with dense attention, for GQA,
ragged lengths and scattered block tables; mixed prefill + decode batches take both paths."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from stateserve.layers.attention import Attention
from stateserve.platform import cpu_kernels, kernels as kernel_table


def dense(q, k, v, scale):
    # q: [H, D]; k, v: [L, KH, D]
    rep = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = (torch.einsum("hd,lhd->hl", q.float(), k.float()) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", w, v.float())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("D", [16, 24, 64, 96, 128])  # 64, 128: AVX-512 with rows in registers; 16, 96: AVX-512
# with a run-time width (bfloat16: 16 the float32-arithmetic path, 96 the vdpbf16ps one); 24: the portable path
# (AVX2, float32 and bfloat16: 64 and 128 with rows in registers, 16, 24 and 96 with a run-time width)
@pytest.mark.parametrize("bs", [4, 16, 24])  # 24: a block holds a full group of 16 keys and a part one
def test_decode_paths_match_dense(dtype, tol, heads, kv_heads, D, bs):
    g = torch.Generator().manual_seed(0)
    nb = 32
    attn = Attention(heads, kv_heads, D, D ** -0.5, dtype)
    kc = torch.randn(nb, kv_heads, bs, D, generator=g).to(dtype)
    vc = torch.randn(nb, kv_heads, bs, D, generator=g).to(dtype)
    attn.bind_cache(kc, vc)
    lens = torch.tensor([1, 5, 19, 4 * bs + 1])  # several groups of 16 keys and blocks; the last one in a 5th block
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[i * 5:(i + 1) * 5] for i in range(4)])
    q = torch.randn(4, heads, D, generator=g).to(dtype)
    ref = []
    for i in range(4):
        blocks = tables[i, :-(-int(lens[i]) // bs)]
        k = kc[blocks].transpose(1, 2).flatten(0, 1)[:lens[i]]  # [L, KH, D]
        v = vc[blocks].transpose(1, 2).flatten(0, 1)[:lens[i]]
        ref.append(dense(q[i], k, v, D ** -0.5))
    ref = torch.stack(ref)
    gathered = attn._decode_gather(q, tables, lens, int(lens.max()))
    torch.testing.assert_close(gathered.float(), ref, atol=tol, rtol=tol)
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("C++ CPU kernels could not be built here")
    out = kernels.paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert not torch.equal(out, kernels.paged_decode_attention(q, kc, vc, tables.roll(1, 0), lens, D ** -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_row_at_its_slot(dtype):
    """New K/V rows land at (block, head, offset) of the [num_blocks, KH, block_size, D] cache, through the C++
    kernel and through the indexing fallback alike; other rows stay untouched; a slot outside the cache is refused."""
    g = torch.Generator().manual_seed(5)
    nb, kv_heads, bs, D, T = 6, 3, 4, 8, 7
    attn = Attention(6, kv_heads, D, D ** -0.5, dtype)
    slots = torch.tensor([21, 0, 5, 7, 13, 22, 3])
    k, v = torch.randn(T, kv_heads, D, generator=g), torch.randn(T, kv_heads, D, generator=g)  # float32 -> cast
    for use_kernel in (True, False):
        kc, vc = torch.full((nb, kv_heads, bs, D), 7.0, dtype=dtype), torch.full((nb, kv_heads, bs, D), 7.0, dtype=dtype)
        attn.bind_cache(kc, vc)
        if use_kernel and cpu_kernels.load() is None:
            continue
        with kernel_table.using(kernel_table.table() if use_kernel else kernel_table.build(None)) as table:
            assert (table.write_kv(dtype) is not None) == use_kernel
            attn.write_kv(k, v, slots)
        expect_k, expect_v = torch.full_like(kc, 7.0), torch.full_like(vc, 7.0)
        for t, slot in enumerate(slots.tolist()):
            expect_k[slot // bs, :, slot % bs] = k[t].to(dtype)
            expect_v[slot // bs, :, slot % bs] = v[t].to(dtype)
        assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    if cpu_kernels.load() is not None:
        with pytest.raises(RuntimeError, match="slot 24 outside the cache"):
            attn.write_kv(k[:1], v[:1], torch.tensor([nb * bs]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_kernel_many_ragged_sequences_and_unwritten_rows(dtype, tol):
    """Thirteen sequences of 1-70 keys (the threads split them by length, not count) over a cache whose unwritten
    rows hold NaN: each output matches dense attention and the same sequence attended alone, bit for bit."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("C++ CPU kernels could not be built here")
    g = torch.Generator().manual_seed(3)
    heads, D, bs = 4, 64, 16
    lens = torch.tensor([70, 1, 33, 2, 64, 17, 5, 48, 15, 3, 31, 9, 16])
    blocks_each = 5
    kc = torch.full((len(lens) * blocks_each, heads, bs, D), float("nan"), dtype=dtype)
    vc = kc.clone()
    tables = torch.randperm(kc.shape[0], generator=g).view(len(lens), blocks_each)
    q = torch.randn(len(lens), heads, D, generator=g).to(dtype)
    ref = []
    for i, n in enumerate(lens.tolist()):
        k, v = torch.randn(n, heads, D, generator=g).to(dtype), torch.randn(n, heads, D, generator=g).to(dtype)
        for t in range(n):
            kc[tables[i, t // bs], :, t % bs], vc[tables[i, t // bs], :, t % bs] = k[t], v[t]
        ref.append(dense(q[i], k, v, D ** -0.5))
    out = kernels.paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), torch.stack(ref), atol=tol, rtol=tol)
    for i in (0, 1, 6, 12):
        alone = kernels.paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1], D ** -0.5)
        assert torch.equal(alone, out[i:i + 1])


def test_prefill_causal_matches_sdpa():
    g = torch.Generator().manual_seed(1)
    H, D, L = 4, 8, 10
    q, k, v = (torch.randn(L, H, D, generator=g) for _ in range(3))
    attn = Attention(H, H, D, D ** -0.5, torch.float32, uses_cache=False)
    from stateserve.layers.metadata import AttnMetadata
    meta = AttnMetadata(query_start_loc=[0, L], query_lens=[L], context_lens=[0], seq_lens=[L],
                        is_decode_only=False)
    out = attn(q, k, v, meta)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,D,bs,ctx,qlen", [
    (12, 12, 64, 16, 0, 37),     # a first chunk; query rows not a multiple of 16
    (8, 2, 128, 4, 9, 21),       # GQA, small blocks, context ending inside a block
    (12, 12, 64, 16, 300, 212),  # long context
    (4, 4, 64, 24, 40, 50),      # blocks of 24 keys: steps of 16 and 8
])
def test_prefill_kernel_matches_dense(dtype, tol, heads, kv_heads, D, bs, ctx, qlen):
    """The C++ causal prefill kernel reads the chunk's keys and its context from scattered cache blocks; q may be a
    strided view (a column slice of the fused projection)."""
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.prefill_attention_supported(dtype, D):
        pytest.skip("no prefill attention kernel in this build")
    g = torch.Generator().manual_seed(7)
    total = ctx + qlen
    nb = -(-total // bs) + 3
    kc = torch.randn(nb, kv_heads, bs, D, generator=g).to(dtype)
    vc = torch.randn(nb, kv_heads, bs, D, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:-(-total // bs)]
    fused = torch.randn(qlen, heads * D + 8, generator=g).to(dtype)
    q = fused[:, 8:].view(qlen, heads, D)  # rows strided
    out = kernels.paged_prefill_attention(q, kc, vc, table, ctx, D ** -0.5)
    rep = heads // kv_heads
    k = kc[table].transpose(0, 1).flatten(1, 2)[:, :total].float().repeat_interleave(rep, 0)
    v = vc[table].transpose(0, 1).flatten(1, 2)[:, :total].float().repeat_interleave(rep, 0)
    visible = torch.arange(total)[None, :] <= torch.arange(qlen)[:, None] + ctx
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=visible,
                                         scale=D ** -0.5).transpose(0, 1)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # one key more per row gives another answer: the causal boundary is where it should be
    one_more = torch.arange(total)[None, :] <= torch.arange(qlen)[:, None] + ctx + 1
    off_by_one = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=one_more,
                                                scale=D ** -0.5).transpose(0, 1)
    assert not torch.allclose(out.float(), off_by_one, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("D", [16, 64])  # 16: PyTorch's flash kernel (merged by log-sum-exp); 64: the C++ kernel
@pytest.mark.parametrize("key_limit", [None, 12])  # 12: below the sequence's 15 keys
def test_prefill_chunk_after_cached_context_matches_dense(dtype, tol, heads, kv_heads, D, key_limit, monkeypatch):
    """A later chunk of a prompt (context already in the paged cache): the CPU path merges flash attention over
    the context and over the chunk by log-sum-exp; it must equal one causal attention over the whole prompt.
    The C++ kernel takes sequences of up to the kernel table's prefill_max_keys (PREFILL_KERNEL_MAX_KEYS_8_LANES
    with AVX2, no limit with AVX-512), longer ones the flash path."""
    from stateserve.layers.metadata import AttnMetadata

    flash_calls = []
    flash = Attention._prefill_with_context_cpu
    monkeypatch.setattr(Attention, "_prefill_with_context_cpu",
                        lambda self, *args: flash_calls.append(1) or flash(self, *args))
    table = kernel_table.table()
    if key_limit is not None:
        table = dataclasses.replace(table, prefill_max_keys=key_limit)

    g = torch.Generator().manual_seed(3)
    bs, ctx, qlen = 4, 9, 6  # the context ends inside a block
    total = ctx + qlen
    attn = Attention(heads, kv_heads, D, D ** -0.5, dtype)
    kc, vc = torch.zeros(8, kv_heads, bs, D, dtype=dtype), torch.zeros(8, kv_heads, bs, D, dtype=dtype)
    attn.bind_cache(kc, vc)
    q = torch.randn(total, heads, D, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    blocks = torch.tensor([[5, 2, 7, 0]])  # scattered blocks
    slots = torch.tensor([int(blocks[0, p // bs]) * bs + p % bs for p in range(total)])
    for p in range(ctx):  # the context, written by an earlier step
        kc[int(blocks[0, p // bs]), :, p % bs] = k[p]
        vc[int(blocks[0, p // bs]), :, p % bs] = v[p]
    meta = AttnMetadata(query_start_loc=[0, qlen], query_lens=[qlen], context_lens=[ctx], seq_lens=[total],
                        is_decode_only=False, slot_mapping=slots[ctx:], block_tables=blocks, prefill_seqs=[0])
    with kernel_table.using(table):
        out = attn(q[ctx:], k[ctx:], v[ctx:], meta)
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().repeat_interleave(rep, 1).transpose(0, 1),
                                         v.float().repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                         scale=D ** -0.5).transpose(0, 1)[ctx:]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    kernel_takes_it = table.prefill_attention(dtype, dtype, D) is not None and key_limit is None
    assert flash_calls == ([] if kernel_takes_it else [1])
    # the context really is read: attending to the chunk alone gives something else
    alone = F.scaled_dot_product_attention(q[ctx:].float().transpose(0, 1),
                                           k[ctx:].float().repeat_interleave(rep, 1).transpose(0, 1),
                                           v[ctx:].float().repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                           scale=D ** -0.5).transpose(0, 1)
    assert not torch.allclose(out.float(), alone, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [48, 64])  # 48: a head size the prefill kernel does not take
def test_verify_rows_attend_as_one_token_decodes(dtype, D):
    """A step verifying drafts attends each row of its chunk as the one-token decode step that row replaces (same
    kernel, row r seeing its context and rows 0..r): bit for bit what plain decoding computes at that position, in a
    step that also decodes one sequence and prefills another."""
    from types import SimpleNamespace

    from stateserve.core.batch import InputBatch
    from stateserve.model_states.default import build_paged_attn_metadata

    g, bs, heads, kv_heads = torch.Generator().manual_seed(0), 16, 4, 2
    attn = Attention(heads, kv_heads, D, D ** -0.5, dtype)
    attn.bind_cache(torch.zeros(24, kv_heads, bs, D, dtype=dtype), torch.zeros(24, kv_heads, bs, D, dtype=dtype))
    reqs = [SimpleNamespace(block_ids=[0, 1], num_released_blocks=0),  # decodes: 20 cached + 1
            SimpleNamespace(block_ids=[5, 3, 9], num_released_blocks=0),  # verifies: 33 cached + 1 + 4 drafts
            SimpleNamespace(block_ids=[7], num_released_blocks=0)]  # prefills 7 tokens
    for req, n in zip(reqs, (20, 33, 0)):  # the cached context
        slots = torch.tensor([req.block_ids[p // bs] * bs + p % bs for p in range(n)], dtype=torch.long)
        attn.write_kv(torch.randn(n, kv_heads, D, generator=g).to(dtype), torch.randn(n, kv_heads, D, generator=g)
                      .to(dtype), slots)

    def batch(context_lens, query_lens, drafts):
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return InputBatch(requests=reqs[:len(query_lens)], query_lens=query_lens, context_lens=context_lens,
                          query_start_loc=starts, input_ids=torch.zeros(starts[-1], dtype=torch.long),
                          positions=torch.zeros(starts[-1], dtype=torch.long), sample_indices=list(range(len(drafts))),
                          logits_indices=torch.zeros(0, dtype=torch.long), num_drafts=drafts)

    meta = build_paged_attn_metadata(batch([20, 33, 0], [1, 5, 7], [0, 4, 0]), bs, torch.device("cpu"))
    assert meta.decode_rows.tolist() == [0, 1, 2, 3, 4, 5] and meta.prefill_seqs == [2]
    assert meta.decode_seq_lens.tolist() == [21, 34, 35, 36, 37, 38]
    q = torch.randn(13, heads, D, generator=g).to(dtype)
    k, v = (torch.randn(13, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    out = attn.forward(q, k, v, meta)
    for r in range(5):  # the verified rows, one decode step each (its key already in the cache)
        one = build_paged_attn_metadata(batch([20, 33 + r], [1, 1], [0, 0]), bs, torch.device("cpu"))
        assert one.is_decode_only
        rows = torch.tensor([0, 1 + r])
        alone = attn.forward(q[rows], k[rows], v[rows], one)
        assert torch.equal(alone[1], out[1 + r]), r
    assert torch.equal(alone[0], out[0])
