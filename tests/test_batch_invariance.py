"""A request's bfloat16 decode does not depend on what it is batched with, nor on speculation: every linear sums
each output in one order whatever its row count (the few-row kernel of csrc/linear.cpp, which one or two decoding
rows take, and the panel kernel of csrc/packed_linear.cpp, which more rows take, agree bit for bit; MoE experts,
which get any number of tokens, take the few-row kernel), and verify rows attend as one-token decodes. So a request
decoded alone, in a batch of six, or with drafts verified in steps of five rows gets the same tokens and the same
logprobs, exactly. bfloat16 is where this shows: its rounding of
every activation turns a last-bit difference in a sum into a different token after a few dozen steps."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from stateserve import LLM
from stateserve.config import EngineConfig
from stateserve.layers.linear import install_fast_linear, make_batch_invariant
from stateserve.platform import cpu_kernels
from test_bamba import _build as bamba
from test_jamba import _build as jamba
from test_kimi_linear import _build as kimi_linear
from test_llama import _build as llama_or_qwen2
from test_mamba2 import _build as mamba2
from test_qwen3_next import _build as qwen3_next
from test_spec_decode import PROMPTS, OracleProposer, greedy, run

ARCHS = {
    # in_features 96, 192 and 200: chains of the panel kernel of unequal lengths (200 / 2 = 100 k-steps, 16 chains)
    "llama": lambda t: llama_or_qwen2("llama", t, hidden_size=96, intermediate_size=200),
    "mamba2": lambda t: mamba2(t, hidden_size=96, num_heads=12),
    "bamba": lambda t: bamba(t, hidden_size=96, intermediate_size=200, mamba_n_heads=12),
    "jamba": lambda t: jamba(t, hidden_size=96, intermediate_size=200),  # Mamba1 + MoE
    "qwen3_next": lambda t: qwen3_next(t, hidden_size=96, intermediate_size=200),  # gated delta net + MoE
    # KDA + MLA (its decode attention over the latent rows: each sequence alone) + MoE
    "kimi_linear": lambda t: kimi_linear(t, hidden_size=96, intermediate_size=200),
}
ALONE = PROMPTS[:2]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llm(path: str, **kw) -> LLM:
    # one prefill chunk per prompt in every run: the prompts' states are then computed alike, and what is compared
    # is the decoding
    return LLM(path, skip_tokenizer_init=True, dtype="bfloat16", max_num_batched_tokens=512,
               enable_prefix_caching=False, **kw)


def _assert_identical(got, want) -> None:
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert [{t: lp.logprob for t, lp in step.items()} for step in got.outputs[0].logprobs] == \
        [{t: lp.logprob for t, lp in step.items()} for step in want.outputs[0].logprobs]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_alone_batched_and_speculative_decoding_are_bit_identical(arch, tmp_path):
    _, path = ARCHS[arch](tmp_path)
    with _llm(path, batch_invariant=True) as llm:
        batched = run(llm, greedy())  # decode steps of 3-6 rows: the panel kernel
        alone = [run(llm, greedy(), [p])[0] for p in ALONE]  # one row: the few-row kernel
    for i, out in enumerate(alone):
        _assert_identical(batched[i], out)
    oracle = OracleProposer({tuple(p): o.outputs[0].token_ids for p, o in zip(ALONE, alone)}, error=0.3)
    # batch_invariant's default with speculative decoding: on
    with _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        llm.llm_engine.speculator.proposer = oracle
        for prompt, out in zip(ALONE, alone):
            _assert_identical(run(llm, greedy(), [prompt])[0], out)  # verify steps of up to five rows
        stats = llm.llm_engine.stats
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_latent_attention_decodes_each_sequence_over_its_own_rows(tmp_path):
    """Multi-head latent attention (Kimi Linear) gathers a decode batch's rows padded to its longest sequence; the
    softmax and the value sum then run over a longer, zero-padded row, whose vectorised sums group the real terms
    differently (float32: a few bits apart). Batch-invariant, each sequence attends over exactly its own rows.
    float32, where nothing rounds that away: alone == batched to the bit (checked to fail with the absorbed products
    of the whole batch in one bmm; the padded path's effect is shown by the next test). Attention layers and dense MLPs only: in float32 a
    MoE layer still adds its experts' outputs in another order for one token than for several, and a KDA layer is
    not yet row-count-invariant either (bfloat16 rounds both away: the test above)."""
    _, path = kimi_linear(tmp_path, mlp_layer_types=["dense"] * 4, layer_types=["full_attention"] * 4)
    with LLM(path, skip_tokenizer_init=True, dtype="float32", max_num_batched_tokens=512,
             enable_prefix_caching=False, batch_invariant=True) as llm:
        batched = run(llm, greedy())
        alone = [run(llm, greedy(), [p])[0] for p in PROMPTS]
    for i, out in enumerate(alone):
        _assert_identical(batched[i], out)


@torch.no_grad()
def test_latent_decode_attends_over_each_sequences_own_rows():
    """LatentAttention's decode, batch-invariant: a sequence's output does not depend on the longest sequence of its
    batch (the padded path's softmax and value sums group the same terms differently, float32 bits apart: shown
    here to happen for some of these lengths, so the check can fail)."""
    from types import SimpleNamespace

    from stateserve.layers.latent_attention import LatentAttention

    torch.manual_seed(0)
    layer = LatentAttention(num_heads=4, latent_dim=24, value_dim=16, scale=0.3, dtype=torch.float32)
    bs, blocks = 16, 40
    layer.bind_cache(torch.randn(blocks, bs, 24), None)
    padded_differs = False
    for short, long in [(5, 300), (40, 48), (33, 140), (70, 250), (17, 31)]:
        q = torch.randn(2, 4, 24)
        tables = torch.stack([torch.arange(0, 20), torch.arange(20, 40)])

        def decode(rows: list[int], invariant: bool) -> torch.Tensor:
            lens = torch.tensor([short, long])[rows]
            meta = SimpleNamespace(decode_rows=torch.arange(len(rows)), decode_seq_lens=lens,
                                   decode_block_tables=tables[rows], decode_max_seq_len=int(lens.max()),
                                   query_lens=[1] * len(rows), query_start_loc=list(range(len(rows) + 1)),
                                   slot_mapping=None, is_decode_only=True, prefill_seqs=[])
            layer.write_rows = lambda rows, slots: None  # the cache holds the rows already
            layer.batch_invariant = invariant
            return layer(q[rows], torch.empty(len(rows), 24), meta)

        alone = decode([0], True)
        assert torch.equal(decode([0, 1], True)[:1], alone)
        padded_differs |= not torch.equal(decode([0, 1], False)[:1], alone)
    assert padded_differs


@pytest.mark.parametrize("method", ["int8", "q4_0_weight_only"])
def test_quantized_projections_are_batch_invariant(method, tmp_path):
    """The block-quantized products (csrc/quant_*.cpp) sum each output per block in increasing order, in int8
    activation mode and weight-only alike, whatever the tile shape a row count picks: a quantized model, too, decodes
    a request alone, batched or speculating to the same bits (checked to fail when products of three rows or more
    skip the activation rounding)."""
    from stateserve.quantization.linear import QuantLinear

    _, path = llama_or_qwen2("llama", tmp_path, hidden_size=96, intermediate_size=192)  # K: multiples of 32
    with _llm(path, batch_invariant=True, quantization=method) as llm:
        quantized = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, QuantLinear)]
        assert len(quantized) >= 4 and all(m.kernel is not None for m in quantized)
        batched = run(llm, greedy())
        alone = [run(llm, greedy(), [p])[0] for p in ALONE]
    for i, out in enumerate(alone):
        _assert_identical(batched[i], out)
    oracle = OracleProposer({tuple(p): o.outputs[0].token_ids for p, o in zip(ALONE, alone)}, error=0.3)
    with _llm(path, quantization=method, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        llm.llm_engine.speculator.proposer = oracle
        for prompt, out in zip(ALONE, alone):
            _assert_identical(run(llm, greedy(), [prompt])[0], out)


@pytest.mark.parametrize("flags,line", [
    (["--batch-invariant"], "Batch-invariant linears (on)"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     "Batch-invariant linears (on for speculative decoding)"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--no-batch-invariant"], None),
    ([], None)])
def test_generate_says_when_linears_are_batch_invariant(flags, line):
    """`stateserve generate` on the bundled demo model: the load log says whether the linears sum in one order, and
    why (the flag, or speculative decoding's default); --no-batch-invariant turns the default off."""
    env = {**os.environ, "STATESERVE_DISABLE_TQDM": "1"}
    env.pop("STATESERVE_CONFIGURE_LOGGING", None)
    env.pop("STATESERVE_LOG_LEVEL", None)
    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--prompt", "hi", "--max-tokens", "4",
           "--dtype", "bfloat16", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert re.search(r"^4 tokens in ", proc.stdout, re.M), proc.stdout
    if line is None:
        assert "Batch-invariant linears" not in log
    else:
        assert line in log


def test_batch_invariant_must_be_a_bool():
    with pytest.raises(ValueError, match="batch_invariant must be True, False or None, got 'yes'"):
        EngineConfig(model="m", batch_invariant="yes")
    assert EngineConfig(model="m").batch_invariant_linears is False
    assert EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2}) \
        .batch_invariant_linears is True
    assert EngineConfig(model="m", batch_invariant=True).batch_invariant_linears is True


