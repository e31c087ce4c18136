"""What supervised fine-tuning (models.train) and self-calibration (models.self_calibrate)
both build their batches from; here so that neither imports the other's module for it."""

from __future__ import annotations

import torch

FLAT_LEVELS = (0, 64, 128, 192, 255)   # gray levels of the blank images in modality dropout


def right_padded(seqs: list[list[int]], labels: list[list[int]], pad: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, labels (-100 where none) and the attention mask of a batch of sequences,
    right padded to the longest."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    lab = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, (s, y) in enumerate(zip(seqs, labels)):
        ids[b, : len(s)] = torch.tensor(s)
        lab[b, : len(y)] = torch.tensor(y)
        mask[b, : len(s)] = 1
    return ids, lab, mask
