"""`field_record`: one slotted instance as the dict the journal and summary.json record."""

from __future__ import annotations

import json

from kvcanary.canaries.guarantee import PageGuarantee
from kvcanary.canaries.records import field_record

GUARANTEE = PageGuarantee(page_size=16, canary_tokens=46, window=91)


def test_fields_in_declaration_order_under_their_names() -> None:
    assert list(field_record(GUARANTEE).items()) == [
        ("page_size", 16),
        ("canary_tokens", 46),
        ("window", 91),
    ]


def test_a_renamed_field_keeps_its_place() -> None:
    record = field_record(GUARANTEE, renamed={"window": "guaranteed_window"})

    assert list(record) == ["page_size", "canary_tokens", "guaranteed_window"]
    assert record["guaranteed_window"] == 91


def test_a_value_for_a_field_replaces_it_in_place_and_derived_values_follow() -> None:
    record = field_record(GUARANTEE, canary_tokens=-1, per_page=GUARANTEE.per_page)

    assert json.dumps(record) == (
        '{"page_size": 16, "canary_tokens": -1, "window": 91, "per_page": false}'
    )
