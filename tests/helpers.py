"""Helpers shared by the service tests."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clients.bench import ServeProcess
from heads.defer import choose_threshold
from heads.dualread import Heads
from models.actor import Answers, StageTimings
from models.canon import canon
from models.parse import parse_response

HEX32 = re.compile(r"^[0-9a-f]{32}$")


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


def own_or_wrong_dataset(actor, root, n_images: int, seed: int, max_new_tokens: int) -> str:
    """A jsonl data spec of two questions per random image: the reference is the actor's
    own answer for the first and a wrong one for the second. Every split holds both
    classes, and the label is a function of the question, which the readout carries, so
    fitted heads can learn it."""
    from tests.conftest import random_image

    qs = ["what color is the shape?", "is there a red circle?"]
    imgs = [random_image(seed + i, 32, 32) for i in range(n_images)]
    for i, img in enumerate(imgs):
        img.save(root / f"{i}.png")
    pairs = [(i, j) for i in range(n_images) for j in range(2)]
    res = actor.answer([imgs[i] for i, _ in pairs], [qs[j] for _, j in pairs],
                       max_new_tokens, readout="none")
    rows = [{"id": f"{i}-{j}", "image": f"{i}.png", "question": qs[j],
             "answer": r.answer if j == 0 else "definitely wrong"}
            for (i, j), r in zip(pairs, res)]
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return f"jsonl:{root / 'd.jsonl'}"


def probe_items(folder: Path, n_images: int, seed: int, box: list[int] | None = None,
                yes_no: bool = False) -> tuple[str, list[str]]:
    """A jsonl data spec for the probes, and its item ids: a colour question per random
    image (answers differ, so every item has a donor), with `box` if given, and with
    `yes_no` a yes/no question per image too."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_images):
        Image.fromarray(rng.integers(0, 255, (32, 40, 3), dtype=np.uint8)).save(
            folder / f"{i}.png")
        row = {"id": f"c{i}", "image": f"{i}.png", "question": "what color is the shape?",
               "answer": ["red", "blue", "green"][i % 3]}
        rows.append(row if box is None else {**row, "box": box})
        if yes_no:
            rows.append({"id": f"y{i}", "image": f"{i}.png", "question": "is there a red shape?",
                         "answer": "yes" if i % 2 else "no"})
    path = folder / "items.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}", [r["id"] for r in rows]


