"""Own echoes: recombinations of a request's own prompt are never findings; other markers are."""

from __future__ import annotations

import random
import re

import pytest
from detector_factories import make_obs, make_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.canaries import (
    TAG,
    CanaryIndex,
    CanaryMinter,
    Owner,
    build_prompt,
    fold,
    load_tokenizer,
)
from kvcanary.canaries.prompt import BuiltPrompt
from kvcanary.canaries.shape import WORD_INDEX
from kvcanary.harness.detectors import ContentDetector
from kvcanary.harness.detectors.own_echo import ECHO_HIDE_BOUND, OwnText
from kvcanary.harness.record.events import OwnEchoRecorded, from_record, to_record
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.tenants.plan import RequestPlan

FIXTURE = HealthCheck.function_scoped_fixture


class Laced:
    """One run: real canary-laced prompts, registered live for their owners."""

    def __init__(self) -> None:
        self.tokenizer = load_tokenizer("cl100k_base")
        self.minter = CanaryMinter.from_seed(3, "echo-run")
        self.index = CanaryIndex(self.minter)
        self.prompts: dict[str, BuiltPrompt] = {}

    def plan(self, tenant: int, request: int, num_tokens: int) -> RequestPlan:
        built = build_prompt(
            self.tokenizer, self.minter, tenant=tenant, request=request, num_tokens=num_tokens
        )
        request_id = f"t{tenant}-r{request:06d}"
        owner = Owner(f"tenant-{tenant}", request_id)
        self.index.add_many((span.text, owner) for span in built.canaries)
        self.prompts[request_id] = built
        return make_plan(
            request_id, tenant=owner.tenant, prompt=built.text, canaries=built.canaries
        )


@pytest.fixture(scope="module")
def laced() -> Laced:
    run = Laced()
    run.plan(1, 1, 600)  # another tenant's live canaries, so a misattribution would show
    return run


def scan(run: Laced, plan: RequestPlan, text: str, chunk: int = 13) -> tuple[list[Finding], int]:
    response = ContentDetector(run.index).start(plan)
    findings: list[Finding] = []
    for start in range(0, len(text), chunk):
        findings += response.feed(text[start : start + chunk])
    findings += response.finish(make_obs(plan, text=text))
    return findings, len(response.own_echoes)


def shuffled_pieces(words: list[str], rng: random.Random, lengths: tuple[int, int]) -> str:
    pieces, position = [], 0
    while position < len(words):
        size = rng.randint(*lengths)
        pieces.append(" ".join(words[position : position + size]))
        position += size
    rng.shuffle(pieces)
    return rng.choice([" ", "\n", " "]).join(pieces)


@settings(max_examples=60, deadline=None, suppress_health_check=[FIXTURE])
@given(seed=st.integers(0, 2**32), max_piece=st.integers(1, 12))
def test_splices_and_shuffles_of_a_short_own_prompt_give_no_finding(
    laced: Laced, seed: int, max_piece: int
) -> None:
    """Any order and any mixture: a prompt this short has few enough distinct words."""
    plan = laced.plan(0, 100 + seed % 1000, 400)
    rng = random.Random(seed)
    words = plan.prompt.split()
    echo = shuffled_pieces(words, rng, (1, max_piece))
    findings, _ = scan(laced, plan, echo, chunk=rng.choice([1, 7, 4096]))
    assert findings == []


@settings(max_examples=15, deadline=None, suppress_health_check=[FIXTURE])
@given(seed=st.integers(0, 2**32))
def test_piece_splices_of_a_long_own_prompt_give_no_finding(laced: Laced, seed: int) -> None:
    """A 4,096-token prompt allows 4 pieces per 7-word marker: splices of 2+ word pieces."""
    plan = laced.plan(0, 5000 + seed % 1000, 4096)
    rng = random.Random(seed)
    echo = shuffled_pieces(plan.prompt.split(), rng, (2, 12))
    findings, _ = scan(laced, plan, echo, chunk=4096)
    assert findings == []


