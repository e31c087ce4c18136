"""The shipped confidence methods, one registration line each.

Registration order is fitting order (PER reads P-State's frozen reader); the evaluation
table lists baselines first in this order, then DualRead's rows.
"""

from heads.methods.dualread import PER, PSR, AnswerConsistency, DualRead, PState
from heads.methods.extra_passes import PTrue, SelfConsistency, SemanticUncertainty
from heads.methods.sequence import (
    MaxSequenceProbability,
    MeanTokenLogprob,
    PredictiveEntropy,
    Verbalized,
)
from heads.methods.state_baselines import SAPLMA, BlindImageContrast
from heads.registry import check_served, register

register(PSR())
register(PState())
register(PER())
register(DualRead())
register(Verbalized())
register(MaxSequenceProbability())
register(MeanTokenLogprob())
register(PredictiveEntropy())
register(PTrue())
register(SAPLMA())
register(SelfConsistency(2))
register(SelfConsistency(4))
register(SelfConsistency(8))
register(SemanticUncertainty())
register(BlindImageContrast())
# last: its reader is created after the others (their random initial weights stay as they were)
register(AnswerConsistency())

check_served()   # every field of `/answer`'s confidence has its method