def stub_answers(monkeypatch, service, texts: list[str] | str, finished: bool = True) -> None:
    """Make the actor 'generate' the given texts (one text: every item answers it), finished
    unless told otherwise: readouts come from teacher forcing them."""
    def answer(images, questions, max_new_tokens=64, readout="capture", deadlines=None):
        out = [texts] * len(images) if isinstance(texts, str) else texts[: len(images)]
        rs = service.actor.score(list(images), list(questions), out, cue=False)
        for r in rs:
            r.finished = finished
            r.parsed = parse_response(r.text, finished)
            r.canonical = canon(r.parsed.answer)
        return Answers(rs, StageTimings(0.0, 0.0))

    monkeypatch.setattr(service.actor, "answer", answer)


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def assert_reports_close(a, b, path: str = "") -> None:
    """Equal reports: floats to 1e-6 (batches differ between runs, and with them the last
    bits of a float), everything else exactly; `path` names the first difference."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-6), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_reports_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_reports_close(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


class LiveServer(ServeProcess):
    """The bench's `dualread serve` subprocess on a free loopback port, with the server's
    log kept in a file: a failed start raises with the log's tail. Flags are `serve`
    options by their Python names (`max_new_tokens=8`)."""

    def __init__(self, actor_dir: str, heads_dir: str, **flags: object) -> None:
        super().__init__({"actor": actor_dir, "heads": heads_dir, **flags},
                         ready_timeout_s=180.0)
        # A file, not a pipe: an unread pipe fills after ~64 KB of access log and then
        # blocks the server on its next log line.
        self.log = tempfile.TemporaryFile(mode="w+")

    def start(self) -> LiveServer:
        if self.proc is None:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=self.log,
                                         stderr=self.log, text=True)
        return self

    def wait_ready(self) -> LiveServer:
        try:
            super().wait_ready()
        except RuntimeError as e:
            self.log.seek(0)
            raise RuntimeError(f"{e}\n{self.log.read()[-4000:]}") from None
        return self

    def close(self) -> None:
        """Stop the server and drop its log (`stop` keeps the log for a failed start's
        message: the bench's `wait_ready` stops a server that never got ready)."""
        self.stop()
        self.log.close()


@contextmanager
def live_servers(actor_dir: str, heads_dir: str, n: int = 1, **flags: object
                 ) -> Iterator[list[str]]:
    """The URLs of `n` ready `dualread serve` processes of one deployment; all stopped on
    exit, also when one fails to start."""
    servers: list[LiveServer] = []
    try:
        for _ in range(n):
            servers.append(LiveServer(actor_dir, heads_dir, **flags))
        for s in servers:
            s.wait_ready()
        yield [s.url for s in servers]
    finally:
        for s in servers:
            s.close()


def drop_fingerprint_scheme(folder) -> None:
    """Make a saved heads card look like one written before fingerprint scheme 2."""
    path = Path(folder) / "heads_card.json"
    card = json.loads(path.read_text())
    del card["fingerprint_scheme"]
    path.write_text(json.dumps(card))


def assert_error(r, status: int, *needles: str) -> dict:
    """The service's one error shape: a JSON detail and request id, the header equal to the
    body's id, and each of `needles` in the detail."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"detail", "request_id"}, body
    assert isinstance(body["detail"], str) and HEX32.match(body["request_id"])
    assert r.headers["x-request-id"] == body["request_id"]
    for n in needles:
        assert n in body["detail"], (n, body["detail"])
    return body


def small_limits_client(service, **settings):
    """A test client of the app on `service` with small limits (8 new tokens, 200 KB and
    1 M pixels an image); `settings` override them."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    base = dict(max_new_tokens=8, batch_wait_ms=5, max_image_bytes=200_000,
                max_image_pixels=1_000_000)
    return TestClient(create_app(Settings(**{**base, **settings}), service))


def edit_card(path: Path, field: str, value: object) -> None:
    """Set one field of a saved JSON card, or delete it when `value` is None."""
    card = json.loads(path.read_text())
    if value is None:
        del card[field]
    else:
        card[field] = value
    path.write_text(json.dumps(card))


def seeded_response(img, question: str, text: str, dim: int, shift=None):
    """A stand-in actor's response: the readout is random but a function of (image,
    question, text), plus `shift` on every state (a label the states can carry)."""
    from models.readout import Readout, Response

    parsed = parse_response(text)
    seed = int(np.asarray(img).sum()) * 31 + sum(map(ord, question + text))
    g = torch.Generator().manual_seed(seed % (2 ** 31))
    offset = torch.zeros(dim) if shift is None else shift

    def h(*shape):
        return torch.randn(*shape, dim, generator=g) + offset

    ro = Readout(h_pre=h(), h_close=h(), h_answer=h(2), h_image=h(3), h_mid=h(),
                 token_logprobs=-torch.rand(4, generator=g),
                 token_entropy=torch.rand(4, generator=g),
                 answer_index=torch.tensor([1, 2]), digit_probs=None)
    return Response(text=text, parsed=parsed, canonical=parsed.answer, token_ids=[1, 2, 3],
                    finished=True, readout=ro)


def red_or_blue(img) -> str:
    """What the stand-in actors answer: red for a reddish image, else blue."""
    red = np.asarray(img)[..., 0].mean() > 127
    return "<answer>red</answer>" if red else "<answer>blue</answer>"


def one_commit_repo(folder: Path) -> str:
    """A git repository in `folder` with one committed file `a.txt` ("1"); its HEAD."""
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    (folder / "a.txt").write_text("1")
    subprocess.run(git + ["add", "a.txt"], cwd=folder, check=True)
    subprocess.run(git + ["commit", "-qm", "x"], cwd=folder, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True,
                          text=True, check=True).stdout.strip()
