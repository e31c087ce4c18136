"""The decisive / strict rule of CCG-AUC (docs/method.md §2), in one pure function.

The service's `/probe/counterfactual` and the probe suites both classify a pair with it,
so the definition cannot drift between them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PairClass:
    decisive: bool | None   # z_real = 1 and z_cf = 0; None when a reference is missing
    strict: bool | None     # decisive and canon(ŷ_real) = canon(ŷ_cf) ≠ ∅


def classify_pair(z_real: bool | None, z_cf: bool | None, canonical_real: str,
                  canonical_cf: str) -> PairClass:
    """Membership of one (real, counterfactual) pair in E and E_strict.

    `z_*` are correctness against each image's own reference (None: no reference given);
    `canonical_*` are the canonical answers of the two runs.
    """
    if z_real is None or z_cf is None:
        return PairClass(None, None)
    decisive = bool(z_real) and not bool(z_cf)
    strict = decisive and bool(canonical_real) and canonical_real == canonical_cf
    return PairClass(decisive, strict)
