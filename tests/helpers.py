"""Helpers shared by the service tests."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

from heads.defer import choose_threshold
from heads.dualread import Heads


def random_heads(folder, actor, seed: int = 0) -> str:
    """Heads with random weights bound to `actor` (the service contract, not quality)."""
    torch.manual_seed(seed)
    h = Heads.new(actor.hidden_size)
    for reader in (h.psr, h.state, h.visual, h.saplma, h.bicr):
        reader.eval()
    h.actor_fingerprint = actor.fingerprint
    rng = np.random.default_rng(seed)
    c = rng.uniform(size=500)
    h.policy = choose_threshold(c, rng.uniform(size=500) < c, 0.3, 0.1)
    h.save(folder, {"command": "random heads for tests", "git_commit": "test"})
    return str(folder)


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
