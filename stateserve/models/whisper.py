"""Whisper (WhisperForConditionalGeneration): speech encoder-decoder. Audio becomes log-mel input features
(transformers' WhisperFeatureExtractor, configured by the model folder's preprocessor_config.json); a conv
front-end (kernel 3, the second with stride 2) halves the frames; sinusoidal encoder positions, learned decoder
positions, pre-LayerNorm blocks with a bias-free k_proj (the attention modules are BART's, from
layers/encoder_decoder_blocks.py).

The decoder prompt (e.g. <|startoftranscript|><|en|><|transcribe|><|notimestamps|>) is used exactly as given,
as transformers does for Whisper; with none, decoding starts from decoder_start_token_id alone."""
from __future__ import annotations

import numbers
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.cross_attention import KV, CrossAttnMetadata, activation, sinusoids
from stateserve.layers.encoder_decoder_blocks import DecoderCrossAttention, DecoderSelfAttention, EncoderSelfAttention
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.models.base import ModelBase


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = EncoderSelfAttention(d, cfg.encoder_attention_heads, k_bias=False)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.encoder_ffn_dim), nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = activation(cfg.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, L, d]; every input has the full window of frames: no padding
        x = x + self.self_attn(self.self_attn_layer_norm(x), None)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int) -> None:
        super().__init__()
        d, heads = cfg.d_model, cfg.decoder_attention_heads
        self.self_attn = DecoderSelfAttention(d, heads, dtype, k_bias=False)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = DecoderCrossAttention(d, heads, layer_idx, k_bias=False)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.decoder_ffn_dim), nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = activation(cfg.activation_function)

    def forward(self, x: torch.Tensor, attn: AttnMetadata, cross: CrossAttnMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), attn)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), cross)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        with torch.no_grad():  # checkpoints store this table too; the formula's values, until loaded
            self.embed_positions.weight.copy_(sinusoids(cfg.max_source_positions, d))
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, dtype, i) for i in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)


class _WhisperModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg, dtype)


def load_feature_extractor(model_path: str, num_mel_bins: int):
    from transformers import WhisperFeatureExtractor

    if os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        return WhisperFeatureExtractor.from_pretrained(model_path, local_files_only=True)
    return WhisperFeatureExtractor(feature_size=num_mel_bins)  # Whisper's defaults: 16 kHz, 30 s windows


class WhisperForConditionalGeneration(ModelBase):
    prepends_decoder_start = False

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.num_frames = 2 * cfg.max_source_positions  # conv2 has stride 2
        self.model = _WhisperModel(cfg, dtype)
        self.proj_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", True):
            self.tied_params = {"proj_out.weight": "model.decoder.embed_tokens.weight"}
            self.tie_weights_()
        self._feature_extractor = None

    @staticmethod
    def max_positions(hf_config: Any) -> int:
        return hf_config.max_target_positions  # the decoder's learned position table

    # ---- encoder -------------------------------------------------------------------------------
    def prepare_encoder_input(self, raw: dict[str, Any], model_path: str, max_len: int) -> tuple[dict, int]:
        """{"audio": (waveform, sample_rate)} -> log-mel features [num_mel_bins, 2 * max_source_positions]."""
        if set(raw) != {"audio"}:
            raise ValueError("Whisper's encoder takes audio: pass {'prompt' or 'prompt_token_ids': <decoder prompt>, "
                             f"'multi_modal_data': {{'audio': (array, sample_rate)}}}}; got {sorted(raw)}")
        audio = raw["audio"]
        if not isinstance(audio, (tuple, list)) or len(audio) != 2:
            raise ValueError("multi_modal_data['audio'] must be a (waveform array, sample_rate) pair")
        wave, rate = audio
        if isinstance(wave, torch.Tensor):
            wave = wave.detach().cpu().numpy()
        wave = np.asarray(wave, dtype=np.float32)
        if wave.ndim != 1 or wave.size == 0:
            raise ValueError(f"audio must be a non-empty mono waveform (1-D), got shape {wave.shape}")
        if self._feature_extractor is None:
            self._feature_extractor = load_feature_extractor(model_path, self.config.num_mel_bins)
        fe = self._feature_extractor
        if not isinstance(rate, numbers.Real) or rate != fe.sampling_rate:
            raise ValueError(f"audio sample rate {rate} Hz differs from the feature extractor's "
                             f"{fe.sampling_rate} Hz; resample the audio first")
        if wave.size > fe.n_samples:
            raise ValueError(f"audio is {wave.size / rate:.2f} s long; this model takes at most "
                             f"{fe.n_samples / rate:.2f} s per request (split longer audio)")
        feats = fe(wave, sampling_rate=rate, return_tensors="pt").input_features[0]  # [mels, frames]
        if tuple(feats.shape) != (self.config.num_mel_bins, self.num_frames):
            raise ValueError(f"the feature extractor gives features of shape {tuple(feats.shape)} but the model "
                             f"expects ({self.config.num_mel_bins}, {self.num_frames}); check preprocessor_config")
        return {"input_features": feats.float()}, self.config.max_source_positions

    def encode(self, inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each input's encoder output [max_source_positions, d_model]."""
        enc = self.model.encoder
        w = enc.conv1.weight
        feats = torch.stack([d["input_features"] for d in inputs]).to(w.device, w.dtype)  # [B, mels, frames]
        x = F.gelu(enc.conv2(F.gelu(enc.conv1(feats)))).transpose(1, 2)  # [B, L, d]
        x = x + enc.embed_positions.weight[:x.shape[1]]
        for layer in enc.layers:
            x = layer(x)
        return list(enc.layer_norm(x))

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[KV]:
        return [layer.encoder_attn.project_kv(encoder_hidden) for layer in self.model.decoder.layers]

    # ---- decoder -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)  # [T, d]
        cross = meta.extra["cross"]
        for layer in dec.layers:
            x = layer(x, meta.attn, cross)
        return dec.layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden)
