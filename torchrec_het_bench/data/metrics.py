"""Rank-based metrics that need nothing beyond torch."""

import math
from collections.abc import Sequence

import torch


def binary_auc(scores: torch.Tensor | Sequence[float], labels: torch.Tensor | Sequence[float]) -> float:
    """Area under the ROC curve: the chance a random positive outscores a random negative.

    Computed from ranks (Mann-Whitney U); tied scores count one half. Returns NaN when
    ``labels`` hold only one class.

    Args:
        scores: predicted scores (any monotone transform of probability), shape [N].
        labels: 0/1 labels (or bools), shape [N].
    """
    scores = torch.as_tensor(scores).detach().reshape(-1).to(torch.float64)
    positive = torch.as_tensor(labels).detach().reshape(-1) > 0.5
    if scores.numel() != positive.numel():
        raise ValueError(f"scores and labels differ in length: {scores.numel()} vs {positive.numel()}")
    num_pos = int(positive.sum())
    num_neg = positive.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        return math.nan
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    mean_ranks = ends - (counts.to(torch.float64) - 1) / 2  # 1-based average rank of each tie group
    ranks = torch.repeat_interleave(mean_ranks, counts)
    positive_rank_sum = ranks[positive[order]].sum().item()
    return (positive_rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)
