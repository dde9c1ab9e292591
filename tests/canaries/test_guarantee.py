"""Page guarantees: per page where canaries fit, the densest window where they do not."""

from __future__ import annotations

import pytest
from test_alphabet import ByteTokenizer
from test_prompt import check_every_window, check_prompt

from kvcanary.canaries import CanaryMinter, build_prompt
from kvcanary.canaries.alphabet import alphabet_for
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.guarantee import page_guarantee


def test_canaries_that_fit_are_guaranteed_per_page() -> None:
    guarantee = page_guarantee(7, 16)
    assert (guarantee.window, guarantee.per_page) == (16, True)
    assert guarantee.sentence() == "every 16-token page holds a complete canary"
    assert page_guarantee(7, 13, strict=True).per_page  # 2c - 1 = 13 is enough


def test_long_canaries_get_the_densest_window_and_say_so() -> None:
    guarantee = page_guarantee(46, 16)
    assert (guarantee.window, guarantee.per_page) == (91, False)
    assert guarantee.sentence().startswith(
        "every 91-token window holds a complete canary; pages of 16 tokens are not "
        "individually attributable"
    )
    assert list(guarantee.to_dict().items()) == [  # the journal's and summary.json's order
        ("page_size", 16),
        ("canary_tokens", 46),
        ("guaranteed_window", 91),
        ("per_page", False),
        ("guarantee", guarantee.sentence()),
    ]
    with pytest.raises(CanaryError, match=r"46 tokens.*at least 91"):
        page_guarantee(46, 16, strict=True)
    with pytest.raises(CanaryError, match="positive"):
        page_guarantee(7, 0)


@pytest.mark.parametrize("n", [1, 3, 4, 45, 46, 47, 90, 91, 92, 600, 1023])
def test_a_byte_level_prompt_laced_for_the_window_is_exact(n: int) -> None:
    tokenizer = ByteTokenizer()
    minter = CanaryMinter.from_seed(3, "bytes", alphabet=alphabet_for(tokenizer))
    guarantee = page_guarantee(minter.num_tokens(tokenizer), 16)
    assert guarantee.window == 91
    prompt = build_prompt(
        tokenizer, minter, tenant=1, request=2, num_tokens=n, page_size=guarantee.window
    )
    tokens = check_prompt(prompt, tokenizer, minter, tenant=1, request=2, page_size=91)
    assert len(tokens) == n
    if prompt.canaries:  # the promise is kept, and is not a page's
        starts = [span.token_offset for span in prompt.canaries]
        check_every_window(starts, 46, n, guarantee.window)
        if n >= 2 * 46 + 16:
            with pytest.raises(AssertionError, match="window"):
                check_every_window(starts, 46, n, 16)