def test_the_reported_recombinations_are_echoes_journaled_as_own_echo(laced: Laced) -> None:
    plan = laced.plan(0, 7, 600)
    own = OwnText(plan.prompt)
    first, second = (span.text.split() for span in plan.canaries[:2])
    others = fillers(own, first + second)
    head_and_filler = " ".join([*first[:6], others[0]])  # tag, five words, a filler word
    head_and_fillers = " ".join([*first[:3], *others[:4]])  # tag, two words, four fillers
    head_and_middle = " ".join([*first[:3], *second[2:6]])  # one's start, another's middle
    text = f"Sure: {head_and_filler}, {head_and_fillers} and then {head_and_middle}."
    response = ContentDetector(laced.index).start(plan)
    assert response.feed(text) == []
    assert response.finish(make_obs(plan, text=text)) == []
    own_owner = Owner(plan.tenant, plan.request_id)
    assert [(h.layer, h.owner) for h in response.hits[:1]] == [("fragment", own_owner)]
    assert [h.canary for h in response.own_echoes] == [head_and_fillers, head_and_middle]
    event = response.own_echo_event(t_wall=5.0)
    assert event == OwnEchoRecorded(
        plan.request_id, plan.tenant, 2, (head_and_fillers, head_and_middle), 5.0
    )
    assert from_record(to_record(event)) == event


def fillers(own: OwnText, exclude: list[str]) -> list[str]:
    """The prompt's list words that are not in `exclude`, in a fixed order."""
    return [w for w in sorted(own.vocabulary) if w in WORD_INDEX and w not in exclude]


def strangers(own: OwnText, num: int) -> list[str]:
    """`num` list words that occur in no prompt of the run `own` belongs to (checked against
    `own`; another run's canary words are independent of this one's)."""
    minted = CanaryMinter.from_seed(99, "elsewhere").mint_many(0, 0, range(40))
    words = dict.fromkeys(w for canary in minted for w in canary.split()[1:])
    found = [w for w in words if w not in own.vocabulary]
    assert len(found) >= num
    return found[:num]


def no_echo_event(laced: Laced, plan: RequestPlan) -> bool:
    response = ContentDetector(laced.index).start(plan)
    response.finish(make_obs(plan))
    return response.own_echo_event(t_wall=0.0) is None


def test_a_marker_of_words_from_no_prompt_is_unknown() -> None:
    laced = Laced()
    laced.plan(1, 1, 600)
    plan = laced.plan(0, 8, 600)
    own = OwnText(plan.prompt)
    run_words = {w for built in laced.prompts.values() for w in fold(built.text).text.split()}
    stranger = next(
        canary
        for canary in CanaryMinter.from_seed(99, "elsewhere").mint_many(0, 0, range(100))
        if not run_words.intersection(canary.split()[1:])
    )
    assert not own.explains(stranger.split())
    findings, num_echoes = scan(laced, plan, f"quoted: {stranger}.")
    assert [f.kind for f in findings] == [FindingKind.UNKNOWN_CANARY]
    assert findings[0].details["relation"] == "unknown"
    assert num_echoes == 0
    assert no_echo_event(laced, plan)


@pytest.mark.parametrize("num_tokens", [600, 4096])
def test_a_marker_with_two_words_from_outside_the_prompt_is_unknown(
    laced: Laced, num_tokens: int
) -> None:
    """One substituted word is a slip; two are a marker the prompt does not explain."""
    plan = laced.plan(0, 8 + num_tokens, num_tokens)
    own = OwnText(plan.prompt)
    first = plan.canaries[0].text.split()
    for at in ((1, 2), (2, 6), (3, 5)):
        marker = list(first)
        for position, word in zip(at, strangers(own, 2), strict=True):
            marker[position] = word
        assert not own.explains(marker)
        findings, num_echoes = scan(laced, plan, f"quoted: {' '.join(marker)}.")
        assert [f.kind for f in findings] == [FindingKind.UNKNOWN_CANARY], at
        assert num_echoes == 0


