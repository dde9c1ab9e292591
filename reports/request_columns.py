"""The request table's columns, cut from Arrow record batches block by block, then joined.

`reports.journal_scan` parses plan and observation lines with Arrow; each merged batch is
cut down at once to compact numpy columns here (`Filled`: string columns as codes into one
category list per column, `Codes`), and at the end the observations are joined to their
plans by a 64-bit hash of the request id (`join`), vectorised, every match then checked
against the ids themselves. Anything this cannot read exactly as the event-by-event reader
would (a request id planned or observed twice, two ids with one hash) raises
`SlowPathNeeded`.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvcanary.reports.journal_lines import SlowPathNeeded, hash_slices

MAX_ERROR_CHARS = 200
"""An observation's error text is cut to this many characters in the request table."""
DELIBERATE_ERRORS = ("disconnected", "cancelled")
"""Error kinds of requests the harness ended itself: an abort plan doing its job, Ctrl-C."""
PLAN_CODES = ("tenant", "phase", "intent", "size_label", "expected", "api")
"""The plan's string columns, kept as category codes."""

_S, _I, _F = pa.string(), pa.int64(), pa.float64()

_Kind = Literal["id", "codes", "ints", "floats", "bools"]
PLAN_KINDS: dict[str, _Kind] = {
    "request_id": "id",
    **dict.fromkeys(PLAN_CODES, "codes"),
    "num_prompt_tokens": "ints",
    "max_tokens": "ints",
    "num_canaries": "ints",
}
OBSERVATION_KINDS: dict[str, _Kind] = {
    "request_id": "id",
    "observed_tenant": "codes",
    "status": "ints",
    "ok": "bools",
    "outcome": "codes",
    "error_kind": "codes",
    "error": "codes",
    "finish_reason": "codes",
    "ttft_ms": "floats",
    "queue_ms": "floats",
    "total_ms": "floats",
    "prompt_tokens": "ints",
    "completion_tokens": "ints",
    "cached_tokens": "ints",
    "num_text_chars": "ints",
    "num_chunks": "ints",
    "text_redacted": "bools",
    "t_wall": "floats",
}
_DTYPES: dict[_Kind, type[np.generic]] = {
    "codes": np.int8,
    "ints": np.int64,
    "floats": np.float64,
    "bools": np.bool_,
}
ID_MERGE_BLOCKS = 64
"""Blocks of request ids merged into one array (compact buffers instead of many small)."""


class Filled:
    """Columns of a known length, filled block by block; request ids as Arrow arrays."""

    def __init__(self, kinds: dict[str, _Kind], length: int) -> None:
        self.kinds = kinds
        self.length = length
        self.filled = 0
        self.ids: list[pa.Array] = []
        self.hashes = np.empty(length, np.uint64)
        """Each request id's 64-bit hash: the join matches these, then checks the ids."""
        self.num_unmerged = 0
        self.arrays: dict[str, npt.NDArray[Any]] = {}
        self.masks: dict[str, npt.NDArray[np.bool_]] = {}
        for name, kind in kinds.items():
            if kind != "id":
                self.arrays[name] = np.empty(length, _DTYPES[kind])
            if kind == "ints":
                self.masks[name] = np.empty(length, np.bool_)

    def add(self, block: dict[str, Any]) -> None:
        ids = block.pop("request_id")
        if ids.null_count:
            raise SlowPathNeeded("a request line without a request id")
        start, end = self.filled, self.filled + len(ids)
        if end > self.length:
            raise SlowPathNeeded("more request lines parsed than counted")
        for name, part in block.items():
            if isinstance(part, tuple):
                self.arrays[name][start:end], self.masks[name][start:end] = part
                continue
            if self.kinds[name] == "codes" and len(part):
                self._widen(name, int(part.max()))
            self.arrays[name][start:end] = part
        self.hashes[start:end] = id_hashes(ids)
        self.filled = end
        self.ids.append(ids)
        self.num_unmerged += 1
        if self.num_unmerged == ID_MERGE_BLOCKS:
            merged = pa.concat_arrays(self.ids[-ID_MERGE_BLOCKS:])
            del self.ids[-ID_MERGE_BLOCKS:]
            self.ids.append(merged)
            self.num_unmerged = 0

    def _widen(self, name: str, code: int) -> None:
        """Codes start as int8 (most string columns have a few values) and widen once a
        column has more categories than its type holds."""
        array = self.arrays[name]
        if code > np.iinfo(array.dtype).max:
            wider = np.int16 if code <= np.iinfo(np.int16).max else np.int32
            self.arrays[name] = array.astype(wider)

    def take_ids(self) -> pa.ChunkedArray:
        ids = pa.chunked_array(self.ids, _S)
        self.ids = []
        return ids


