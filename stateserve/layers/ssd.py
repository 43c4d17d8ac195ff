"""Mamba2 state-space duality (SSD): the chunked prefill scan and the batched single-step decode update.

Notation: L tokens of one sequence, H heads of P channels (head_dim), G groups (B and C are shared by H/G
consecutive heads), N state size, Q chunk length. Per head h the recurrence is

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        (S: [P, N])
    y_t = S_t C_t + D_h * x_t

Prefill cuts the sequence into chunks of Q tokens. Inside a chunk the output is a causal, decay-masked quadratic
form (like attention with C as queries and B as keys); every chunk's start state comes from one small quadratic
form over the chunk totals, so neither tokens nor chunks are looped over in Python. Any chunking gives the same
result up to float rounding, which is why a sequence can resume from a saved state at any offset.
Everything here runs in float32; callers cast."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a: [..., Q] -> [..., Q, Q] with out[..., i, j] = a[j+1] + ... + a[i] for j <= i and -inf above the diagonal.

    Built from a masked cumulative sum instead of differences of one cumsum: no cancellation between two large
    sums, and exp() of the result is exactly the causal decay mask (0 above the diagonal)."""
    q = a.shape[-1]
    rows = a.unsqueeze(-1).expand(*a.shape, q)  # rows[..., k, j] = a[k]
    strictly_lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    sums = rows.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)  # sums[..., i, j] = sum_{j<k<=i} a[k]
    lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~lower, float("-inf"))


def _heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_size: int, D: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk of tokens through the SSM, resuming from `initial_state` (zeros if None).

    x: [L, H, P]; dt: [L, H] (already softplus'ed and clamped); A: [H] (negative); B, C: [L, G, N];
    D: [H] skip weight; initial_state: [H, P, N].
    Returns y: [L, H, P] and the state after the last token: [H, P, N], both float32."""
    L, H, P = x.shape
    N = B.shape[-1]
    x, dt, A = x.float(), dt.float(), A.float()
    B = _heads_of_groups(B.float(), H)  # [L, H, N]
    C = _heads_of_groups(C.float(), H)
    # A chunk longer than the sequence would only add padding work.
    q = max(1, min(chunk_size, L))
    num_chunks = math.ceil(L / q)
    pad = num_chunks * q - L

    x_dt = x * dt.unsqueeze(-1)  # [L, H, P]: input already scaled by its step size
    log_decay = dt * A  # [L, H]
    if pad:
        # Padded tokens have no decay (log 0) and add nothing (x_dt = 0); their outputs are cut off below.
        x_dt = F.pad(x_dt, (0, 0, 0, 0, 0, pad))
        log_decay = F.pad(log_decay, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    x_dt = x_dt.view(num_chunks, q, H, P)
    B = B.view(num_chunks, q, H, N)
    C = C.view(num_chunks, q, H, N)
    log_decay = log_decay.view(num_chunks, q, H).permute(0, 2, 1)  # [c, H, q]
    cum_decay = log_decay.cumsum(dim=-1)  # [c, H, q]: log decay from the chunk start through token l

    # 1. Within each chunk: y_l = sum_{s<=l} (C_l . B_s) * decay(s -> l) * x_dt_s.
    decay_within = torch.exp(segment_sum(log_decay))  # [c, H, l, s]
    scores = torch.einsum("clhn,cshn->chls", C, B) * decay_within
    y = torch.einsum("chls,cshp->clhp", scores, x_dt)  # [c, q, H, P]

    # 2. What each chunk adds to the state at its own end, starting from zero.
    decay_to_end = torch.exp(cum_decay[..., -1:] - cum_decay)  # [c, H, q]
    chunk_states = torch.einsum("cshn,chs,cshp->chpn", B, decay_to_end, x_dt)  # [c, H, P, N]

    # 3. Start state of every chunk (and the final state) at once: entry 0 is the initial state, entry j+1 what
    # chunk j adds; start_i = sum_{j<=i} decay(entries j+1..i) * entry_j.
    if initial_state is None:
        initial_state = x.new_zeros(H, P, N)
    entries = torch.cat([initial_state.float().unsqueeze(0), chunk_states], dim=0)  # [c+1, H, P, N]
    chunk_totals = F.pad(cum_decay[..., -1], (0, 0, 1, 0))  # [c+1, H], 0 in front for the initial state
    decay_between = torch.exp(segment_sum(chunk_totals.t()))  # [H, c+1 (i), c+1 (j)]
    starts = torch.einsum("hij,jhpn->ihpn", decay_between, entries)  # [c+1, H, P, N]
    final_state = starts[-1]

    # 4. Contribution of each chunk's start state to its tokens: (C_l . start) decayed through token l.
    y_from_start = torch.einsum("clhn,chpn->clhp", C, starts[:-1])
    y = y + y_from_start * torch.exp(cum_decay).permute(0, 2, 1).unsqueeze(-1)
    y = y.reshape(num_chunks * q, H, P)[:L]
    if D is not None:
        y = y + D.float().unsqueeze(-1) * x
    return y, final_state


def ssd_decode_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences at once.

    state: [S, H, P, N]; x: [S, H, P]; dt: [S, H] (softplus'ed); A: [H]; B, C: [S, G, N]; D: [H].
    Returns y: [S, H, P] and the new state [S, H, P, N], both float32 (the caller writes the state back)."""
    H = x.shape[1]
    x, dt = x.float(), dt.float()
    B = _heads_of_groups(B.float(), H)  # [S, H, N]
    C = _heads_of_groups(C.float(), H)
    decay = torch.exp(dt * A.float())  # [S, H]
    new_state = state.float() * decay[..., None, None] + (x * dt.unsqueeze(-1)).unsqueeze(-1) * B.unsqueeze(-2)
    y = torch.einsum("shpn,shn->shp", new_state, C)
    if D is not None:
        y = y + D.float().unsqueeze(-1) * x
    return y, new_state