@pytest.mark.parametrize("num_tokens", [511, 600, 2045, 4096])
def test_one_substituted_word_in_an_own_quote_is_an_echo(laced: Laced, num_tokens: int) -> None:
    """The hardened engine's slip: `ydk ipairs colony asylum mereka shared obsess`, all the
    prompt's but `colony` (a dropped token glued two word pieces into another list word)."""
    plan = laced.plan(0, 20 + num_tokens, num_tokens)
    own = OwnText(plan.prompt)
    first, second = (span.text.split() for span in plan.canaries[3:5])
    stranger = strangers(own, 1)[0]
    quotes = [
        [*first[:2], stranger, *first[3:]],  # one word of an own canary replaced
        [*first[:5], stranger, first[6]],  # its fifth word replaced
        [*first[:3], stranger, *second[3:6]],  # a splice of two, with one slip between
    ]
    for marker in quotes:
        assert own.explains(marker), marker
    text = "Sure: " + ". Then ".join(" ".join(m) for m in quotes) + "."
    findings, num_echoes = scan(laced, plan, text)
    assert findings == []
    assert num_echoes == len(quotes)


def test_a_live_canary_of_another_tenant_is_never_an_own_echo(laced: Laced) -> None:
    """Attribution comes first: a marker the request's own prompt would explain (one
    substituted word) that is also another tenant's live canary, or holds a fragment of
    one, is that tenant's, never an echo."""
    plan = laced.plan(0, 30, 600)
    own = OwnText(plan.prompt)
    first = plan.canaries[0].text.split()
    lookalike = [*first[:4], strangers(own, 1)[0], *first[5:]]
    assert own.explains(lookalike)
    laced.index.add_many([(" ".join(lookalike), Owner("tenant-1", "t1-r000031"))])
    foreign = laced.prompts["t1-r000001"].canaries[2].text.split()
    for text in (
        f"quoted: {' '.join(lookalike)}.",  # the whole live canary
        f"quoted: {' '.join(lookalike[1:6])}.",  # 5 words of it, no tag
        f"quoted: {TAG} {first[1]} {' '.join(foreign[1:6])}.",  # a stray own tag, then B's
    ):
        findings, num_echoes = scan(laced, plan, text)
        assert [(f.kind, f.details["owner_tenant"]) for f in findings] == [
            (FindingKind.CROSS_TENANT_CANARY, "tenant-1")
        ], text
        assert num_echoes == 0


def substituted(echo: str, own: OwnText, rng: random.Random) -> str:
    """`echo` with one of its list words (not a tag) replaced by a list word of no prompt."""
    words = re.split(r"(\s)", echo)  # separators kept
    places = [i for i, w in enumerate(words) if w in WORD_INDEX and w != TAG]
    words[rng.choice(places)] = rng.choice(strangers(own, 20))
    return "".join(words)


@settings(max_examples=60, deadline=None, suppress_health_check=[FIXTURE])
@given(seed=st.integers(0, 2**32), max_piece=st.integers(1, 12))
def test_splices_of_a_short_own_prompt_with_a_substituted_word_give_no_finding(
    laced: Laced, seed: int, max_piece: int
) -> None:
    """Up to about 1,100 tokens any order with one substituted word is an echo."""
    plan = laced.plan(0, 2000 + seed % 1000, 400)
    rng = random.Random(seed)
    own = OwnText(plan.prompt)
    echo = substituted(shuffled_pieces(plan.prompt.split(), rng, (1, max_piece)), own, rng)
    findings, _ = scan(laced, plan, echo, chunk=rng.choice([1, 7, 4096]))
    assert findings == []


@settings(max_examples=15, deadline=None, suppress_health_check=[FIXTURE])
@given(seed=st.integers(0, 2**32))
def test_splices_of_a_long_own_prompt_with_a_substituted_word_give_no_finding(
    laced: Laced, seed: int
) -> None:
    """A 4,096-token prompt allows 5 pieces with a substitution: pieces of 3+ words make at
    most 3 per marker, and the substituted word adds at most 2."""
    plan = laced.plan(0, 6000 + seed % 1000, 4096)
    rng = random.Random(seed)
    own = OwnText(plan.prompt)
    echo = substituted(shuffled_pieces(plan.prompt.split(), rng, (3, 12)), own, rng)
    findings, _ = scan(laced, plan, echo, chunk=4096)
    assert findings == []


