"""Shared-prefix reuse (runtime/prefix.py) and the media-feature cache (runtime/cache.py) on tiny checkpoints.

The checkpoints are sharpened (tests/support/model_fixtures.py), so different states, images or questions move the
option probabilities by ~0.1, far above the 1e-2 tolerance: a suffix answered on the wrong cache, with the
wrong positions or with another request's image would fail. A question answered from a cached prefix and
from its whole prompt differ only by BF16 rounding (measured ~4e-3 at most).
"""

from __future__ import annotations

import json

import pytest

from d3stream.runtime.cache import MediaFeatureCache
from d3stream.runtime.prefix import PrefixReuseUnavailable, PrefixRunner
from tests.support.media_makers import frames_array, noise_image
from tests.support.model_fixtures import float32

TOL = 1e-2

IMAGE_A = noise_image(160, 120, 11)
IMAGE_B = noise_image(120, 200, 12)
IMAGE_C = noise_image(224, 160, 13)

ROUTE = {"type": "choice", "instructions": "Where next?",
         "criteria": {"north": "toward the charger", "south": "back to the dock", "east": "through the corridor"}}
STOP = {"type": "noul", "instructions": "Should the robot stop now?"}
URGENCY = {"type": "score", "instructions": "How urgent is charging?", "criteria": ["none", "low", "high"]}
QUESTIONS = {"route": ROUTE, "stop": STOP, "urgency": URGENCY}


def full_prompts(model, requests):
    """Every row's probabilities on the reference per-request path."""
    out = {}
    for prepared in requests:
        out.update(model.run(prepared))
    return out


def max_delta(a, b, rows):
    return max(max(abs(x - y) for x, y in zip(a[row], b[row], strict=True)) for row in rows)


def all_rows(requests):
    return [row for prepared in requests for row in prepared.rows]


def text_requests(model):
    states = [
        "The corridor ahead is partly blocked; the battery is at 41 percent.",
        {"robot": "R2", "position": [3, 4], "battery": 0.41, "log": ["door 4 open", "lift 2 down"] * 20},
        "A customer was charged twice for order 5521 and asks for a refund. " * 12,
    ]
    return [model.prepare(state, QUESTIONS) for state in states]


def same_answers(a, b):
    """Two responses with the same questions whose probabilities agree within the tolerance."""
    if a["answers"].keys() != b["answers"].keys():
        return False
    for key, answer in a["answers"].items():
        left, right = answer["probabilities"], b["answers"][key]["probabilities"]
        if left.keys() != right.keys() or any(abs(left[k] - right[k]) > TOL for k in left):
            return False
    return True


def spread(results, rows):
    """How far apart the rows' answers are (the test would not notice a mix-up below this)."""
    firsts = [results[row][0] for row in rows]
    return max(firsts) - min(firsts)


# ------------------------------------------------------------------------------------------- prefix reuse


def test_text_prefix_reuse_matches_full_prompts(qwen35_model):
    model = qwen35_model
    requests = text_requests(model)
    passes = []
    runner = PrefixRunner(model, on_pass=passes.append)
    reused = runner.run(requests)
    reference = full_prompts(model, requests)
    rows = all_rows(requests)
    assert max_delta(reused, reference, rows) <= TOL
    assert spread(reference, [r.rows[0] for r in requests]) > 5 * TOL  # the states really matter
    report = runner.report()
    assert report["requests_reused"] == 3 and report["rows_reused"] == len(rows) and not report["fallbacks"]
    assert report["saved_tokens"] > 0
    kinds = [p.kind for p in passes]
    assert kinds.count("prefix") == 1  # the three prefixes in one pass
    assert kinds.count("suffix") == 1  # the nine suffixes of three requests in one pass (cross-request)
    suffix = next(p for p in passes if p.kind == "suffix")
    assert suffix.rows == len(rows) and set(suffix.done) == set(rows)
    # A tight budget splits the suffixes into several passes; answers stay the same.
    small = PrefixRunner(model, max_batch_tokens=160, max_batch_rows=4).run(requests)
    assert max_delta(small, reference, rows) <= TOL
    # Long prefixes alone (no padding mask), the suffixes still together.
    passes.clear()
    solo = PrefixRunner(model, solo_prefix_tokens=32, on_pass=passes.append).run(requests)
    assert [p.rows for p in passes if p.kind == "prefix"] == [1, 1, 1]
    assert max_delta(solo, reference, rows) <= TOL