def id_hashes(ids: pa.Array) -> npt.NDArray[np.uint64]:
    """`hash_slices` of each id's UTF-8 bytes, read from the Arrow buffers as they are."""
    _, offsets_buffer, data_buffer = ids.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32, len(ids) + 1, 4 * ids.offset)
    starts = offsets[:-1].astype(np.int64)
    data = (
        np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else np.empty(0, np.uint8)
    )
    return hash_slices(data, starts, np.diff(offsets).astype(np.int64))


class Codes:
    """Category lists shared by every block, one per string column (`tenant` and
    `observed_tenant` share one): a block's dictionary becomes global codes, -1 for null."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, int]] = {}

    def encode(self, name: str, column: pa.Array) -> npt.NDArray[np.int32]:
        encoded = pc.dictionary_encode(column)
        known = self.values.setdefault(name, {})
        lookup = [known.setdefault(value, len(known)) for value in encoded.dictionary.to_pylist()]
        indices = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
        # -1 (null) picks the last entry, which is -1 itself
        global_codes: npt.NDArray[np.int32] = np.array([*lookup, -1], np.int32)[indices]
        return global_codes

    def categories(self, name: str) -> list[str]:
        return list(self.values.get(name, {}))


def _ints(column: pa.Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Values (0 where null) and the null mask."""
    values = pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return values, pc.is_null(column).to_numpy(zero_copy_only=False)


def _floats(column: pa.Array) -> npt.NDArray[np.float64]:
    array: npt.NDArray[np.float64] = column.to_numpy(zero_copy_only=False).astype(
        np.float64, copy=False
    )
    return array


def _bools(column: pa.Array) -> npt.NDArray[np.bool_]:
    array: npt.NDArray[np.bool_] = pc.fill_null(column, False).to_numpy(zero_copy_only=False)
    return array


def plan_columns(batch: pa.RecordBatch, codes: Codes) -> dict[str, Any]:
    rows = batch.filter(pc.equal(batch.column("type"), "plan"))
    columns: dict[str, Any] = {"request_id": rows.column("request_id")}
    for name in PLAN_CODES:
        columns[name] = codes.encode(name, rows.column(name))
    columns["num_prompt_tokens"] = _ints(rows.column("num_prompt_tokens"))
    columns["max_tokens"] = _ints(rows.column("max_tokens"))
    listed = pc.list_value_length(rows.column("canaries"))  # journals before the packing
    columns["num_canaries"] = _ints(pc.coalesce(rows.column("num_canaries"), listed))
    return columns


def observation_columns(batch: pa.RecordBatch, codes: Codes) -> dict[str, Any]:
    rows = batch.filter(pc.equal(batch.column("type"), "observation"))
    status, error_kind = rows.column("status"), rows.column("error_kind")
    sent = rows.column("t_sent_ns")
    ok = pc.and_kleene(
        pc.and_kleene(pc.greater_equal(status, 200), pc.less(status, 300)),
        pc.is_null(error_kind),
    )
    ok = pc.fill_null(ok, False)
    usage = rows.column("usage")
    error = pc.utf8_slice_codeunits(rows.column("error"), 0, MAX_ERROR_CHARS)
    return {
        "request_id": rows.column("request_id"),
        "observed_tenant": codes.encode("tenant", rows.column("tenant")),
        "status": _ints(status),
        "ok": _bools(ok),
        "outcome": codes.encode("outcome", _outcome(ok, status, error_kind)),
        "error_kind": codes.encode("error_kind", error_kind),
        "error": codes.encode("error", error),
        "finish_reason": codes.encode("finish_reason", rows.column("finish_reason")),
        "ttft_ms": _floats(_ms(pc.subtract(rows.column("t_first_token_ns"), sent))),
        "queue_ms": _floats(_ms(pc.subtract(sent, rows.column("t_scheduled_ns")))),
        "total_ms": _floats(_ms(pc.subtract(rows.column("t_done_ns"), sent))),
        "prompt_tokens": _ints(pc.struct_field(usage, "prompt_tokens")),
        "completion_tokens": _ints(pc.struct_field(usage, "completion_tokens")),
        "cached_tokens": _ints(pc.struct_field(usage, "cached_tokens")),
        "num_text_chars": _ints(rows.column("num_text_chars")),
        "num_chunks": _ints(rows.column("num_chunks")),
        "text_redacted": _bools(rows.column("text_redacted")),
        "t_wall": _floats(rows.column("t_wall")),
    }


