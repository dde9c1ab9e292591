"""The run's vocabulary and output contract: what every side of kvcanary reads and writes.

- `events`: the journal's records (one dataclass per event), `decoding` rebuilds and checks
  them, `columns` derives their Arrow columns, `journal` writes and reads the file (and
  declares how each line starts);
- `finding`: the finding kinds, each with its severity, verdict and meaning (`KIND_RULES`);
  `judgement`: the one rule from findings to a verdict, and the table rendered for people;
- `verdict`: the verdicts and the only exit-status map;
- `outputs`: the files of a run directory and the shape of `summary.json`;
- `observation`, `ttft_model`: what a request looked like, and the timing rule.

It imports nothing else of `harness` (only `canaries` and `tenants`, below it), so `reports`
can depend on it alone; `columns` alone imports pyarrow, and only readers import it.
"""
