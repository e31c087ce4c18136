"""Processors that work without torchvision.

Qwen-VL processors insist on a video processor, which needs torchvision; PyPI's
torchvision does not import beside the CPU torch wheel this project pins. Images are all we
serve, so the subclasses below drop the video processor and use the PIL image backends.
This is the only place that knows about it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from transformers import Gemma3Processor, Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


class _NoVideoMixin:
    """Skips the video processor at construction and when saving."""

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None,
                 chat_template=None, **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None,
                                       **kwargs):
        from transformers import AutoTokenizer

        kwargs.setdefault("local_files_only", True)
        tok = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        img = Qwen2VLImageProcessorPil.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return [img, tok]

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


class Qwen2VLImageOnlyProcessor(_NoVideoMixin, Qwen2VLProcessor):
    pass


class Qwen25VLImageOnlyProcessor(_NoVideoMixin, Qwen2_5_VLProcessor):
    pass


class Qwen3VLImageOnlyProcessor(_NoVideoMixin, Qwen3VLProcessor):
    pass


IMAGE_ONLY = {
    "qwen2_vl": Qwen2VLImageOnlyProcessor,
    "qwen2_5_vl": Qwen25VLImageOnlyProcessor,
    "qwen3_vl": Qwen3VLImageOnlyProcessor,
}


def load_processor(folder: str, model_type: str) -> Any:
    """The folder's processor; without torchvision, the image-only subclass for Qwen-VL."""
    from transformers import AutoProcessor

    if model_type in IMAGE_ONLY and not HAS_TORCHVISION:
        return IMAGE_ONLY[model_type].from_pretrained(folder, local_files_only=True)
    if model_type == "gemma3" and not HAS_TORCHVISION:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        img = Gemma3ImageProcessorPil.from_pretrained(folder, local_files_only=True)
        extra = Gemma3Processor.get_processor_dict(folder, local_files_only=True)[0]
        return Gemma3Processor(img, tok, chat_template=tok.chat_template,
                               image_seq_length=extra.get("image_seq_length", 256))
    return AutoProcessor.from_pretrained(folder, local_files_only=True)
