"""Multimodal processors (transformers' ``AutoProcessor``) for the vision-language models.

transformers builds Qwen-VL processors with a video processor, which needs torchvision; the
project trains on images only, so where the full processor cannot be built,
:func:`load_processor` returns :class:`QwenVLImageProcessor`: the same image processor and
tokenizer and the same text expansion (one ``<|image_pad|>`` per merged patch), without videos.
"""

from __future__ import annotations

from pathlib import Path

from transformers.processing_utils import ProcessorMixin

from rlhf.models.loading import load_tokenizer
from rlhf.schema.config import ConfigError


class QwenVLImageProcessor(ProcessorMixin):
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL processor for images and text (no videos).

    ``processor(text=[...], images=[...])`` expands each ``<|image_pad|>`` of the text to
    ``grid_t * grid_h * grid_w / merge_size**2`` copies and returns ``input_ids``,
    ``attention_mask``, ``pixel_values [patches, C * temporal * patch**2]``, ``image_grid_thw
    [images, 3]`` and (``return_mm_token_type_ids=True``) ``mm_token_type_ids``.
    """

    return_mm_token_type_ids = True

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        merge_length = self.image_processor.merge_size ** 2
        return self.image_token * int(image_inputs["image_grid_thw"][image_idx].prod() // merge_length)


def load_processor(path: str, trust_remote_code: bool = False, key: str = "model.path"):
    """The processor saved with a VLM at ``path``: ``AutoProcessor``, or, where transformers cannot
    build its video processor (no torchvision), :class:`QwenVLImageProcessor` from the same files."""
    from transformers import AutoImageProcessor, AutoProcessor

    p = Path(path).expanduser()
    if not (p / "preprocessor_config.json").is_file() and not (p / "processor_config.json").is_file():
        raise ConfigError(f"{key}: {path} has no image processor (preprocessor_config.json / processor_config.json): "
                          "save the model's processor with it (processor.save_pretrained)")
    try:
        proc = AutoProcessor.from_pretrained(str(p), trust_remote_code=trust_remote_code)
        if hasattr(proc, "image_processor"):
            return proc
    except (AttributeError, ImportError, ValueError, TypeError):
        pass  # transformers without torchvision cannot build a video processor: images only
    # (AutoProcessor also falls back to the bare tokenizer for a processor class it does not know)
    image_processor = AutoImageProcessor.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    tok = load_tokenizer(str(p), trust_remote_code=trust_remote_code, key=key)
    return QwenVLImageProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