@torch.no_grad()
def test_a_linear_without_a_panel_copy_takes_the_few_row_kernel_at_any_row_count():
    """Where the weights were not packed (STATESERVE_PACK_LINEARS=0, or too little memory for the copy), a
    batch-invariant layer takes the few-row kernel at every row count instead of oneDNN past 16 rows, so its rows
    keep one order. Checked to fail without make_batch_invariant's reroute (oneDNN's sums differ in float32)."""
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.fast_linear_supported(torch.float32):
        pytest.skip("no few-row kernel here")
    torch.manual_seed(0)
    layer = nn.Linear(300, 70)
    install_fast_linear(layer, torch.float32, torch.device("cpu"))
    assert layer.packed is None and layer.max_rows <= 16
    assert make_batch_invariant(layer, "on") == []
    x = torch.randn(40, 300)
    full = layer(x)
    for rows in (1, 3, 17, 39):
        assert torch.equal(layer(x[:rows]), full[:rows])


def test_a_speculating_server_answers_a_request_alike_alone_and_among_concurrent_ones():
    """Through `stateserve serve` (bfloat16, speculative decoding: batch-invariant by default, which its log says) and
    the openai client: six concurrent greedy completions get exactly the tokens and logprobs each gets alone."""
    import asyncio

    import openai

    from utils import demo_model, start_server

    model = demo_model("llama-demo")
    prompts = ["The list type", "A class definition", "Exceptions can be", "The for statement is used to",
               "If the file", "def f(x):\n    return"]
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    proc, url, lines = start_server(model, "--dtype", "bfloat16", "--speculative-config", spec)
    try:
        def answer(done) -> tuple:
            choice = done.choices[0]
            return choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs

        kwargs = dict(model=model, max_tokens=32, temperature=0, logprobs=1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        alone = [answer(client.completions.create(prompt=p, **kwargs)) for p in prompts]

        async def together() -> list:
            aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            done = await asyncio.gather(*(aclient.completions.create(prompt=p, **kwargs) for p in prompts))
            await aclient.close()
            return [answer(d) for d in done]

        assert asyncio.run(together()) == alone
        assert any("Batch-invariant linears (on for speculative decoding)" in line for line in lines), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
