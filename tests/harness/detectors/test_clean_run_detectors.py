"""A long clean run through all three detectors: no finding at all."""

from __future__ import annotations

import random

from detector_factories import LIMITS, make_obs, make_plan

from kvcanary.canaries import WORDS, CanaryIndex, CanaryMinter, Owner
from kvcanary.harness.detectors import ContentDetector, ProtocolDetector, TimingDetector
from kvcanary.harness.record.finding import Finding

SIZES = (64, 256, 512, 1024, 1536, 2000)


def test_2000_clean_observations_give_no_findings() -> None:
    rng = random.Random(42)
    minter = CanaryMinter.from_seed(7, "clean-run")
    index = CanaryIndex(minter)
    content = ContentDetector(index)
    protocol = ProtocolDetector(LIMITS)
    timing = TimingDetector()
    findings: list[Finding] = []
    num_hits = 0
    for i in range(2000):
        tenant = i % 5
        request_id = f"t{tenant}-r{i:06d}"
        canaries = minter.mint_many(tenant, i, range(8))
        for canary in canaries:
            index.add(canary, Owner(f"tenant-{tenant}", request_id))
        if i % 10 == 9:  # an over-limit probe, refused as a safe target must
            plan = make_plan(
                request_id, tenant=f"tenant-{tenant}", num_prompt_tokens=3000, expected="reject"
            )
            obs = make_obs(
                plan, status=400, ttft_ms=None, prompt_tokens=None, error_kind="http_status"
            )
            text = ""
        else:
            n = rng.choice(SIZES)
            plan = make_plan(request_id, tenant=f"tenant-{tenant}", num_prompt_tokens=n)
            ttft = (15.0 + 0.05 * n) * rng.lognormvariate(0, 0.05) + abs(rng.gauss(0, 2))
            if rng.random() < 0.1:
                ttft += rng.expovariate(1 / 200)
            # Canary-word prose and echoes of the request's own canaries.
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 120))]
            words.insert(rng.randrange(len(words)), rng.choice(canaries))
            text = " ".join(words)
            obs = make_obs(plan, ttft_ms=ttft, text=text)
        scan = content.start(plan)
        for start in range(0, len(text), 17):
            findings += scan.feed(text[start : start + 17])
        findings += scan.finish(obs)
        num_hits += len(scan.hits)
        findings += protocol.check(plan, obs)
        findings += timing.observe(plan, obs)
    findings += timing.finish()
    assert findings == []
    assert num_hits == 1800  # every echo was seen, and none was a finding
    assert timing.model is not None
    assert timing.model.num_samples == 1000
