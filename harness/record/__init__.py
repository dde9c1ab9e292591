"""The run's vocabulary: events, findings, observations, limits, verdicts and journal I/O.

Every side shares this leaf: the runner and detectors produce these records, the journal
stores them, reports and the pytest plugin read them. It imports nothing else of `harness`
(only `canaries` and `tenants`, below it), so `reports` can depend on it alone.
"""