def _ms(ns: pa.Array) -> pa.Array:
    return pc.divide(pc.cast(ns, _F), 1e6)


def _outcome(ok: pa.Array, status: pa.Array, error_kind: pa.Array) -> pa.Array:
    """As `reports.frames.outcome_of`, for a column of observations."""
    two_xx = pc.and_kleene(pc.greater_equal(status, 200), pc.less(status, 300))
    http_error = pc.or_(
        pc.fill_null(pc.equal(error_kind, "http_status"), False),
        pc.fill_null(pc.and_kleene(pc.is_valid(status), pc.invert(two_xx)), False),
    )
    deliberate = pc.fill_null(pc.is_in(error_kind, pa.array(DELIBERATE_ERRORS)), False)
    return pc.case_when(
        pc.make_struct(ok, http_error, deliberate),
        "accepted",
        "rejected",
        "disconnected",
        "errored",
    )


_TO_PANDAS = {_I: pd.Int64Dtype()}
_STR_DTYPE = pd.StringDtype("pyarrow", na_value=np.nan)
"""pandas' default `str` dtype, as Arrow strings convert to."""


def _pandas(array: pa.Array) -> pd.Series[Any]:
    series: pd.Series[Any] = array.to_pandas(types_mapper=_TO_PANDAS.get)
    return series


def _categorical(
    codes: npt.NDArray[np.signedinteger[Any]], categories: list[str]
) -> pd.Series[Any]:
    """Codes as a pandas categorical of the categories present, in order of first
    appearance (as Arrow's `dictionary_encode` of the whole column gives them)."""
    present, first = np.unique(codes[codes >= 0], return_index=True)
    ranked = present[np.argsort(first, kind="stable")]
    remap = np.full(len(categories) + 1, -1, np.int32)
    remap[ranked] = np.arange(len(ranked), dtype=np.int32)
    local = remap[codes]  # -1 (null) picks the last entry, -1
    indices = pa.array(local, mask=local < 0, type=pa.int32())
    dictionary = pa.array([categories[i] for i in ranked], _S)
    return _pandas(pa.DictionaryArray.from_arrays(indices, dictionary))


