"""The torchvision-free processor shim (the only place that knows about it)."""

from models.compat import HAS_TORCHVISION, IMAGE_ONLY, load_processor
from tests.conftest import random_image


def test_image_only_processor_round_trip(actor_dirs, actors):
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        proc = load_processor(actor_dirs[family], family)
        if not HAS_TORCHVISION:
            assert isinstance(proc, IMAGE_ONLY[family])
            assert getattr(proc, "video_processor", None) is None
        enc = proc(text=[actors[family].prompt_text("q")], images=[random_image(0)],
                   return_tensors="pt")
        assert int((enc["input_ids"] == actors[family].image_token_id).sum()) == \
            int(enc["image_grid_thw"].prod()) // 4
        assert "mm_token_type_ids" in enc


def test_gemma_processor_loads(actor_dirs, actors):
    proc = load_processor(actor_dirs["gemma3"], "gemma3")
    enc = proc(text=[actors["gemma3"].prompt_text("q")], images=[[random_image(0)]],
               return_tensors="pt")
    assert "token_type_ids" in enc and int(enc["token_type_ids"].sum()) == 4
