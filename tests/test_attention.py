"""Paged attention: the decode kernel and the gather fallback agree with dense attention, for GQA,
ragged lengths and scattered block tables; mixed prefill + decode batches take both paths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stateserve.layers import cpu_kernels
from stateserve.layers.attention import Attention


def dense(q, k, v, scale):
    # q: [H, D]; k, v: [L, KH, D]
    rep = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = (torch.einsum("hd,lhd->hl", q.float(), k.float()) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", w, v.float())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("D", [16, 24, 64, 128])  # 64, 128: AVX-512 with rows in registers; 16: AVX-512 with a
# run-time width; 24: the portable path
def test_decode_paths_match_dense(dtype, tol, heads, kv_heads, D):
    g = torch.Generator().manual_seed(0)
    bs, nb = 4, 32
    attn = Attention(heads, kv_heads, D, D ** -0.5, dtype)
    kc = torch.randn(nb, bs, kv_heads, D, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, D, generator=g).to(dtype)
    attn.bind_cache(kc, vc)
    lens = torch.tensor([1, 5, 19, 4])  # 19: more than one group of 16 keys, across five blocks
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[i * 5:(i + 1) * 5] for i in range(4)])
    q = torch.randn(4, heads, D, generator=g).to(dtype)
    ref = []
    for i in range(4):
        blocks = tables[i, :-(-int(lens[i]) // bs)]
        k = kc[blocks].flatten(0, 1)[:lens[i]]
        v = vc[blocks].flatten(0, 1)[:lens[i]]
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
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_prefill_chunk_after_cached_context_matches_dense(dtype, tol, heads, kv_heads):
    """A later chunk of a prompt (context already in the paged cache): the CPU path merges flash attention over
    the context and over the chunk by log-sum-exp; it must equal one causal attention over the whole prompt."""
    from stateserve.layers.metadata import AttnMetadata

    g = torch.Generator().manual_seed(3)
    D, bs, ctx, qlen = 16, 4, 9, 6  # the context ends inside a block
    total = ctx + qlen
    attn = Attention(heads, kv_heads, D, D ** -0.5, dtype)
    kc, vc = torch.zeros(8, bs, kv_heads, D, dtype=dtype), torch.zeros(8, bs, kv_heads, D, dtype=dtype)
    attn.bind_cache(kc, vc)
    q = torch.randn(total, heads, D, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    table = torch.tensor([[5, 2, 7, 0]])  # scattered blocks
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(total)])
    kc.view(-1, kv_heads, D)[slots[:ctx]] = k[:ctx]  # the context, written by an earlier step
    vc.view(-1, kv_heads, D)[slots[:ctx]] = v[:ctx]
    meta = AttnMetadata(query_start_loc=[0, qlen], query_lens=[qlen], context_lens=[ctx], seq_lens=[total],
                        is_decode_only=False, slot_mapping=slots[ctx:], block_tables=table, prefill_seqs=[0])
    out = attn(q[ctx:], k[ctx:], v[ctx:], meta)
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().repeat_interleave(rep, 1).transpose(0, 1),
                                         v.float().repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                         scale=D ** -0.5).transpose(0, 1)[ctx:]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # the context really is read: attending to the chunk alone gives something else
    alone = F.scaled_dot_product_attention(q[ctx:].float().transpose(0, 1),
                                           k[ctx:].float().repeat_interleave(rep, 1).transpose(0, 1),
                                           v[ctx:].float().repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                           scale=D ** -0.5).transpose(0, 1)
    assert not torch.allclose(out.float(), alone, atol=tol)
