"""The keyring: each run's canary key kept under its key id, so later runs can name it.

A canary decodes only under its own run's key. Without the key, a canary that survived a
run (in host-memory KV offload, a persistent prefix cache, a disk tier) and leaks into a
later one is only `unknown_canary`. With `--keyring FILE`, every run stores its key there,
with its run id, start time and tenant names; a later run given the same file decodes an
unknown canary under each earlier key and names it: "tenant-2's canary from run
20261202T030000Z (request t2-r000014), 14 h old".

The file holds secrets (whoever has it can attribute, and forge, those runs' canaries), so
it is created 0600 and a group- or world-readable one is refused, never read. It is written
only when the flag is given. The format is JSON:

    {"schema": 1, "keys": {"<key id>": {"key": "<hex>", "run_id": ..., "t_wall": ...,
                                       "num_words": 6, "tenants": ["tenant-0", ...],
                                       "alphabet": [<word-list digits>], "word_tokens": 1}}}

The alphabet (`canaries.alphabet`: the words the run's tokenizer spells canaries with) is
kept with the key, so a later run with another tokenizer still decodes the earlier canaries.

It knows nothing about detection: the content detector asks `EarlierRuns.explain`.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcanary.canaries import CanaryError, CanaryMinter
from kvcanary.canaries.alphabet import make_alphabet
from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.mint import seed_key
from kvcanary.canaries.records import field_record
from kvcanary.tenants.planner import request_id

KEYRING_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One earlier run's key and what is needed to name its canaries' owners."""

    key: bytes
    run_id: str
    t_wall: float
    num_words: int
    tenants: tuple[str, ...]
    alphabet: tuple[int, ...]
    """The alphabet's word-list digits (`canaries.alphabet.Alphabet.digits`)."""
    word_tokens: int

    @classmethod
    def of(cls, key: bytes, minter: CanaryMinter, run_id: str, tenants: Sequence[str]) -> KeyEntry:
        """The entry for a run starting now with `minter` (made from `key`)."""
        alphabet = minter.alphabet
        return cls(
            key,
            run_id,
            time.time(),
            minter.num_words,
            tuple(tenants),
            tuple(alphabet.digits.tolist()),
            alphabet.word_tokens,
        )

    def minter(self) -> CanaryMinter:
        """The earlier run's minter: its key, canary length and alphabet."""
        alphabet = make_alphabet(np.asarray(self.alphabet, dtype=np.int64), self.word_tokens)
        return CanaryMinter(self.key, num_words=self.num_words, alphabet=alphabet)

    def to_record(self) -> dict[str, Any]:
        return field_record(
            self, key=self.key.hex(), tenants=list(self.tenants), alphabet=list(self.alphabet)
        )

    @classmethod
    def from_record(cls, record: Any) -> KeyEntry:
        if not isinstance(record, dict):
            raise ValueError("an entry is not an object")
        return cls(
            key=bytes.fromhex(str(record["key"])),
            run_id=str(record["run_id"]),
            t_wall=float(record["t_wall"]),
            num_words=int(record["num_words"]),
            tenants=tuple(str(name) for name in record["tenants"]),
            alphabet=tuple(int(digit) for digit in record["alphabet"]),
            word_tokens=int(record["word_tokens"]),
        )


class Keyring:
    """The keys in one keyring file (read when opened, written by `remember`)."""

    def __init__(self, path: Path, entries: dict[str, KeyEntry]) -> None:
        self.path = path
        self.entries = entries

    @classmethod
    def open(cls, path: str | Path) -> Keyring:
        """The keyring at `path` (empty when the file does not exist yet); `ConfigError`
        for a file others can read, or one that is not a keyring."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            return cls(path, {})
        except OSError as exc:
            raise ConfigError(f"--keyring {path}: cannot read it ({exc.strerror})") from None
        if not stat.S_ISREG(mode):
            raise ConfigError(f"--keyring {path}: not a regular file")
        if mode & 0o077:
            raise ConfigError(
                f"--keyring {path}: readable by group or others (mode {stat.S_IMODE(mode):o}); "
                f"it holds canary keys: chmod 600 {path}"
            )
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            if document.get("schema") != KEYRING_SCHEMA:
                raise ValueError(f"schema {document.get('schema')!r}")
            entries = {str(k): KeyEntry.from_record(v) for k, v in document["keys"].items()}
        except OSError as exc:
            raise ConfigError(f"--keyring {path}: cannot read it ({exc.strerror})") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"--keyring {path}: not a kvcanary keyring ({exc})") from None
        return cls(path, entries)

    def remember(self, key_id: str, entry: KeyEntry) -> None:
        """Add (or keep) `entry` under `key_id` and write the file, 0600, atomically."""
        if key_id in self.entries:  # a resumed soak: the same key, the first start kept
            return
        self.entries[key_id] = entry
        document = {
            "schema": KEYRING_SCHEMA,
            "keys": {k: e.to_record() for k, e in self.entries.items()},
        }
        temporary = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump(document, file, indent=1)
            os.replace(temporary, self.path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise ConfigError(f"--keyring {self.path}: cannot write it ({exc.strerror})") from None

    def earlier_runs(self, current_key_id: str) -> EarlierRuns:
        """An attributor over every key but the current run's."""
        entries = [e for k, e in self.entries.items() if k != current_key_id]
        return EarlierRuns(entries)


def run_key(seed: int, run_id: str, *, seeded: bool) -> bytes:
    """The run's canary key, as `harness.run.wiring.canary_minter` would derive it."""
    return seed_key(seed, run_id) if seeded else secrets.token_bytes(32)


@dataclass(frozen=True, slots=True)
class EarlierCanary:
    """A canary one earlier run minted: whose, from which run, how long ago."""

    run_id: str
    key_id: str
    tenant: str | None
    request_id: str
    age_s: float

    def describe(self) -> str:
        """`tenant-2's canary from run 20261202T030000Z (request t2-r000014), 14 h old`."""
        whose = f"{self.tenant}'s canary" if self.tenant is not None else "a canary"
        return f"{whose} from run {self.run_id} (request {self.request_id}), {_age(self.age_s)}"

    def to_record(self) -> dict[str, Any]:
        return field_record(self, age_s=round(self.age_s, 1))


class EarlierRuns:
    """Attributes canaries under the keys of earlier runs (see the module docstring)."""

    def __init__(self, entries: Sequence[KeyEntry], *, clock: Any = time.time) -> None:
        self._runs = [(entry.minter(), entry) for entry in entries]
        self._clock = clock

    def __len__(self) -> int:
        return len(self._runs)

    def attribute(self, canary: str) -> EarlierCanary | None:
        """The earlier run that minted `canary`, or None (no key here decodes it)."""
        for minter, entry in self._runs:
            try:
                origin = minter.attribute(canary)
            except CanaryError:
                continue
            if origin is None:
                continue
            tenants = entry.tenants
            name = tenants[origin.tenant] if origin.tenant < len(tenants) else None
            return EarlierCanary(
                run_id=entry.run_id,
                key_id=minter.key_id,
                tenant=name,
                request_id=request_id(origin.tenant, origin.request),
                age_s=max(0.0, self._clock() - entry.t_wall),
            )
        return None

    def explain(self, canary: str) -> tuple[str, dict[str, Any]] | None:
        """What the content detector says of an unknown canary, and its record; or None."""
        found = self.attribute(canary)
        return None if found is None else (found.describe(), found.to_record())


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s old"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min old"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h old"
    return f"{seconds / 86400:.0f} days old"
