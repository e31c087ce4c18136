"""Definitions both sides of the API share: the blank counterfactual image and the
confidence fields of `/answer`. Each has one home; the other call sites must agree with it
and with docs/method.md, written out here by hand."""

import dataclasses
import io
import pickle

import numpy as np
import pytest
from PIL import Image

# docs/method.md §5: blank = 224×224 RGB (128, 128, 128)
SPEC_BLANK = np.full((224, 224, 3), 128, dtype=np.uint8)
# `/answer`'s confidence object, in its JSON order, with its OpenAPI descriptions
FIELDS = {
    "dualread": "fused DualRead confidence",
    "psr": "pre-answer branch (PSR)",
    "per": "post-answer branch (P-State + P-Visual)",
    "verbalized": "the actor's own μ(C)",
}


def pixels(img: Image.Image) -> np.ndarray:
    assert img.mode == "RGB"
    return np.asarray(img)


# ------------------------------------------------------------------ the blank image
def test_server_and_probes_send_the_same_blank_pixels():
    from clients.probes.images import blank
    from clients.probes.reliance import BLANK_PNG
    from models.counterfactuals import blank_image

    server, probe = pixels(blank_image()), pixels(blank())
    np.testing.assert_array_equal(server, SPEC_BLANK)
    np.testing.assert_array_equal(probe, SPEC_BLANK)
    # what the reliance probe uploads decodes to the same pixels (PNG is lossless)
    np.testing.assert_array_equal(pixels(Image.open(io.BytesIO(BLANK_PNG))), SPEC_BLANK)


def test_the_blank_route_uses_the_one_definition():
    import app.routers.probes
    import clients.counterfactual
    import models.counterfactuals

    assert app.routers.probes.blank_image is clients.counterfactual.blank_image
    assert models.counterfactuals.blank_image is clients.counterfactual.blank_image


def test_bicr_black_image_is_not_the_blank_one():
    """docs/method.md §7's blind image is black at the real image's size: a different condition."""
    from models.counterfactuals import black_image

    np.testing.assert_array_equal(pixels(black_image((5, 3))), np.zeros((3, 5, 3), np.uint8))


# ------------------------------------------------------------------ the confidence fields
def test_response_schema_lists_the_fields_with_descriptions():
    from clients.schemas import AnswerResponse, Confidence, ConfidenceDifference

    assert ConfidenceDifference is Confidence
    schema = AnswerResponse.model_json_schema()["$defs"]["Confidence"]
    assert list(schema["properties"]) == list(FIELDS)
    assert schema["required"] == list(FIELDS)
    assert {k: v["description"] for k, v in schema["properties"].items()} == FIELDS
    assert all(v["type"] == "number" for v in schema["properties"].values())
    assert schema["title"] == "Confidence" and "counterfactual" in schema["description"]


def test_openapi_document_lists_the_fields_with_descriptions():
    from app.main import create_app
    from app.settings import Settings

    spec = create_app(Settings()).openapi()
    props = spec["components"]["schemas"]["Confidence"]["properties"]
    assert {k: v["description"] for k, v in props.items()} == FIELDS


def test_serving_dataclass_has_the_same_fields_in_order():
    from app.serving import Confidences

    assert [f.name for f in dataclasses.fields(Confidences)] == list(FIELDS)
    c = Confidences(0.9, 0.5, 0.25, 0.125)          # positional, in the JSON order
    assert (c.dualread, c.psr, c.per, c.verbalized) == (0.9, 0.5, 0.25, 0.125)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.psr = 0.0
    assert pickle.loads(pickle.dumps(c)) == c      # results cross processes under Ray


def test_minus_is_field_by_field():
    from app.serving import Confidences

    d = Confidences(0.9, 0.5, 0.25, 0.125).minus(Confidences(0.4, 0.5, 0.75, 0.0))
    assert dataclasses.astuple(d) == pytest.approx((0.5, 0.0, -0.5, 0.125))


def test_from_scores_keeps_the_served_fields_and_names_a_missing_one():
    from app.serving import Confidences

    scores = {"p_state": 0.3, "verbalized": 0.4, "per": 0.2, "psr": 0.1, "dualread": 0.7}
    assert Confidences.from_scores(scores) == Confidences(0.7, 0.1, 0.2, 0.4)
    del scores["per"]
    with pytest.raises(KeyError, match="per"):
        Confidences.from_scores(scores)
