"""The journal's Arrow columns come from the dataclasses the journal writes, not a copy."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.json as pa_json
import pytest

from kvcanary.harness.record.columns import fields_of, line_schema
from kvcanary.harness.record.events import ObservationRecorded, PlanRecorded
from kvcanary.harness.record.journal import encode_event
from kvcanary.harness.record.observation import Observation, Usage
from kvcanary.tenants.plan import RequestPlan


def test_annotations_become_arrow_types() -> None:
    schema = line_schema(
        {
            "plan": ("request_id", "intent", "num_prompt_tokens", "canaries.index"),
            "observation": ("request_id", "status", "t_wall", "text_redacted", "usage"),
        }
    )
    assert schema == pa.schema(
        [
            ("type", pa.string()),
            ("request_id", pa.string()),
            ("intent", pa.string()),  # a Literal of strings
            ("num_prompt_tokens", pa.int64()),
            ("canaries", pa.list_(pa.struct([("index", pa.int64())]))),  # only the field picked
            ("status", pa.int64()),  # int | None
            ("t_wall", pa.float64()),
            ("text_redacted", pa.bool_()),
            (
                "usage",
                pa.struct(
                    [
                        ("prompt_tokens", pa.int64()),
                        ("completion_tokens", pa.int64()),
                        ("cached_tokens", pa.int64()),
                    ]
                ),
            ),
        ]
    )


def test_a_name_the_dataclass_does_not_declare_is_refused() -> None:
    with pytest.raises(KeyError, match="no field 'latency'"):
        fields_of(Observation, ["latency"])


def test_arrow_reads_journal_lines_with_the_derived_schema() -> None:
    plan = RequestPlan("r1", "alice", "fill", "victim", "small", 12, "accept", "chat", "p")
    observation = Observation(
        "r1", "alice", 200, 1.5, 1, 2, usage=Usage(prompt_tokens=12, cached_tokens=0)
    )
    lines = encode_event(PlanRecorded(plan)) + encode_event(ObservationRecorded(observation))
    schema = line_schema(
        {"plan": ("request_id", "num_prompt_tokens"), "observation": ("status", "usage")}
    )
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    table = pa_json.read_json(pa.BufferReader(lines), parse_options=options)
    assert table.to_pylist() == [
        {"type": "plan", "request_id": "r1", "num_prompt_tokens": 12, "status": None,
         "usage": None},
        {"type": "observation", "request_id": "r1", "num_prompt_tokens": None, "status": 200,
         "usage": {"prompt_tokens": 12, "completion_tokens": None, "cached_tokens": 0}},
    ]  # fmt: skip
    assert json.loads(lines.splitlines()[1])["usage"]["cached_tokens"] == 0