@pytest.mark.parametrize("num_tokens", [600, 1500, 4096])
def test_other_runs_markers_are_hidden_within_the_budget(laced: Laced, num_tokens: int) -> None:
    """Measured: random canaries of another run pass for echoes at most at the budget's
    rate (two readings: 2 x ECHO_HIDE_BOUND; one substituted word included)."""
    plan = laced.plan(0, 40 + num_tokens, num_tokens)
    own = OwnText(plan.prompt)
    rng = random.Random(num_tokens)
    words = sorted(WORD_INDEX)
    num = 20_000
    markers = [[TAG, *rng.choices(words, k=6)] for _ in range(num)]
    hidden = sum(own.explains(marker) for marker in markers)
    assert hidden <= 2 * ECHO_HIDE_BOUND * num


def test_a_long_prompt_does_not_explain_a_word_by_word_mixture(laced: Laced) -> None:
    """With every list word in a long prompt, 'any order' would hide any foreign marker."""
    plan = laced.plan(0, 9, 4096)
    own = OwnText(plan.prompt)
    assert own.max_pieces(7) == 5
    spans = plan.canaries
    marker = [TAG] + [spans[10 * i].text.split()[1 + i] for i in range(6)]  # 6 places
    assert own.min_pieces(marker) > 5
    findings, num_echoes = scan(laced, plan, "so: " + " ".join(marker) + ".")
    assert [f.kind for f in findings] == [FindingKind.UNKNOWN_CANARY]
    assert num_echoes == 0
    assert own.explains(marker[:1] + spans[3].text.split()[1:4] + spans[40].text.split()[2:5])


def test_other_runs_canaries_stay_unknown_against_a_long_prompt(laced: Laced) -> None:
    plan = laced.plan(0, 11, 4096)
    others = CanaryMinter.from_seed(5, "another-run").mint_many(0, 0, range(200))
    response = ContentDetector(laced.index).start(plan)
    text = " filler ".join(others)
    findings = response.feed(text) + response.finish(make_obs(plan, text=text))
    assert [f.kind for f in findings] == [FindingKind.UNKNOWN_CANARY]
    assert findings[0].details["num_markers"] == 200
    assert response.own_echoes == []


def test_journal_only_plans_use_their_canaries() -> None:
    minter = CanaryMinter.from_seed(4, "journal")
    prompt = build_prompt(
        load_tokenizer("cl100k_base"), minter, tenant=0, request=0, num_tokens=300
    )
    own = OwnText("", prompt.canaries)
    assert own.vocabulary == {w for s in prompt.canaries for w in fold(s.text).text.split()}
    assert own.explains(prompt.canaries[1].text.split()[:4] + prompt.canaries[0].text.split()[4:])


def test_the_hide_chance_budget_shrinks_pieces_as_prompts_grow() -> None:
    sizes = [(150, 250, 25), (560, 1024, 102), (1770, 4096, 409), (3480, 1 << 20, 104857)]
    sizes += [(610, 1100, 110), (611, 1100, 110), (940, 1800, 180), (3228, 16384, 1638)]
    allowed, substituted = [], []
    for num_list_words, num_words, num_tags in sizes:
        own = OwnText("")
        own.num_list_words, own.words, own.num_tags = num_list_words, ["x"] * num_words, num_tags
        allowed.append(own.max_pieces(7))
        substituted.append(own.max_pieces(7, substituted=True))
    assert allowed == [7, 7, 5, 3, 7, 7, 7, 4]
    assert substituted == [7, 7, 5, 3, 7, 6, 5, 4]  # never more than without a substitution
    assert (1000 / 3480) ** 6 <= ECHO_HIDE_BOUND < (1770 / 3480) ** 6
    assert 6 * (610 / 3480) ** 5 <= ECHO_HIDE_BOUND < 6 * (611 / 3480) ** 5