def test_image_and_video_prefix_reuse_matches_full_prompts(qwen35_model):
    model = qwen35_model
    requests = [
        model.prepare("Two pictures of the yard.", QUESTIONS, images=[IMAGE_A, IMAGE_B]),
        model.prepare("One picture.", {"stop": STOP, "route": ROUTE}, images=[IMAGE_C]),
        model.prepare("A short clip.", {"stop": STOP, "urgency": URGENCY}, videos=[frames_array(6, 96, 64, seed=3)]),
        model.prepare("No picture at all.", QUESTIONS),
    ]
    reused = PrefixRunner(model).run(requests)
    reference = full_prompts(model, requests)
    rows = all_rows(requests)
    assert max_delta(reused, reference, rows) <= TOL
    assert spread(reference, [requests[0].rows[1], requests[1].rows[0]]) > 5 * TOL  # stop differs by image


def test_prefix_reuse_on_qwen3vl(qwen3vl_model):
    model = qwen3vl_model
    requests = [
        model.prepare("Two pictures of the yard.", QUESTIONS, images=[IMAGE_A, IMAGE_B]),
        *text_requests(model)[:2],
    ]
    runner = PrefixRunner(model)
    reused = runner.run(requests)
    assert runner.report()["rows_reused"] == len(all_rows(requests))
    assert max_delta(reused, full_prompts(model, requests), all_rows(requests)) <= TOL


def test_permutation_average_rows_share_the_prefix(qwen35_text_model):
    model = qwen35_text_model
    prepared = model.prepare("The corridor is blocked.", QUESTIONS, permutation_average=True)
    assert any(row.reversed for row in prepared.rows)
    runner = PrefixRunner(model)
    reused = runner.run([prepared])
    assert runner.report()["rows_reused"] == len(prepared.rows)
    assert prepared.answers(reused)["answers"].keys() == QUESTIONS.keys()
    assert max_delta(reused, model.run(prepared), prepared.rows) <= TOL


def test_single_question_requests_run_as_full_prompts(qwen35_text_model):
    model = qwen35_text_model
    one = model.prepare("Alone.", {"stop": STOP})
    two = model.prepare("Together.", {"stop": STOP, "route": ROUTE})
    runner = PrefixRunner(model)
    out = runner.run([one, two])
    report = runner.report()
    assert report["requests_full"] == 1 and report["requests_reused"] == 1 and not report["fallbacks"]
    assert out[one.rows[0]] == model.forward(one.rows)[0]


def test_refuses_noncausal_checkpoints(qwen35_noncausal_model):
    with pytest.raises(PrefixReuseUnavailable, match="noncausal_full_attention"):
        PrefixRunner(qwen35_noncausal_model)


def test_prefix_is_the_rows_shared_ids_whatever_the_tokenizer_merges(qwen35_text_model, monkeypatch):
    """A state whose tail BPE merges with the question header's newlines ("\\t\\n\\n" is one token) is served from a
    shared prefix too: the prefix is cut from the rows' own ids, not from tokenizing the prefix text, so planning
    makes no tokenizer call and answers stay those of the full prompts."""
    model = qwen35_text_model
    # A format that keeps the state's trailing tab: tokenized alone, the text before the question header would
    # end in another token than the full prompts have there.
    monkeypatch.setattr(model.contract, "describe",
                        lambda value: "" if value is None else value if isinstance(value, str) else json.dumps(value))
    merged = model.prepare("A state that ends with a tab\t", QUESTIONS)
    fine = model.prepare("A state that ends with a full stop.", QUESTIONS)
    seen = []
    runner = PrefixRunner(model, on_fallback=lambda reason, prepared: seen.append(reason))
    calls = []
    tokenizer = model.tokenizer
    monkeypatch.setattr(model.checkpoint, "tokenizer", lambda *a, **k: calls.append(a) or tokenizer(*a, **k))
    plans = [runner.plan(merged), runner.plan(fine)]
    assert calls == [] and seen == []
    for plan, prepared in zip(plans, (merged, fine), strict=True):
        assert plan is not None and all(row.ids[: plan.length] == plan.ids for row in prepared.rows)
        # the longest shared run: the rows part at the first token that differs, each keeps a suffix
        assert len({row.ids[plan.length] for row in prepared.rows}) > 1
    monkeypatch.setattr(model.checkpoint, "tokenizer", tokenizer)
    out = runner.run([merged, fine])
    report = runner.report()
    assert report["requests_reused"] == 2 and not report["fallbacks"]
    assert max_delta(out, model.run(merged), merged.rows) <= TOL
    assert max_delta(out, model.run(fine), fine.rows) <= TOL


