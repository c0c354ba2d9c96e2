"""Image and video inputs (d3stream.runtime.media): real encoded files, strict limits, frame sampling."""

from __future__ import annotations

import tempfile
import time

import numpy as np
import pytest

from d3stream.runtime import media
from tests.support.media_makers import (
    data_url,
    frames_array,
    make_avi,
    make_bmp,
    make_gif,
    make_jpeg,
    make_mp4,
    make_mp4_bomb,
    make_png,
    make_png_header_only,
    make_smooth_png,
    make_webm,
    make_webp,
    noise_image,
    webm_supported,
)

needs_webm = pytest.mark.skipif(not webm_supported(), reason="this OpenCV build does not write/read VP8 WebM")


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


# ------------------------------------------------------------------------------------------------ images


@pytest.mark.parametrize("maker", [make_png, make_jpeg, make_webp], ids=["png", "jpeg", "webp"])
def test_strict_accepts_png_jpeg_webp_bytes_and_data_urls(maker):
    data = maker(64, 48, 3)
    image = media.load_image(data, strict=True)
    assert image.size == (64, 48) and image.mode == "RGB"
    mime = {"png": "image/png", "jpe": "image/jpeg", "web": "image/webp"}
    kind = maker.__name__.removeprefix("make_")[:3]
    from_url = media.load_image(data_url(data, mime[kind]), strict=True)
    assert np.array_equal(pixels(from_url), pixels(image))


def test_png_pixels_survive_exactly():
    data = make_png(16, 8, 5)
    assert np.array_equal(pixels(media.load_image(data, strict=True)), pixels(noise_image(16, 8, 5)))


@pytest.mark.parametrize("maker, name", [(make_gif, "GIF"), (make_bmp, "BMP")])
def test_strict_refuses_other_formats_naming_them(maker, name):
    data = maker(32, 32)
    with pytest.raises(ValueError, match=f"the image is {name}; send PNG, JPEG or WebP"):
        media.load_image(data, strict=True)
    # Declared as PNG, the bytes still say what they are.
    with pytest.raises(ValueError, match=f"the image is {name}"):
        media.load_image(data_url(data, "image/png"), strict=True)
    # In process anything PIL reads is fine.
    assert media.load_image(data).size == (32, 32)


def test_strict_refuses_unlisted_data_url_types():
    with pytest.raises(ValueError, match="take the types png, jpeg, jpg, webp, got 'gif'"):
        media.load_image(data_url(make_gif(8, 8), "image/gif"), strict=True)


def test_jpeg_declared_as_png_is_sniffed_and_decoded():
    data = make_jpeg(40, 30, 1)
    image = media.load_image(data_url(data, "image/png"), strict=True)
    assert image.size == (40, 30)
    assert np.array_equal(pixels(image), pixels(media.load_image(data, strict=True)))


def test_byte_limit():
    png = make_png(64, 48)
    at_limit = png + b"\0" * (media.MAX_IMAGE_BYTES - len(png))  # trailing bytes after IEND
    assert media.load_image(at_limit, strict=True).size == (64, 48)
    over = at_limit + b"\0"
    with pytest.raises(ValueError, match="8,000,001 bytes, over the 8,000,000 byte limit"):
        media.load_image(over, strict=True)
    with pytest.raises(ValueError, match="over the 8,000,000 byte limit"):
        media.load_image(data_url(over, "image/png"), strict=True)
    # Base64 text longer than the limit can encode is refused before it is decoded.
    with pytest.raises(ValueError, match="encoded data exceeds the 8,000,000 byte limit"):
        media.load_image("data:image/png;base64," + "A" * 10_700_000, strict=True)


def test_decompression_bomb_is_refused_by_the_pixel_limit_without_decoding(monkeypatch):
    bomb = make_png_header_only(5000, 5000)  # 25 MP announced, a few hundred bytes on the wire
    assert len(bomb) < 50_000
    decoded = []
    monkeypatch.setattr(media, "_decode_image", lambda data: decoded.append(data))
    started = time.perf_counter()
    with pytest.raises(ValueError, match="25,000,000 pixels; at most 16,000,000 are accepted"):
        media.load_image(bomb, strict=True)
    assert time.perf_counter() - started < 1.0
    assert decoded == []
    # Far beyond PIL's own guard it is refused as unidentifiable.
    with pytest.raises(ValueError, match="DecompressionBomb"):
        media.load_image(make_png_header_only(20_000, 20_000), strict=True)


