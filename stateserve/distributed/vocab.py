"""The vocabulary split over tensor-parallel ranks: the input embedding and the output head, whose matrices are
often the largest of a model (a 150k-token vocabulary at hidden 4096 is 1.2 GB in bfloat16).

Each rank keeps a contiguous 1/N of the vocabulary rows (the vocabulary padded with zero rows to a multiple of N).
`VocabParallelEmbedding` looks up the ids that fall in the rank's rows (zeros elsewhere) and sums over the ranks:
exactly one rank contributes each row, so the sum is exact. The head is column-parallel: each rank computes its
rows' logits and rank 0 gathers them (driver.py: `logits_of`, which the workers follow with their own share), then
drops the padding. A tied head and embedding stay one parameter. A model whose embedding or head is not a plain
module of the vocabulary's size keeps both whole."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.distributed.group import ParallelGroup


def padded_share(vocab: int, group: ParallelGroup) -> tuple[int, int]:
    """(first row, rows) of this rank's share of the vocabulary padded to a multiple of the group size."""
    rows = -(-vocab // group.size)
    return group.rank * rows, rows


def _rows_of(weight: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """weight[start:start + rows], zero rows past the vocabulary."""
    out = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    have = max(0, min(rows, weight.shape[0] - start))
    out[:have] = weight[start:start + have]
    return out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, group: ParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [rows, hidden]: this rank's vocabulary rows
        self.start, self.group = start, group
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(out.masked_fill_(~inside.unsqueeze(-1), 0))


def split_vocab(model: nn.Module, vocab: int, group: ParallelGroup) -> bool:
    """Split the input embedding and the lm_head of `model` over the ranks; False (nothing changed) when the model
    has not exactly one nn.Embedding of `vocab` rows and an nn.Linear lm_head of `vocab` outputs."""
    embeddings = [(name, m) for name, m in model.named_modules()
                  if type(m) is nn.Embedding and m.num_embeddings == vocab]
    head = getattr(model, "lm_head", None)
    if len(embeddings) != 1 or not isinstance(head, nn.Linear) or head.out_features != vocab or head.bias is not None:
        return False
    name, embedding = embeddings[0]
    tied = head.weight is embedding.weight
    start, rows = padded_share(vocab, group)
    split = VocabParallelEmbedding(_rows_of(embedding.weight.data, start, rows), start, group)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, split)
    head.weight = split.weight if tied else nn.Parameter(_rows_of(head.weight.data, start, rows), requires_grad=False)
    head.out_features = rows
    return True
