"""Out-of-tree models: ModelRegistry.register_model with a class or a "module:Class" string, and a model's own
get_model_state_cls() hook, which wins over every other route (here the model also holds cross-attention
and encoder-only markers, and the router is asked as if it were a hybrid).

The toy model's custom ModelState keeps a per-request running sum of the tokens seen so far, outside any
cache: add_request starts it, prepare_meta hands it to the model, after_step advances it, remove_request
drops it. The model makes the greedy next token (running sum % vocab), so any slip in those hooks (a lost
chunk, a state not reset) changes the generated tokens."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig

from stateserve import LLM, ModelRegistry, SamplingParams
from stateserve.layers.attention import Attention
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.markers import CrossAttentionMarker, EncoderOnlyAttentionMarker
from stateserve.model_states import resolve_model_state_cls
from stateserve.model_states.default import DefaultModelState
from stateserve.models.base import ModelBase

ARCH = "ToyCounterForCausalLM"
VOCAB, HIDDEN, HEADS = 50, 16, 2


class ToyCrossAttention(CrossAttentionMarker, nn.Module):
    """Would send the model to EncoderDecoderModelState, were it not for the model's own hook."""


class ToyEncoderAttention(EncoderOnlyAttentionMarker, nn.Module):
    """Would send the model to EncoderOnlyModelState."""


class RunningSumState(DefaultModelState):
    """Paged KV as the default state, plus a running (tokens counted, token sum) per live request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running: dict[str, tuple[int, int]] = {}
        self.pending: list[tuple[str, int, int]] = []
        self.log = {"added": [], "removed": [], "steps": 0}

    def default_prefix_caching(self) -> bool:
        return False  # a prefix-cache hit would skip tokens the running sum has to see

    def add_request(self, req) -> None:
        self.running[req.request_id] = (0, 0)
        self.log["added"].append(req.request_id)

    def remove_request(self, req) -> None:
        del self.running[req.request_id]
        self.log["removed"].append(req.request_id)

    def prepare_meta(self, batch) -> ForwardMeta:
        meta = super().prepare_meta(batch)
        base, self.pending = [], []
        for req, ctx, n in zip(batch.requests, batch.context_lens, batch.query_lens):
            counted, total = self.running[req.request_id]
            assert counted == ctx, "the state must have seen exactly the tokens already computed"
            base.append(total)
            self.pending.append((req.request_id, n, sum(req.token_ids[ctx:ctx + n])))
        meta.extra["running_sum"] = torch.tensor(base, dtype=torch.long, device=self.device)  # [S]
        self.log["steps"] += 1
        return meta

    def after_step(self, batch) -> None:
        for rid, n, chunk_sum in self.pending:
            counted, total = self.running[rid]
            self.running[rid] = (counted + n, total + chunk_sum)
        self.pending = []

    def on_step_failed(self) -> None:
        self.pending = []


class ToyCounterForCausalLM(ModelBase):
    """One paged attention layer (so the KV cache is really used) whose logits are swamped by a one-hot of
    (sum of all tokens up to and including this one) % vocab, computed from the state's running sum."""

    @staticmethod
    def get_model_state_cls() -> type:
        return RunningSumState

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf_config)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.attn = Attention(HEADS, HEADS, HIDDEN // HEADS, (HIDDEN // HEADS) ** -0.5, dtype)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        self.cross = ToyCrossAttention()
        self.encoder_attn = ToyEncoderAttention()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # input_ids: [T] -> hidden [T, HIDDEN + VOCAB]: attention output | one-hot of the running sum
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(-1, 3, HEADS, HIDDEN // HEADS).unbind(1)
        x = x + self.attn(q, k, v, meta.attn).flatten(1)
        lens = torch.tensor(meta.attn.query_lens, device=input_ids.device)
        seq = torch.repeat_interleave(torch.arange(len(lens), device=input_ids.device), lens)  # [T]
        flat = torch.cumsum(input_ids, 0)
        starts = torch.tensor(meta.attn.query_start_loc[:-1], device=input_ids.device)
        before = torch.cat([flat.new_zeros(1), flat])[starts]  # token sum of earlier sequences in the batch
        running = meta.extra["running_sum"][seq] + flat - before[seq]  # [T]
        target = nn.functional.one_hot(running % VOCAB, VOCAB).to(x.dtype) * 100
        return torch.cat([x, target], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden[:, :HIDDEN]) * 0.01 + hidden[:, HIDDEN:]


def _expected(prompt: list[int], n: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        out.append(sum(tokens) % VOCAB)
        tokens.append(out[-1])
    return out


@pytest.fixture
def toy_path(tmp_path):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=HEADS, max_position_embeddings=128, architectures=[ARCH])
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in ToyCounterForCausalLM(cfg).state_dict().items()},
              str(tmp_path / "model.safetensors"))
    yield str(tmp_path)
    ModelRegistry._entries.pop(ARCH, None)  # leave the registry as other tests expect it


