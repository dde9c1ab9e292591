"""Detectors: turn plans and observations into findings.

- `ContentDetector` scans streamed responses for canaries that are not the request's own;
- `ProtocolDetector` checks status codes and `usage` against the plan;
- `TimingDetector` flags time-to-first-token too short for a real prefill.

Each is independent of the others and of transport; the runner feeds them.
"""

from kvcanary.harness.detectors.content import ContentDetector, ResponseScan
from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.ttft_model import TtftModel

__all__ = ["ContentDetector", "ProtocolDetector", "ResponseScan", "TimingDetector", "TtftModel"]