def test_identical_questions_keep_a_token_of_their_own(qwen35_text_model):
    model = qwen35_text_model
    prepared = model.prepare("The corridor is blocked.", {"a": STOP, "b": STOP})
    plan = PrefixRunner(model).plan(prepared)
    assert plan is not None and plan.length == prepared.rows[0].length - 1
    out = PrefixRunner(model).run([prepared])
    assert max_delta(out, model.run(prepared), prepared.rows) <= TOL


def test_verify_every_reports_delta(qwen35_text_model):
    model = qwen35_text_model
    requests = text_requests(model)
    checks = []
    runner = PrefixRunner(model, verify_every=2, on_check=checks.append)
    runner.run(requests)
    rows = len(all_rows(requests))
    assert len(checks) == (rows + 1) // 2  # questions 0, 2, 4, ...
    assert all(check.passed and 0 <= check.max_abs_dp <= TOL for check in checks)
    report = runner.report()
    assert report["checks"] == len(checks) and report["failed_checks"] == 0 and report["enabled"]
    assert report["max_abs_dp"] == max(check.max_abs_dp for check in checks)


def test_verify_failure_falls_back_to_full_prompts(qwen35_text_model, monkeypatch):
    model = qwen35_text_model
    requests = text_requests(model)
    original = PrefixRunner._prefix_pass

    def corrupted(self, group):  # a cache bug: every cached state zeroed
        states = original(self, group)
        for state in states.values():
            state.layers = [(kind, a.clone().zero_(), b.clone().zero_()) for kind, a, b in state.layers]
        return states

    monkeypatch.setattr(PrefixRunner, "_prefix_pass", corrupted)
    checks, fallbacks = [], []
    runner = PrefixRunner(model, verify_every=4, on_check=checks.append,
                          on_fallback=lambda reason, prepared: fallbacks.append(reason))
    out = runner.run(requests)
    assert any(not check.passed for check in checks)
    assert runner.max_abs_dp > TOL
    # Every answer of the round comes from full prompts, not from the corrupted caches.
    assert max_delta(out, full_prompts(model, requests), all_rows(requests)) <= TOL
    report = runner.report()
    assert not report["enabled"] and "exact-replay" in report["disabled_reason"]
    assert fallbacks == ["verify_failed"] * 3 and report["rows_reused"] == 0
    # Sticky: later requests run as full prompts without trying the prefix again.
    later = model.prepare("Later.", QUESTIONS)
    runner.run([later])
    assert runner.report()["fallbacks"]["disabled"] == 1


# ------------------------------------------------------------------------------------------- media cache


@pytest.fixture
def counted_encodes(qwen35_model, monkeypatch):
    calls = []
    encode = qwen35_model.backbone.get_image_features

    def counting(pixels, grid, **kwargs):
        calls.append(int(grid.shape[0]))
        return encode(pixels, grid, **kwargs)

    monkeypatch.setattr(qwen35_model.backbone, "get_image_features", counting)
    return calls


def test_media_cache_encodes_an_image_once(qwen35_model, counted_encodes, monkeypatch):
    model = qwen35_model
    plain_a = model.system_one(state="Yard.", questions=QUESTIONS, images=[IMAGE_A, IMAGE_B])
    plain_b = model.system_one(state="Other yard.", questions=QUESTIONS, images=[IMAGE_B])
    counted_encodes.clear()
    lookups = []
    cache = MediaFeatureCache(on_lookup=lookups.append)
    monkeypatch.setattr(model, "media_cache", cache)
    cached_a = model.system_one(state="Yard.", questions=QUESTIONS, images=[IMAGE_A, IMAGE_B])
    cached_b = model.system_one(state="Other yard.", questions=QUESTIONS, images=[IMAGE_B])
    assert counted_encodes == [2]  # both images of the first request in one call; IMAGE_B never again
    assert lookups == [False, False, True]
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["encoded"], stats["entries"]) == (1, 2, 2, 2)
    assert same_answers(cached_a, plain_a) and same_answers(cached_b, plain_b)  # same features, same answers
    # The same image twice in one request: encoded once, both placeholders filled.
    counted_encodes.clear()
    twice = model.system_one(state="Twice.", questions={"stop": STOP}, images=[IMAGE_C, IMAGE_C])
    assert counted_encodes == [1]
    monkeypatch.setattr(model, "media_cache", None)
    assert same_answers(model.system_one(state="Twice.", questions={"stop": STOP}, images=[IMAGE_C, IMAGE_C]), twice)