def test_register_model_validation(toy_path):
    assert not ModelRegistry.is_registered(ARCH)
    with pytest.raises(ValueError, match="not supported"):
        LLM(toy_path, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="module:ClassName"):
        ModelRegistry.register_model(ARCH, "no_colon_here")
    with pytest.raises(ValueError, match="non-empty"):
        ModelRegistry.register_model("", ToyCounterForCausalLM)
    ModelRegistry.register_model(ARCH, f"{__name__}:{ARCH}")  # lazy: imported on first use
    assert ModelRegistry.is_registered(ARCH) and ARCH in ModelRegistry.get_supported_archs()
    assert ModelRegistry.resolve(ARCH) is ToyCounterForCausalLM
    ModelRegistry.register_model("MissingPluginForCausalLM", "no_such_plugin_package.models:Missing")
    try:  # an entry whose module is absent is not offered
        assert not ModelRegistry.is_registered("MissingPluginForCausalLM")
    finally:
        ModelRegistry._entries.pop("MissingPluginForCausalLM")


def test_hook_wins_over_every_route():
    model = ToyCounterForCausalLM(LlamaConfig(vocab_size=VOCAB))
    for hybrid, af in [(False, False), (True, False), (False, True), (True, True)]:
        assert resolve_model_state_cls(model, is_hybrid=hybrid, is_attention_free=af) is RunningSumState
    # the same modules without the hook go elsewhere: cross-attention first, then encoder-only
    holder = ModelBase(None)
    holder.cross, holder.encoder_attn = model.cross, model.encoder_attn
    assert resolve_model_state_cls(holder, is_hybrid=False, is_attention_free=False).__name__ == \
        "EncoderDecoderModelState"
    del holder.cross
    assert resolve_model_state_cls(holder, is_hybrid=True, is_attention_free=False).__name__ == \
        "EncoderOnlyModelState"


@pytest.mark.parametrize("registration", ["class", "string"])
def test_plugin_state_drives_generation(registration, toy_path):
    ModelRegistry.register_model(ARCH, ToyCounterForCausalLM if registration == "class" else f"{__name__}:{ARCH}")
    prompts = [[3, 4, 5], list(range(1, 30)), [49], list(range(10, 23))]
    max_new = 9
    # a small token budget splits the long prompts into chunks: the running sum must carry across them
    with LLM(toy_path, skip_tokenizer_init=True, max_num_batched_tokens=8, max_num_seqs=3) as llm:
        state = llm.llm_engine.runner.model_state
        assert type(state) is RunningSumState
        assert llm.llm_engine.runner.caches.storage.kv, "the toy's attention layer gets paged KV from the default state"
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [_expected(p, max_new) for p in prompts]
        # every request was set up and torn down once, and nothing is left behind
        assert sorted(state.log["added"]) == sorted(state.log["removed"]) and len(state.log["added"]) == 4
        assert state.running == {}
        steps = state.log["steps"]
        assert steps >= max_new + 29 // 8  # prefill chunks of the 29-token prompt, then one step per token
        again = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert again[0].outputs[0].token_ids == _expected(prompts[0], 3)  # a fresh request starts from zero
        assert state.log["steps"] > steps and state.running == {}
