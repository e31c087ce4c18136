"""Shared fixtures: tiny random actors of every family, built offline on the fly."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.tiny import FAMILIES, build_tiny_actor

# The shared assertion helpers report their operands like assertions in a test module.
pytest.register_assert_rewrite("tests.helpers")
# `make mutation` runs two test workers on two cores: one thread each (DUALREAD_TEST_THREADS=1)
torch.set_num_threads(int(os.environ.get("DUALREAD_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def actor_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("actors")
    return {f: str(build_tiny_actor(f, root / f)) for f in FAMILIES}


@pytest.fixture(scope="session")
def actors(actor_dirs):
    from models.loading import load_actor

    return {f: load_actor(d) for f, d in actor_dirs.items()}


@pytest.fixture(scope="session")
def qwen3(actors):
    return actors["qwen3_vl"]


@pytest.fixture(scope="session")
def own_or_wrong_data(actors, tmp_path_factory) -> str:
    """A jsonl spec of 30 random images × 2 questions for gemma3: the actor's own answer is
    the reference for one question, a wrong one for the other (`own_or_wrong_dataset`)."""
    from tests.helpers import own_or_wrong_dataset

    return own_or_wrong_dataset(actors["gemma3"], tmp_path_factory.mktemp("own-or-wrong"),
                                30, 500, 4)


def random_image(seed: int, h: int = 32, w: int = 40) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture
def images():
    return [random_image(i, 24 + 8 * (i % 3), 32 + 8 * (i % 2)) for i in range(8)]


QUESTIONS = ["what color is the shape?", "is there a red circle?", "what shape is it?",
             "is the lesion on the left?", "what modality is this?", "is there a blue shape?",
             "how many shapes?", "what is the red shape?"]


# The app on the tiny Qwen3-VL actor with random heads and small limits, one per test
# module: the hardening tests probe limits and error shapes, not quality. A module that
# needs another service defines its own `service`/`api`, which take precedence.
@pytest.fixture(scope="module")
def service(actor_dirs, actors, tmp_path_factory):
    from app.service import Service
    from tests.helpers import random_heads

    heads = random_heads(tmp_path_factory.mktemp("heads"), actors["qwen3_vl"])
    return Service(actor_dirs["qwen3_vl"], heads)


@pytest.fixture(scope="module")
def api(service):
    from tests.helpers import small_limits_client

    with small_limits_client(service) as c:
        yield c


@pytest.fixture
def state_dir(tmp_path) -> Iterator[Path]:
    """A folder for a store's state file, in memory (/dev/shm) where the machine has one:
    the store writes, fsyncs and renames the file on every verdict, which on a disk took
    10-15 ms a verdict (4-5 s a 300-verdict window); the file is written and read back the
    same way on either."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=shm, prefix="recert-test-") as d:
        yield Path(d)
