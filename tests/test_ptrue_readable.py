"""P(True) is left out of the full evaluation table, with the reason, when the actor's
tokenizer cannot read its template as words."""

from __future__ import annotations

from types import SimpleNamespace

from heads import registry
from heads.evaluate import _unreadable_follow_up, markdown
from heads.passes import ptrue_unreadable
from models.loading import EMBEDDED_ACTOR


class WordTokenizer:
    """One token per word: a tokenizer that reads English."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]


def test_embedded_actor_cannot_read_the_template_and_a_word_tokenizer_can():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(EMBEDDED_ACTOR, local_files_only=True)
    why = ptrue_unreadable(tok)
    assert why is not None and "proposed" in why.lower() and "tokens per word" in why
    assert ptrue_unreadable(WordTokenizer()) is None


def test_full_table_drops_p_true_with_its_reason():
    chosen = registry.select(None)
    letters = SimpleNamespace(encode=lambda t, add_special_tokens=False: list(t.strip()))
    dropped = _unreadable_follow_up(SimpleNamespace(tokenizer=letters), chosen)
    assert list(dropped) == ["p_true"]
    assert _unreadable_follow_up(SimpleNamespace(tokenizer=WordTokenizer()), chosen) == {}
    report = {"actor": "a", "dropped": dropped, "datasets": {"d": {
        "n": 1, "images": 1, "accuracy": 1.0, "seconds_per_item_generate_readout": 0.0,
        "methods": {}}}}
    md = markdown(report)
    assert "| p_true | dropped: the actor's tokenizer splits" in md
