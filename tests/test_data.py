"""Every loader on tiny fixture files in its own on-disk format; hard negatives; boxes."""

import csv
import json
import pickle

import numpy as np
import pytest
from PIL import Image

from models.data import HardNegativeIndex, load, sample, shape_box


def _png(path, colour=(200, 10, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), colour).save(path)
    return path


def test_jsonl(tmp_path):
    _png(tmp_path / "img" / "a.png")
    rows = [{"id": "q1", "image": "img/a.png", "question": "Left or right?", "answer": "Left",
             "box": [1, 2, 3, 4], "domain": "ct", "answer_type": "open"},
            {"id": "q2", "image": "img/a.png", "question": "Is it red?", "answer": "yes"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load(f"jsonl:{tmp_path / 'd.jsonl'}")
    assert [i.id for i in items] == ["q1", "q2"]
    assert items[0].box == (1, 2, 3, 4) and items[0].domain == "ct"
    assert items[0].canonical == "left" and items[1].image_id == "img/a.png"
    assert items[0].image().size == (16, 16)


def test_jsonl_bad_line_names_the_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        load(f"jsonl:{tmp_path / 'd.jsonl'}")


def test_slake(tmp_path):
    _png(tmp_path / "imgs" / "xmlab1" / "source.jpg")
    rows = [{"img_id": 1, "img_name": "xmlab1/source.jpg", "question": "Which organ?",
             "answer": "Lung", "q_lang": "en", "qid": 7, "answer_type": "OPEN",
             "modality": "CT"},
            {"img_id": 1, "img_name": "xmlab1/source.jpg", "question": "哪个器官?",
             "answer": "肺", "q_lang": "zh", "qid": 8}]
    (tmp_path / "test.json").write_text(json.dumps(rows))
    items = load(f"slake:{tmp_path}:test")
    assert len(items) == 1 and items[0].id == "slake-7" and items[0].domain == "CT"
    assert items[0].image().size == (16, 16)


def test_vqarad(tmp_path):
    _png(tmp_path / "VQA_RAD Image Folder" / "synpic1.jpg")
    rows = [{"qid": 3, "image_name": "synpic1.jpg", "question": "Is there a mass?",
             "answer": "Yes", "answer_type": "CLOSED", "image_organ": "HEAD"}]
    (tmp_path / "VQA_RAD Dataset Public.json").write_text(json.dumps(rows))
    (item,) = load(f"vqarad:{tmp_path}")
    assert (item.canonical, item.answer_type, item.domain) == ("yes", "closed", "HEAD")
    assert item.image().size == (16, 16)


def test_pathvqa(tmp_path):
    _png(tmp_path / "images" / "test" / "test_0001.jpg")
    (tmp_path / "qas" / "test").mkdir(parents=True)
    rows = [{"image": "test_0001", "question": "Is this necrosis?", "answer": "no"},
            {"image": "test_0001", "question": "What is present?", "answer": "fibrosis"}]
    with open(tmp_path / "qas" / "test" / "test_qa.pkl", "wb") as fh:
        pickle.dump(rows, fh)
    items = load(f"pathvqa:{tmp_path}:test")
    assert [i.answer_type for i in items] == ["yes/no", "open"]
    assert items[0].image().size == (16, 16)


def test_pmcvqa(tmp_path):
    _png(tmp_path / "figures" / "PMC1_fig1.jpg")
    with open(tmp_path / "test.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["Figure_path", "Question", "Answer", "Choice A", "Choice B",
                                "Choice C", "Choice D", "Answer_label"])
        w.writeheader()
        w.writerow({"Figure_path": "PMC1_fig1.jpg", "Question": "Which modality?",
                    "Answer": "MRI", "Choice A": "A:CT", "Choice B": "B:MRI",
                    "Choice C": "C:PET", "Choice D": "D:US", "Answer_label": "B"})
    (item,) = load(f"pmcvqa:{tmp_path}:test")
    assert item.options["B"] == "MRI"
    assert item.canonical == "mri"
    from models.canon import is_correct
    assert is_correct("B", item.answer, item.options)
    assert item.image().size == (16, 16)


def test_easyvqa_test_split():
    items = load("easyvqa:test")
    assert len(items) == 9673
    assert {i.answer_type for i in items} == {"yes/no", "color", "shape"}
    x0, y0, x1, y1 = items[0].box
    assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64


def test_bad_spec():
    with pytest.raises(ValueError, match="bad data spec"):
        load("nope:1")


def test_shape_box_from_pixels(tmp_path):
    a = np.full((64, 64, 3), 240, np.uint8)
    a[10:30, 20:45] = (200, 0, 0)
    Image.fromarray(a).save(tmp_path / "s.png")
    assert shape_box(str(tmp_path / "s.png")) == (20, 10, 45, 30)


def test_sample_is_deterministic():
    items = list(range(100))
    assert sample(items, 10) == sample(items, 10) and len(sample(items, 10)) == 10
    assert sample(items, None) is items


def test_hard_negative_index(tmp_path):
    from models.data import Item
    mk = lambda i, img, q, a: Item(id=i, image_path="", question=q, answer=a, image_id=img)  # noqa: E731
    items = [mk("1", "A", "Is there a mass?", "yes"), mk("2", "B", "is there a MASS", "No"),
             mk("3", "C", "Is there a mass?", "yes"), mk("4", "A", "Is there a mass?", "no"),
             mk("5", "D", "What organ?", "liver")]
    idx = HardNegativeIndex(items, seed=0)
    assert [d.id for d in idx.donors(items[0])] == ["2"]   # same image (4) and answer (3) out
    assert idx.assign(items[0]).id == "2"
    assert idx.assign(items[4]) is None
    assert idx.assign(items[1]).id in {"1", "3"}
    assert idx.assign(items[1]).id == HardNegativeIndex(items, seed=0).assign(items[1]).id
