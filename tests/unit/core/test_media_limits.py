"""Media limits without a broker (d3stream/core/storage.py, decoding.py): allowlist prefixes match whole path
segments, malformed ``s3://`` references are ``media_not_allowed``, a decode past its deadline is abandoned and
the next one decodes, and budgets are spent per reference from headers before decoding. On the broker and
store: tests/integration/test_media_limits.py."""

from __future__ import annotations

import asyncio

import pytest

from d3stream.core.decoding import DecodeTimeout, MediaDecoder
from d3stream.core.storage import Allowlist, MediaError, S3Location, parse_s3_reference
from d3stream.runtime import media
from tests.support.media_makers import make_mp4, make_mp4_bomb, make_png, make_smooth_png

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------------------- allowlist


@pytest.mark.parametrize("entry", ["media/cams", "media/cams/", "media/cams//"])
def test_allowlist_prefixes_match_whole_path_segments(entry):
    allowlist = Allowlist([entry])
    assert allowlist.allows(S3Location("media", "cams/a.png"))
    assert allowlist.allows(S3Location("media", "cams/deep/a.png"))
    assert not allowlist.allows(S3Location("media", "camsEVIL/a.png"))
    assert not allowlist.allows(S3Location("media", "cams"))  # the prefix itself names no object under it
    assert not allowlist.allows(S3Location("media", "other/cams/a.png"))
    assert not allowlist.allows(S3Location("media-2", "cams/a.png"))


def test_a_bucket_entry_allows_the_whole_bucket_and_only_it():
    for entry in ("media", "media/"):
        allowlist = Allowlist([entry])
        assert allowlist.allows(S3Location("media", "any/key.png"))
        assert not allowlist.allows(S3Location("mediaX", "any/key.png"))


@pytest.mark.parametrize(
    "reference",
    ["s3://[media]/x.png", "s3://[::1/x.png", "s3://user@media/x.png", "s3://media:9000/x.png", "s3://MEDIA/x.png"],
)
def test_malformed_s3_references_are_media_not_allowed(reference):
    with pytest.raises(MediaError) as caught:
        parse_s3_reference(reference)
    assert caught.value.code == "media_not_allowed"


@pytest.mark.parametrize(("reference", "reason"), [
    ("s3://me\tdia/x.png", "control character '\\t'"),  # urlsplit would drop the tab: bucket "media"
    ("s3://media/x\n.png", "control character '\\n'"),
    ("s3://media//x.png", "empty segments"),  # would have read media/x.png
    ("s3://media/x.png#other", "#fragment"),  # would have read media/x.png
    ("s3://media/x.png?versionId=1&versionId=2", "one ?versionId"),
    ("s3://media/x.png?acl", "one ?versionId"),
])
def test_references_a_url_parser_would_rewrite_are_refused_naming_why(reference, reason):
    allowed = Allowlist(["media"])
    with pytest.raises(MediaError) as caught:
        location = parse_s3_reference(reference)
        assert not allowed.allows(location), f"{reference!r} read as {location}"
    assert caught.value.code == "media_not_allowed"
    assert reason in caught.value.message


def test_a_plain_reference_and_a_version_still_parse():
    assert parse_s3_reference("s3://media/cams/a.png") == S3Location("media", "cams/a.png")
    assert parse_s3_reference("s3://media/a.png?versionId=v7") == S3Location("media", "a.png", "v7")


# ------------------------------------------------------------------------------------------ decoding


def test_a_decode_past_its_deadline_is_abandoned_and_the_next_one_decodes():
    # 30,000 frames whose only keyframe is the first: each of the 32 seeks decodes from frame 0 (minutes).
    bomb = make_mp4_bomb(30_000, 320, 180, fps=1000, keyframe="first")
    clip = make_mp4(20, 64, 48, 10)
    decoder = MediaDecoder(timeout_s=1.0, max_pixels=100_000_000, max_video_frames=128)

    async def scenario():
        decoder.warm()
        with pytest.raises(DecodeTimeout, match=r"longer than 1 s and was abandoned \(setting: media_decode_timeout_s\)"):
            await decoder.decode([], [bomb])
        assert decoder.processes.abandoned == 1
        # The next request decodes in a new process. Its start (interpreter, numpy, OpenCV) is not what the
        # deadline is about, and on a loaded 2-core machine it alone took over a second: a deadline for the next
        # decode that only a slow start could miss.
        decoder.timeout_s = decoder.processes.timeout_s = 60.0
        decoded = await decoder.decode([make_png(32, 32)] * 3, [clip, clip])
        return decoded

    try:
        decoded = asyncio.run(scenario())
    finally:
        decoder.close()
    # Repeated references: decoded once, the same object at each place.
    assert decoded.images[0] is decoded.images[1] is decoded.images[2]
    assert decoded.videos[0] is decoded.videos[1] and len(decoded.videos[0].frames) == 4
    # ... and counted once in what the media hold.
    frames, height, width = decoded.videos[0].frames.shape[:3]
    assert decoded.memory == media.image_memory(32 * 32) + media.video_memory(frames, height * width)


def test_budgets_are_spent_per_reference_from_headers_before_decoding():
    big = make_smooth_png(4000, 4000)
    decoder = MediaDecoder(timeout_s=10.0, max_pixels=100_000_000, max_video_frames=8)

    async def scenario():
        with pytest.raises(media.MediaBudgetExceeded, match=r"images\[6\] .*setting: max_media_pixels"):
            await decoder.decode([big] * 7, [])
        with pytest.raises(media.MediaBudgetExceeded, match=r"videos\[0\].*setting: max_video_frames"):
            await decoder.decode([], [make_mp4(100, 32, 32, 10)])  # 20 sampled frames

    try:
        asyncio.run(scenario())
    finally:
        decoder.close()