def test_source_pixel_limit_is_inclusive():
    at_limit = make_png_header_only(4000, 4000, rows=4000)  # exactly 16,000,000 pixels, all black
    image = media.load_image(at_limit, strict=True)
    assert image.size == (4000, 4000)
    with pytest.raises(ValueError, match="16,004,000 pixels"):
        media.load_image(make_png_header_only(4001, 4000), strict=True)


def test_corrupt_png_is_refused():
    png = make_png(64, 48, 2)
    with pytest.raises(ValueError, match="integrity check|could not be"):
        media.load_image(png[: len(png) // 2], strict=True)
    middle = len(png) // 2
    flipped = png[:middle] + bytes(b ^ 0x55 for b in png[middle : middle + 64]) + png[middle + 64 :]
    with pytest.raises(ValueError, match="integrity check"):
        media.load_image(flipped, strict=True)
    with pytest.raises(ValueError, match="could not be identified"):
        media.load_image(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, strict=True)


@pytest.mark.parametrize("maker", [make_jpeg, make_webp], ids=["jpeg", "webp"])
def test_truncated_jpeg_and_webp_are_refused(maker):
    data = maker(64, 48, 4)
    with pytest.raises(ValueError, match="image"):
        media.load_image(data[: len(data) // 2], strict=True)


@pytest.mark.parametrize(
    "value, message",
    [
        ("/tmp/photo.png", "strict mode takes images as encoded bytes or a data: URL"),
        ("https://example.com/a.png", "strict mode takes images as encoded bytes or a data: URL"),
        (None, "strict mode"),
        ("data:image/png,iVBORw0KGgo=", "expected a base64 data URL"),
        ("data:text/plain;base64,aGVsbG8=", "expected a base64 data URL: data:image"),
        ("data:image/png;base64,not base64!", "does not hold valid base64"),
        ("data:image/png;base64,aGVsbG8=", "could not be identified"),
    ],
)
def test_strict_image_inputs_are_type_checked(value, message):
    with pytest.raises(ValueError, match=message):
        media.load_image(value, strict=True)


def test_strict_refuses_pil_images_and_in_process_accepts_them():
    image = noise_image(10, 10)
    with pytest.raises(ValueError, match="strict mode"):
        media.load_image(image, strict=True)
    assert media.load_image(image.convert("L")).mode == "RGB"


def test_in_process_paths_and_errors(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(make_jpeg(20, 10))
    assert media.load_image(path).size == (20, 10)
    assert media.load_image(str(path)).size == (20, 10)
    with pytest.raises(ValueError, match="cannot read the image"):
        media.load_image(str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="could not be decoded"):
        media.load_image(b"not an image")
    with pytest.raises(ValueError, match="an image is"):
        media.load_image(12)


# ------------------------------------------------------------------------------------------------ videos


def test_sampling_10s_at_10fps_gives_20_frames():
    video = media.load_video(make_mp4(100, 64, 48, 10), strict=True)
    assert video.frames.shape == (20, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.fps == pytest.approx(10.0) and video.total_frames == 100
    assert video.indices[0] == 0 and video.indices[-1] == 99  # spread over the whole clip
    assert video.indices == sorted(video.indices)
    assert video.metadata()["duration"] == pytest.approx(10.0)
    assert video.metadata()["frames_indices"] == video.indices


def test_sampling_short_clip_keeps_at_least_4_frames():
    video = media.load_video(make_mp4(10, 64, 48, 10), strict=True)
    assert len(video.frames) == 4 and video.indices == [0, 3, 6, 9]


def test_sampling_long_clip_keeps_at_most_32_frames():
    video = media.load_video(make_mp4(600, 32, 32, 10), strict=True)
    assert len(video.frames) == 32 and video.indices[-1] == 599


@pytest.mark.parametrize("frames", [1, 3, 25])
def test_frame_count_is_even_by_repeating_the_last(frames):
    video = media.load_video(make_mp4(frames, 32, 32, 10), strict=True)
    assert len(video.frames) % 2 == 0
    assert video.indices[-1] == video.indices[-2]
    assert np.array_equal(video.frames[-1], video.frames[-2])


def test_decoded_frames_are_rgb_in_order():
    source = frames_array(10, 64, 48, seed=7)
    video = media.load_video(make_mp4(10, 64, 48, 10, seed=7), strict=True)
    for frame, index in zip(video.frames, video.indices, strict=True):
        # mp4v is lossy; the channel means still match the RGB source (not BGR).
        assert np.abs(frame.astype(float).mean((0, 1)) - source[index].astype(float).mean((0, 1))).max() < 8


@needs_webm
def test_webm_is_accepted():
    video = media.load_video(make_webm(30, 64, 48, 10), strict=True)
    assert len(video.frames) == 6 and video.total_frames == 30
    assert media.load_video(data_url(make_webm(30, 64, 48, 10), "video/webm"), strict=True).total_frames == 30


@needs_webm
def test_truncated_webm_decodes_fewer_frames_or_is_refused():
    data = make_webm(60, 64, 48, 10)
    try:
        video = media.load_video(data[: int(len(data) * 0.6)], strict=True)
    except ValueError:
        return
    assert 2 <= len(video.frames) < 12 and len(video.frames) % 2 == 0
    assert max(video.indices) < 59


def test_truncated_mp4_is_refused_with_a_clear_error():
    data = make_mp4(100, 64, 48, 10)
    for cut in (len(data) // 2, 40):
        with pytest.raises(ValueError, match="could not be opened|no frame|no frames"):
            media.load_video(data[:cut], strict=True)


def test_mp4_header_followed_by_garbage_is_refused():
    data = make_mp4(10, 64, 48, 10)
    with pytest.raises(ValueError, match="could not be opened|no frame"):
        media.load_video(data[:32] + bytes(range(256)) * 40, strict=True)


def test_video_with_zero_frames_is_refused():
    data = make_mp4(0, 64, 48, 10)
    with pytest.raises(ValueError, match="could not be opened|no frames|no frame"):
        media.load_video(data, strict=True)


@pytest.mark.parametrize(
    "data",
    [make_png(32, 32), b"hello, this is not a video at all", b"", make_avi(10, 32, 32, 10)],
    ids=["png", "text", "empty", "avi"],
)
def test_non_video_bytes_are_refused(data):
    with pytest.raises(ValueError, match="not an MP4, WebM, QuickTime or Matroska file"):
        media.load_video(data, strict=True)


def test_avi_decodes_in_process():
    assert len(media.load_video(make_avi(30, 64, 48, 10)).frames) == 6


def test_strict_video_length_limit():
    over = make_mp4(301, 16, 16, 1)  # 301 s at 1 fps
    with pytest.raises(ValueError, match="at most 300 seconds"):
        media.load_video(over, strict=True)
    assert len(media.load_video(over).frames) == 32  # in process: sampled
    assert len(media.load_video(make_mp4(300, 16, 16, 1), strict=True).frames) == 32


def test_strict_video_frame_size_limit():
    with pytest.raises(ValueError, match="at most 8,294,400 pixels"):
        media.load_video(make_mp4(2, 3856, 2168, 10), strict=True)


def test_strict_video_byte_limit():
    mp4 = make_mp4(4, 32, 32, 10)
    with pytest.raises(ValueError, match="over the 32,000,000 byte limit"):
        media.load_video(mp4 + b"\0" * (media.MAX_VIDEO_BYTES + 1 - len(mp4)), strict=True)
    with pytest.raises(ValueError, match="exceeds the 32,000,000 byte limit"):
        media.load_video("data:video/mp4;base64," + "A" * 42_700_000, strict=True)


@pytest.mark.parametrize(
    "value, message",
    [
        ("/tmp/clip.mp4", "strict mode takes videos as encoded bytes or a data:video/... URL"),
        (frames_array(4, 8, 8), "strict mode takes videos"),
        ("data:video/avi;base64,AAAA", "take the types mp4, webm, quicktime, x-matroska, got 'avi'"),
        ("data:image/png;base64,AAAA", "expected a base64 data URL: data:video"),
        ("data:video/mp4;base64,@@@", "does not hold valid base64"),
    ],
)
def test_strict_video_inputs_are_type_checked(value, message):
    with pytest.raises(ValueError, match=message):
        media.load_video(value, strict=True)


def test_strict_video_data_url_with_parameters():
    url = data_url(make_mp4(10, 32, 32, 10), "video/mp4;codecs=mp4v")
    assert len(media.load_video(url, strict=True).frames) == 4


def test_strict_refuses_a_decoded_video():
    video = media.load_video(frames_array(4, 8, 8))
    assert media.load_video(video) is video
    with pytest.raises(ValueError, match="strict mode"):
        media.load_video(video, strict=True)


def test_video_path_in_process(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_mp4(20, 32, 32, 10))
    assert len(media.load_video(path).frames) == 4
    with pytest.raises(ValueError, match="no video file"):
        media.load_video(str(tmp_path / "missing.mp4"))


def test_a_clip_claiming_30000_frames_is_read_only_near_its_sampled_frames():
    # 30,000 samples at 1000 fps all pointing at one stored frame (~125 KB): reading every frame up to the
    # last sampled one was 30,000 decodes; seeking across the gaps reads one frame per sample.
    bomb = make_mp4_bomb(30_000, 320, 180, fps=1000)
    assert len(bomb) < 200_000
    video = media.load_video(bomb, strict=True)
    assert video.total_frames == 30_000 and len(video.frames) == 32
    assert video.indices[-1] == 29_999
    assert video.frames_read <= media.VIDEO_MAX_FRAMES * (media.VIDEO_SEEK_GAP + 1)


def test_seeking_returns_the_frames_reading_on_would():
    # 3,000 frames at 30 fps: sampled frames ~97 apart, reached by seeking; a 40-frame clip is read on.
    import cv2

    for clip in (make_mp4(3000, 32, 32, 30, seed=2), make_mp4(40, 32, 32, 10, seed=3)):
        video = media.load_video(clip, strict=True)
        with tempfile.NamedTemporaryFile(suffix=".mp4") as handle:
            handle.write(clip)
            handle.flush()
            capture = cv2.VideoCapture(handle.name)
            every = []
            while True:
                ok, frame = capture.read()
                if not ok:
                    break
                every.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            capture.release()
        for frame, index in zip(video.frames, video.indices, strict=True):
            assert np.array_equal(frame, every[index]), index


def test_a_budget_refuses_a_video_from_its_header_naming_the_setting():
    clip = make_mp4(100, 64, 48, 10)  # 20 sampled frames of 64 x 48
    with pytest.raises(media.MediaBudgetExceeded, match=r"20 decoded video frames; .* 8 left \(setting: max_video_frames\)"):
        media.checked_video_bytes(clip, media.MediaBudget(frames=8))
    with pytest.raises(media.MediaBudgetExceeded, match=r"61,440 pixels; .* 1,000 left \(setting: max_media_pixels\)"):
        media.checked_video_bytes(clip, media.MediaBudget(pixels=1_000))
    budget = media.MediaBudget(pixels=100_000, frames=30)
    assert len(media.checked_video_bytes(clip, budget).frames) == 20
    assert budget.frames == 10 and budget.pixels == 100_000 - 61_440


def test_image_header_reads_the_size_without_decoding(monkeypatch):
    monkeypatch.setattr(media, "_decode_image", lambda data: pytest.fail("decoded"))
    assert media.image_header(make_smooth_png(4000, 4000)) == (4000, 4000)
    with pytest.raises(ValueError, match="25,000,000 pixels"):
        media.image_header(make_png_header_only(5000, 5000))


def test_messages_carry_no_object_reprs_or_heap_addresses():
    with pytest.raises(ValueError) as caught:
        media.load_image(bytes(range(256)) * 4, strict=True)  # PIL: "cannot identify image file <_io...>"
    message = str(caught.value)
    assert "cannot identify image file" in message
    assert "0x" not in message and "BytesIO" not in message and "<" not in message
    assert media.reason(ValueError("bad <foo.Bar object at 0xdeadbeef> here")) == "ValueError: bad here"


# ------------------------------------------------------------------------------------------ frame arrays


def test_frame_arrays_are_read_at_2_fps():
    video = media.load_video(frames_array(5, 8, 6))
    assert video.fps == 2.0 and video.total_frames == 5
    assert video.indices == [0, 1, 2, 3, 4, 4]
    long = media.load_video(frames_array(40, 8, 6))
    assert len(long.frames) == 32 and long.indices[0] == 0 and long.indices[-1] == 39


def test_frame_arrays_of_pil_images_and_arrays():
    images = [noise_image(8, 6, i) for i in range(4)]
    video = media.load_video(images)
    assert video.frames.shape == (4, 6, 8, 3)
    assert np.array_equal(video.frames[2], pixels(images[2]))
    assert media.load_video([pixels(image) for image in images]).frames.shape == (4, 6, 8, 3)


@pytest.mark.parametrize(
    "value, message",
    [
        ([], "needs at least one frame"),
        (frames_array(4, 8, 8).astype(np.float32), "uint8"),
        (np.zeros((4, 8, 8), dtype=np.uint8), "uint8"),
        (np.zeros((0, 8, 8, 3), dtype=np.uint8), "uint8"),
        ([np.zeros((8, 8, 3), np.uint8), np.zeros((9, 8, 3), np.uint8)], "same size"),
        ("", "a video is a path"),
    ],
)
def test_bad_frame_arrays(value, message):
    with pytest.raises(ValueError, match=message):
        media.load_video(value)


# ----------------------------------------------------------------------------------------- through a model

QUESTIONS = {
    "see": {"type": "noul", "instructions": "Is anything moving?"},
    "what": {"type": "choice", "criteria": {"cat": "a cat", "dog": "a dog", "none": "nothing"}},
}


def test_model_answers_strict_image_and_video_bytes(qwen35_model):
    image = make_png(96, 64, 11)
    result = qwen35_model.system_one(state="a room", questions=QUESTIONS, images=[image], strict=True)
    assert all("error" not in answer for answer in result["answers"].values())
    same = qwen35_model.system_one(state="a room", questions=QUESTIONS, images=[noise_image(96, 64, 11)])
    assert result == same  # bytes and the decoded image are the same input
    clip = make_mp4(20, 64, 48, 10, seed=3)
    video = qwen35_model.system_one(state="a room", questions=QUESTIONS, videos=[clip], strict=True)
    assert all("error" not in answer for answer in video["answers"].values())
    plain = qwen35_model.system_one(state="a room", questions=QUESTIONS)
    # 4 sampled frames of 64 x 48 (resized to 64 x 64) are 2 groups of 4 tokens plus timestamps.
    assert video["usage"]["input_tokens"] > plain["usage"]["input_tokens"] + 2 * 2 * 4
    by_url = qwen35_model.system_one(
        state="a room", questions=QUESTIONS, videos=[data_url(clip, "video/mp4")], strict=True
    )
    assert by_url == video


def test_model_strict_refusals_name_the_input(qwen35_model):
    with pytest.raises(ValueError, match=r"images\[1\]: the image is GIF"):
        qwen35_model.system_one(
            state="s", questions=QUESTIONS, images=[make_png(32, 32), make_gif(32, 32)], strict=True
        )
    with pytest.raises(ValueError, match=r"videos\[0\]: the video is not an MP4"):
        qwen35_model.system_one(state="s", questions=QUESTIONS, videos=[b"nope"], strict=True)
    with pytest.raises(ValueError, match=r"images\[0\]: strict mode"):
        qwen35_model.system_one(state="s", questions=QUESTIONS, images=[noise_image(8, 8)], strict=True)


def test_video_token_budget_per_request(qwen35_model):
    # 32 frames of 448 x 448 (= 200,704 px, the per-frame cap) take 16 groups x 196 tokens = 3,136 tokens.
    clip = frames_array(32, 448, 448)
    five = qwen35_model.prepare("s", {"q": {"type": "noul"}}, videos=[clip] * 5)
    assert five.media.visual_tokens >= 5 * 3136
    with pytest.raises(ValueError, match="over the 16,384 tokens a request may spend on videos"):
        qwen35_model.prepare("s", {"q": {"type": "noul"}}, videos=[clip] * 6)


def test_image_and_video_change_the_answer(qwen35_model):
    plain = qwen35_model.system_one(state="a room", questions=QUESTIONS)
    one = qwen35_model.system_one(state="a room", questions=QUESTIONS, images=[make_png(96, 64, 1)])
    two = qwen35_model.system_one(state="a room", questions=QUESTIONS, images=[make_png(96, 64, 2)])
    clip = qwen35_model.system_one(state="a room", questions=QUESTIONS, videos=[frames_array(8, 64, 48)])

    def gap(a, b):
        pa, pb = a["answers"]["what"]["probabilities"], b["answers"]["what"]["probabilities"]
        return max(abs(pa[k] - pb[k]) for k in pa)

    assert gap(plain, one) > 1e-2 and gap(one, two) > 1e-2 and gap(plain, clip) > 1e-2
    assert one["usage"]["input_tokens"] > plain["usage"]["input_tokens"]