def test_media_cache_is_bounded_by_bytes(qwen35_model, counted_encodes, monkeypatch):
    model = qwen35_model
    probe = MediaFeatureCache()
    monkeypatch.setattr(model, "media_cache", probe)
    model.system_one(state="s", questions={"stop": STOP}, images=[IMAGE_A])
    size_a = probe.bytes
    model.system_one(state="s", questions={"stop": STOP}, images=[IMAGE_B])
    size_b = probe.bytes - size_a
    # Room for either entry, not for both.
    cache = MediaFeatureCache(max_bytes=max(size_a, size_b) + min(size_a, size_b) // 2)
    monkeypatch.setattr(model, "media_cache", cache)
    for image in (IMAGE_A, IMAGE_A, IMAGE_B, IMAGE_A):
        model.system_one(state="s", questions={"stop": STOP}, images=[image])
        assert cache.bytes <= cache.max_bytes
    stats = cache.stats()
    assert (stats["hits"], stats["misses"]) == (1, 3)  # A, A (hit), B (evicts A), A again (evicts B)
    assert stats["evictions"] == 2 and stats["entries"] == 1
    # An entry larger than the whole budget is encoded but not kept.
    tiny = MediaFeatureCache(max_bytes=16)
    monkeypatch.setattr(model, "media_cache", tiny)
    model.system_one(state="s", questions={"stop": STOP}, images=[IMAGE_A])
    assert len(tiny) == 0 and tiny.bytes == 0


def test_media_cache_keys_depend_on_processor_settings_and_content(qwen35_model, monkeypatch):
    model = qwen35_model
    # Prepared without a cache, a request takes no content digests (its decoded media go once it is
    # prepared): the cache has no keys for it, so it is encoded and not kept.
    assert MediaFeatureCache().keys(model, model.prepare("s", {"stop": STOP}, images=[IMAGE_A]).media, "image") is None
    cache = MediaFeatureCache()
    monkeypatch.setattr(model, "media_cache", cache)  # from now on the digests are taken while preparing
    media = model.prepare("s", {"stop": STOP}, images=[IMAGE_A, IMAGE_B]).media
    keys = cache.keys(model, media, "image")
    assert len(set(keys)) == 2 and cache.keys(model, media, "image") == keys
    assert cache.keys(model, model.prepare("t", {"stop": STOP}, images=[IMAGE_B]).media, "image") == keys[1:]
    processor = model.processor.image_processor
    monkeypatch.setattr(processor, "image_mean", [0.25, 0.25, 0.25])  # same grid, different pixels seen
    changed = cache.keys(model, media, "image")
    assert not set(changed) & set(keys)


def test_media_cache_does_not_serve_features_encoded_in_another_dtype(qwen35_model, counted_encodes, monkeypatch):
    """Features cached while the tower ran in BF16 are not reused once it runs in FP32: the FP32 answer is
    the one an uncached FP32 run gives."""
    model = qwen35_model
    with float32(model):
        uncached = model.system_one(state="Yard.", questions={"stop": STOP}, images=[IMAGE_A])
    monkeypatch.setattr(model, "media_cache", MediaFeatureCache())
    model.system_one(state="Yard.", questions={"stop": STOP}, images=[IMAGE_A])  # cached in the model's dtype
    counted_encodes.clear()
    with float32(model):
        cached = model.system_one(state="Yard.", questions={"stop": STOP}, images=[IMAGE_A])
    assert counted_encodes == [1]  # encoded again in FP32, not looked up
    assert cached["answers"] == uncached["answers"]


def test_media_cache_lru_order():
    import torch

    cache = MediaFeatureCache(max_bytes=3 * 64)
    from d3stream.runtime.cache import Entry

    def entry():
        tensor = torch.zeros(16)  # 64 bytes
        return Entry(tensor, None, 64)

    for key in "abc":
        cache.put(key, entry())
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", entry())  # evicts b, the least recently used
    assert "b" not in cache and {"a", "c", "d"} <= set(cache._entries)
    assert cache.get("b") is None
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1 and cache.stats()["evictions"] == 1
