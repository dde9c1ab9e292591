"""The engine with the Triton kernel forced on (interpreted, on CPU): the same reads as the
torch path, and the incident through the kernel: a vulnerable decode reads the victims' stale
pages through its block table and quotes them; with `admission_retire` nothing is read."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from engine_canaries import Canaries
from engine_helpers import ERROR, LEAK, TINY_MODEL, outcome, over_pool, small_config

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.engine import DisaggregatedEngine
from kvcanary.reference_engine.interfaces import GenerateRequest
from kvcanary.reference_engine.model_runner import ModelRunner
from kvcanary.reference_engine.sequence import Req

VOCAB = 100_277
KERNEL_ENGINE: dict[str, object] = {**TINY_MODEL, "attention": "triton", "copy_noise": 0.0}
"""The smallest model, quick under the interpreter; at copy noise 0 its recall quotes the pages
exactly (above it, a two-layer model's noisy copy may drop the canary's tokens)."""


class CountingKernel:
    """Counts the kernel's calls, so a test knows the engine went through it."""

    def __init__(self, kernel: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
        self.num_calls = 0
        original = kernel.triton_paged_attention

        def counted(*args: object, **kwargs: object) -> torch.Tensor:
            self.num_calls += 1
            out: torch.Tensor = original(*args, **kwargs)
            return out

        monkeypatch.setattr(kernel, "triton_paged_attention", counted)


@pytest.fixture
def calls(kernel: ModuleType, monkeypatch: pytest.MonkeyPatch) -> CountingKernel:
    return CountingKernel(kernel, monkeypatch)


def answer(
    attention: str, dtype: str, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Prefill 150 tokens in chunks of 64 over shuffled pages, decode 30 tokens. Returns the
    tokens and the recall head's codes (the lm head's input) at every sampled step. `forced`:
    feed these tokens back instead of the sampled ones (teacher forcing)."""
    config = EngineConfig(context_length=512, dtype=dtype, attention=attention, **TINY_MODEL)
    runner = ModelRunner(config, VOCAB, pool_tokens=512)
    assert runner.attention_path.kernel == (attention == "triton")
    codes: list[torch.Tensor] = []
    runner.model.lm_head.register_forward_hook(lambda _m, x, _o: codes.append(x[0].clone()))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 100_000, (150,), generator=g).tolist()
    req = Req.from_request(GenerateRequest("r", tuple(prompt), 30, 1))
    req.page_ids = (torch.randperm(runner.num_pages - 1, generator=g) + 1)[:12].tolist()
    sampled = [runner.prefill_chunk(req, start, min(start + 64, 150)) for start in (0, 64, 128)]
    while len(req.output_ids) < 30:
        token = sampled[-1]
        assert token is not None
        req.output_ids.append(token if forced is None else forced[len(req.output_ids)])
        sampled = runner.decode_step([req])
    return req.output_ids, torch.cat(codes)  # (31, C): the prefill's and every step's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layer_reads_the_same_through_the_kernel(calls: CountingKernel, dtype: str) -> None:
    """Fed the same tokens, the kernel's run computes the torch path's recall codes at every
    step, through every layer's K/V at the default copy noise, up to float32 rounding; the
    answers are the same tokens, except where the torch path's own code is a tie (about 0)
    that rounding may tip either way."""
    expected_tokens, expected = answer("torch", dtype)
    tokens, codes = answer("triton", dtype, forced=expected_tokens)
    torch.testing.assert_close(codes, expected, rtol=1e-4, atol=1e-4)
    ties = expected.abs().amin(-1) < 1e-4  # (31,)
    for step, (got, want) in enumerate(zip(tokens, expected_tokens, strict=True)):
        assert got == want or ties[step], step
    assert calls.num_calls == 3 + 1 + 30 * 2  # the block per chunk, recall once, both per step


async def test_the_incident_reads_stale_pages_through_the_kernel(
    calls: CountingKernel, canaries: Canaries
) -> None:
    async with DisaggregatedEngine(small_config(**KERNEL_ENGINE)) as engine:
        result = await over_pool(engine, canaries)
        assert engine.decode.runner.attention_path.kernel
    assert outcome(result, canaries, "attacker") == LEAK
    assert result.status == 200
    assert result.prefill_finish.prompt_tokens == 1  # prefill wrote one token of 900
    assert calls.num_calls > 0


async def test_admission_retire_leaves_the_kernel_nothing_stale_to_read(
    calls: CountingKernel, canaries: Canaries
) -> None:
    config = small_config(fixes=frozenset({"admission_retire"}), **KERNEL_ENGINE)
    async with DisaggregatedEngine(config) as engine:
        result = await over_pool(engine, canaries)
    assert outcome(result, canaries, "attacker") == ERROR
    assert result.status == 400
    assert calls.num_calls > 0  # the victims were served through the kernel
