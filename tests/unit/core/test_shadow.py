"""Shadow evaluation without a broker (d3stream/core/shadow.py, d3stream/models/shadow.py): a share of 0.5 picks
the same requests by their id alone, and a shadow is a checkpoint of its own or a served name."""

from __future__ import annotations

import pytest

from d3stream.core.shadow import chosen
from d3stream.models.shadow import parse_shadow, shadow_hosted
from d3stream.settings import load_settings

pytestmark = pytest.mark.timeout(300)


def test_a_share_of_0_5_picks_the_same_requests_by_id_alone():
    ids = [f"request-{n}" for n in range(2000)]
    picked = {rid for rid in ids if chosen(rid, 0.5)}
    assert picked == {rid for rid in reversed(ids) if chosen(rid, 0.5)}  # a function of the id, not of order
    assert 900 < len(picked) < 1100
    assert {rid for rid in ids if chosen(rid, 0.1)} <= picked  # a smaller share is a subset: raising it adds
    assert all(chosen(rid, 1.0) for rid in ids) and not any(chosen(rid, 0.0) for rid in ids)


def test_shadow_values_are_a_checkpoint_of_its_own_or_a_served_name(tmp_path):
    assert parse_shadow("cand=/ckpt/v5").location == "/ckpt/v5"
    assert parse_shadow("live").location is None
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_shadow("/ckpt/v5")
    with pytest.raises(ValueError, match="shadow_share"):
        load_settings({"shadow": "live", "shadow_share": "1.5"}, environ={})

    class Served:
        name = "live"

    with pytest.raises(ValueError, match="not a served model .*'live'"):
        shadow_hosted(load_settings({"shadow": "other"}, environ={}).models, [Served()], None)
