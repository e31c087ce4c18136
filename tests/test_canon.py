import pytest

from models.canon import canon, is_correct
from models.parse import parse_response


@pytest.mark.parametrize("raw, expected", [
    ("Yes", "yes"), ("yes.", "yes"), (" YES! ", "yes"), ("y", "yes"), ("True", "yes"),
    ("No", "no"), ("nope", "no"), ("The circle", "circle"), ("a Circle.", "circle"),
    ("circles", "circle"), ("kidneys", "kidney"), ("arteries", "artery"),
    ("grey", "gray"), ("X-ray", "x-ray"), ("xray", "x-ray"), ("CT scan", "ct"),
    ("Computed Tomography", "ct"), ("MR", "mri"), ("left", "left"), ("Right.", "right"),
    ("mass", "mass"), ("pelvis", "pelvis"), ("", ""), ("  ...  ", ""), (None, ""),
    ("the", "the"),
])
def test_canon_table(raw, expected):
    assert canon(raw) == expected


def test_laterality_is_never_collapsed():
    assert canon("left lung") != canon("right lung")
    assert not is_correct("left", "right")


def test_option_letter_equals_option_text():
    opts = {"A": "Pneumonia", "B": "Edema"}
    assert canon("B", opts) == canon("edema", opts) == "edema"
    assert canon("(A)", opts) == "pneumonia"
    assert is_correct("A: Pneumonia", "pneumonia", opts)
    assert not is_correct("A", "edema", opts)


def test_empty_answers_are_wrong():
    assert not is_correct("", "")
    assert not is_correct("   ", "yes")


def test_parse_tagged_response():
    text = ("<think>I see a red circle. so red.</think><answer>red</answer>"
            "<confidence>8</confidence>")
    p = parse_response(text)
    assert (p.answer, p.confidence, p.well_formed, p.tagged) == ("red", 8, True, True)
    assert text[p.answer_span[0]: p.answer_span[1]] == "red"
    assert text[p.close_span[0]: p.close_span[1]] == "</answer>"
    assert p.verbalized == 0.8


@pytest.mark.parametrize("text", [
    "<answer>red</answer><answer>blue</answer>",      # duplicated
    "<think>x</think><answer></answer>",              # empty
    "<think>x</think><answer>red",                    # unclosed
])
def test_bad_answers_score_zero(text):
    assert parse_response(text).answer == ""
    assert not is_correct(parse_response(text).answer, "red")


def test_invalid_confidence_kept_at_half():
    assert parse_response("<answer>red</answer><confidence>12</confidence>").verbalized == 0.5
    assert parse_response("<answer>red</answer>").verbalized == 0.5


def test_plain_response():
    p = parse_response("  Left kidney \n")
    assert p.answer == "Left kidney" and not p.tagged
