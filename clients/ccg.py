"""CCG-AUC probe (docs/method.md §2), run against any deployment through `/probe/counterfactual`.

For each eligible item a real donor image with the same normalised question and a
different canonical answer is assigned (seeded, before anything is scored); the service
runs the same question on both. On the decisive set E (right on the real image, wrong on
the donor) CCG-AUC = mean φ(c_real − c_hn), φ(d) = 1[d > 0] + ½·1[d = 0].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from clients.maths import Pair, ccg_auc, decisive, phi  # noqa: F401  (Pair, phi: re-exported)
from clients.maths import ccg_bootstrap_ci as bootstrap_ci

if TYPE_CHECKING:
    from models.data import Item

UNDERPOWERED_IMAGES = 30


def summarise(pairs: list[Pair], bootstrap: int = 1000) -> dict:
    e = decisive(pairs)
    e_strict = decisive(pairs, strict=True)
    images = len({p.image_id for p in e})
    acc_real = float(np.mean([p.z_real for p in pairs])) if pairs else float("nan")
    acc_hn = float(np.mean([p.z_hn for p in pairs])) if pairs else float("nan")
    return {
        "P": len(pairs), "E": len(e), "E_strict": len(e_strict), "E_images": images,
        "ccg_auc": ccg_auc(pairs), "ccg_auc_ci": bootstrap_ci(pairs, n=bootstrap),
        "ccg_auc_strict": ccg_auc(pairs, strict=True),
        "ccg_auc_strict_ci": bootstrap_ci(pairs, strict=True, n=bootstrap),
        "underpowered": images < UNDERPOWERED_IMAGES,
        "vrs": acc_real - acc_hn, "vbr": len(e) / len(pairs) if pairs else float("nan"),
    }


def run(client, items: list[Item], seed: int = 0, method: str = "dualread") -> list[Pair]:
    """Call the service for every item that has a donor (the eligible set P).

    Donor assignment reads the data loaders (`models.data`), so it is imported here: the
    maths above needs numpy only.
    """
    from models.data import HardNegativeIndex

    index = HardNegativeIndex(items, seed)
    donors = {it.id: index.assign(it) for it in items}   # assigned before any scoring
    pairs = []
    for it in items:
        d = donors[it.id]
        if d is None:
            continue
        r = client.counterfactual(it.image_path, it.question, d.image_path,
                                  reference=it.answer, counterfactual_reference=d.answer)
        pairs.append(Pair(it.id, it.image_id, bool(r.real.correct),
                          bool(r.counterfactual.correct),
                          getattr(r.real.confidence, method),
                          getattr(r.counterfactual.confidence, method), bool(r.strict)))
    return pairs