def join(plans: Filled, observations: Filled, codes: Codes) -> pd.DataFrame:
    """Observations with their plans (a lost plan leaves nulls and the observed tenant),
    then the plans nothing answered; one column at a time, each input freed once used."""
    # Matched by hash, sorted (a hash table of a million ids would cost far more), then
    # every match checked against the ids themselves.
    order = np.argsort(plans.hashes, kind="stable")
    hashes = plans.hashes[order]
    del plans.hashes
    if np.any(hashes[1:] == hashes[:-1]):
        raise SlowPathNeeded("a request id planned twice (or two ids with one hash)")
    position = np.minimum(np.searchsorted(hashes, observations.hashes), max(len(hashes) - 1, 0))
    found = hashes[position] == observations.hashes if len(hashes) else position < 0
    del hashes, observations.hashes
    plan_of = np.where(found, order[position] if len(order) else -1, -1)  # -1: a lost plan
    del order, position, found
    plan_ids = plans.take_ids().combine_chunks()
    observed_ids = observations.take_ids()
    _check_matches(plan_ids, observed_ids, plan_of)
    matched = plan_of[plan_of >= 0]
    answered = np.zeros(len(plan_ids), bool)
    answered[matched] = True
    if int(answered.sum()) != len(matched):
        raise SlowPathNeeded("a request observed twice")
    del matched
    unanswered = np.flatnonzero(~answered)
    del answered
    num_observed, num_unanswered = len(plan_of), len(unanswered)
    rows = np.concatenate([plan_of, unanswered])  # -1 (a lost plan) reads a null sentinel
    del plan_of
    columns: dict[str, pd.Series[Any]] = {}
    unanswered_ids = plan_ids.take(pa.array(unanswered, pa.int64()))
    ids = pa.chunked_array([*observed_ids.chunks, unanswered_ids], _S)
    del observed_ids, plan_ids, unanswered, unanswered_ids
    # wrapped as they are (pandas' Arrow-backed `str`); a conversion would copy them
    columns["request_id"] = ids.to_pandas(types_mapper={_S: _STR_DTYPE}.get)
    del ids
    observed_tenant = observations.arrays.pop("observed_tenant")
    for name in [name for name in plans.kinds if name != "request_id"]:
        values = plans.arrays.pop(name)
        if plans.kinds[name] == "codes":
            gathered = np.append(values, values.dtype.type(-1))[rows]
            del values
            if name == "tenant":
                lost = gathered[:num_observed] < 0
                gathered[:num_observed][lost] = observed_tenant[lost]
                del lost
            columns[name] = _categorical(gathered, codes.categories(name))
        else:
            mask = np.append(plans.masks.pop(name), True)[rows]
            gathered = np.append(values, np.int64(0))[rows]
            del values
            columns[name] = _integers(gathered, mask)
        del gathered
    del observed_tenant, rows
    columns["answered"] = pd.Series(np.arange(num_observed + num_unanswered) < num_observed)
    for name in [name for name in observations.kinds if name in observations.arrays]:
        columns[name] = _observed(name, observations, num_unanswered, codes)
    return pd.DataFrame(columns, copy=False)


CHECK_ROWS = 1 << 16
"""Matched ids compared this many at a time (a gathered copy of every plan id would cost
as much as the ids themselves)."""


def _check_matches(plan_ids: pa.Array, observed_ids: pa.ChunkedArray, plan_of: Any) -> None:
    """Every observation matched to a plan by hash has that plan's request id."""
    for start in range(0, len(plan_of), CHECK_ROWS):
        rows = plan_of[start : start + CHECK_ROWS]
        planned = plan_ids.take(pa.array(rows, mask=rows < 0))
        same = pc.equal(observed_ids.slice(start, len(rows)), planned)
        if pc.all(same).as_py() not in (True, None):
            raise SlowPathNeeded("two request ids with one hash")


def _observed(name: str, observations: Filled, num_unanswered: int, codes: Codes) -> pd.Series[Any]:
    """One observation column, the unanswered plans' rows appended (null, or the default
    `ok` False and `outcome` "unanswered")."""
    kind = observations.kinds[name]
    values = observations.arrays.pop(name)
    if kind == "ints":
        mask = observations.masks.pop(name)
        if num_unanswered:
            values = np.concatenate([values, np.zeros(num_unanswered, np.int64)])
            mask = np.concatenate([mask, np.ones(num_unanswered, bool)])
        return _integers(values, mask)
    if kind == "codes":
        filler = -1
        if name == "outcome":
            known = codes.values.setdefault("outcome", {})
            filler = known.setdefault("unanswered", len(known))
        if num_unanswered:
            values = np.concatenate([values, np.full(num_unanswered, filler, np.int32)])
        return _categorical(values, codes.categories(name))
    if kind == "bools":
        if not num_unanswered:
            return pd.Series(values)
        if name == "ok":
            return pd.Series(np.concatenate([values, np.zeros(num_unanswered, bool)]))
        # text_redacted: unknown without an answer
        return pd.Series(np.concatenate([values.astype(object), np.full(num_unanswered, None)]))
    if num_unanswered:
        values = np.concatenate([values, np.full(num_unanswered, np.nan)])
    return pd.Series(values)


def _integers(values: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]) -> pd.Series[Any]:
    return pd.Series(pd.arrays.IntegerArray(values, mask), copy=False)
