"""Who leaked to whom: the leak matrix (reader tenant x owner tenant) and the first leak.

A leak is a content finding: a response (read by the *reader*, the tenant that got it)
holding a canary minted for another request (its *owner*): `cross_tenant_canary` (owner:
the victim tenant), `cross_request_canary` (owner: the reader itself, another request; the
diagonal) and `unknown_canary` (owner unknown). Other kinds (an accepted over-limit prompt,
a fast prefill) are evidence of the mechanism, not of data crossing, and are not counted
here. The matrix is part of `summary.json` (`leaks`) and opens `report.html`.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvcanary.harness.record.finding import FindingKind

LEAK_KINDS = (
    str(FindingKind.CROSS_TENANT_CANARY),
    str(FindingKind.CROSS_REQUEST_CANARY),
    str(FindingKind.UNKNOWN_CANARY),
)
UNKNOWN_OWNER = "unknown origin"


def owners(findings: pd.DataFrame) -> pd.Series[Any]:
    """Each finding's owner: whose canary it showed (None for kinds that show none)."""
    kind = findings["kind"].astype(str)
    owner = findings["victim_tenant"].astype(object)
    owner = owner.where(kind != str(FindingKind.CROSS_REQUEST_CANARY), findings["tenant"])
    unknown = (kind == str(FindingKind.UNKNOWN_CANARY)) & owner.isna()
    owner = owner.where(~unknown, UNKNOWN_OWNER)
    return owner.where(kind.isin(LEAK_KINDS), None)


def leak_matrix(
    findings: pd.DataFrame, tenants: list[str], t_start: float | None
) -> dict[str, Any]:
    """The matrix as JSON-ready values: `readers` (rows), `owners` (columns), `counts`
    (rows of counts), `num_leaks`, and the first leak's time (`first_t_wall`, and
    `first_after_s` since the run started)."""
    leaks = findings.loc[findings["kind"].astype(str).isin(LEAK_KINDS)]
    owner = owners(leaks)
    reader = leaks["tenant"].astype(object).fillna("?")
    seen_readers = [str(r) for r in pd.unique(reader)]
    seen_owners = [str(o) for o in pd.unique(owner.dropna())]
    readers = list(dict.fromkeys([*tenants, *seen_readers]))
    columns = list(dict.fromkeys([*tenants, *(o for o in seen_owners if o != UNKNOWN_OWNER)]))
    if UNKNOWN_OWNER in seen_owners:
        columns.append(UNKNOWN_OWNER)
    table = pd.crosstab(reader, owner) if len(leaks) else pd.DataFrame()
    table = table.reindex(index=readers, columns=columns, fill_value=0)
    first = float(leaks["t_wall"].min()) if len(leaks) else None
    return {
        "readers": readers,
        "owners": columns,
        "counts": [[int(v) for v in row] for row in table.to_numpy()],
        "num_leaks": len(leaks),
        "first_t_wall": first,
        "first_after_s": round(first - t_start, 3)
        if first is not None and t_start is not None
        else None,
    }
