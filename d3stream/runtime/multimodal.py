"""A request's images and videos as prompt tokens: decoded, patched once, placeholders expanded, positioned.

On the prepare thread, before any device time: each image and video is decoded (``media.py``, strict for
bytes from outside) where the checkpoint can read it, resized and cut into patches once by the checkpoint's
processor (a ``RequestMedia`` every row of the request shares), and its placeholder token in a rendered
prompt is replaced by the tokens it takes. Rows with media get the multimodal RoPE positions the backbone
computes for them, so they can run padded beside any other rows. The vision tower itself runs later, on
the model thread (``vision.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from d3stream.runtime import media as media_io
from d3stream.runtime.cache import content_digests
from d3stream.runtime.loading import Checkpoint
from d3stream.runtime.rows import RequestMedia

if TYPE_CHECKING:
    import torch
    from PIL import Image


class MediaPlanner:
    """Turns a request's images and videos into processor inputs and placeholder tokens."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        # Take each item's content digest while processing (the feature cache's keys): set while the model
        # has a feature cache. Not later: a request's decoded media are let go once it is prepared.
        self.digest_contents = False

    def load_images(self, images: Sequence[object], *, strict: bool = False) -> list[Image.Image]:
        """Decode a request's images; ValueError names the image that could not be read."""
        if not images:
            return []
        unavailable = self.checkpoint.image_unavailable
        if unavailable is not None:
            raise ValueError(f"image inputs are not available: {unavailable}")
        decoded = []
        for number, value in enumerate(images):
            try:
                decoded.append(media_io.load_image(value, strict=strict))
            except ValueError as exc:
                raise ValueError(f"images[{number}]: {exc}") from exc
        return decoded

    def load_videos(self, videos: Sequence[object], *, strict: bool = False) -> list[media_io.Video]:
        """Decode and sample a request's videos; ValueError names the video that could not be read."""
        if not videos:
            return []
        unavailable = self.checkpoint.video_unavailable
        if unavailable is not None:
            raise ValueError(f"video inputs are not available: {unavailable}")
        decoded = []
        for number, value in enumerate(videos):
            try:
                decoded.append(media_io.load_video(value, strict=strict))
            except ValueError as exc:
                raise ValueError(f"videos[{number}]: {exc}") from exc
        return decoded

    def process(self, images: list[Image.Image], videos: list[media_io.Video]) -> RequestMedia:
        """Resize and patch a request's images and videos once, and plan the tokens each one takes."""
        inputs: dict[str, torch.Tensor] = {}
        image_slots = self._process_images(images, inputs) if images else []
        video_slots = self._process_videos(videos, inputs) if videos else []
        contents = content_digests(images, videos) if self.digest_contents else None
        return RequestMedia(inputs, image_slots, video_slots, contents=contents)

    def _process_images(self, images: list[Image.Image], inputs: dict[str, torch.Tensor]) -> list[list[int]]:
        """The images' pixel values and grids into ``inputs``; the token ids of each image's placeholder."""
        image_processor = self.checkpoint.media_processor().image_processor
        try:
            processed = image_processor(images=images, return_tensors="pt")
        except ValueError as exc:
            raise ValueError(f"image rejected by the processor: {exc}") from exc
        inputs["pixel_values"] = processed["pixel_values"]
        inputs["image_grid_thw"] = processed["image_grid_thw"]
        merge = image_processor.merge_size**2
        token = self.checkpoint.vocabulary.image_token_id
        if token is None:  # a processor without its tokenizer's placeholder: an inconsistent checkpoint
            raise ValueError("image inputs are not available: the tokenizer has no image placeholder token")
        return [[token] * int(grid.prod() // merge) for grid in processed["image_grid_thw"]]

    def _process_videos(self, videos: list[media_io.Video], inputs: dict[str, torch.Tensor]) -> list[list[int]]:
        """The videos' pixel values and grids into ``inputs``; the token ids of each video's placeholder
        (timestamps and frame groups, as the processor writes them)."""
        processor = self.checkpoint.media_processor()
        video_processor = processor.video_processor
        merge = video_processor.merge_size**2
        try:
            planned = sum(
                video_processor.get_num_of_video_patches(len(v.frames), v.size[1], v.size[0]) for v in videos
            ) // merge
        except ValueError as exc:
            raise ValueError(f"video rejected by the processor: {exc}") from exc
        if planned > media_io.VIDEO_MAX_TOKENS:
            raise ValueError(
                f"the videos take {planned:,} input tokens, over the {media_io.VIDEO_MAX_TOKENS:,} tokens a "
                "request may spend on videos; send fewer or shorter videos"
            )
        try:
            processed = dict(
                video_processor(
                    videos=[v.frames for v in videos],
                    video_metadata=[v.metadata() for v in videos],
                    return_metadata=True,
                    return_tensors="pt",
                )
            )
        except ValueError as exc:
            raise ValueError(f"video rejected by the processor: {exc}") from exc
        if int(processed["video_grid_thw"].prod(-1).sum()) // merge != planned:
            raise RuntimeError("the video processor and its own token count disagree")
        texts = [processor.replace_video_token(processed, video_idx=i) for i in range(len(videos))]
        slots = [list(ids) for ids in self.checkpoint.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        inputs["pixel_values_videos"] = processed["pixel_values_videos"]
        inputs["video_grid_thw"] = processed["video_grid_thw"]
        return slots

    def expand(self, ids: list[int], media: RequestMedia) -> list[int]:
        """Token ids with each image and video placeholder replaced by its planned token ids."""
        vocabulary = self.checkpoint.vocabulary
        images, videos = iter(media.image_slots), iter(media.video_slots)
        expanded: list[int] = []
        for token in ids:
            if token == vocabulary.image_token_id:
                expanded += next(images)
            elif token == vocabulary.video_token_id:
                expanded += next(videos)
            else:
                expanded.append(token)
        return expanded

    def positions(self, ids: list[int], media: RequestMedia) -> torch.Tensor:
        """Multimodal RoPE positions [3, length] of one expanded row, as the backbone computes them."""
        import torch

        vocabulary = self.checkpoint.vocabulary
        tensor = torch.as_tensor([ids], dtype=torch.long)
        kinds = torch.zeros_like(tensor)
        kinds[tensor == vocabulary.image_token_id] = 1
        kinds[tensor == vocabulary.video_token_id] = 2
        # transformers annotates these index inputs with torch's legacy LongTensor / IntTensor classes, which no
        # tensor made today is typed as (all four are int64 tensors).
        backbone = self.checkpoint.backbone
        rope_index = cast("Callable[..., tuple[torch.Tensor, torch.Tensor]]", backbone.get_rope_index)
        positions, _ = rope_index(
            tensor,
            mm_token_type_ids=kinds,
            image_grid_thw=media.inputs.get("image_grid_thw"),
            video_grid_thw=media.inputs.get("video_grid_thw"),
        )
        return positions[:, 0]
