"""The registry's options as argparse flags: add them to a parser, read back those given.

Every command's parser and the pytest plugin's option group are built here from
`harness.run.options`, so a flag is spelled, typed and explained the same everywhere. A flag
left out reads as "not given" (None), never as its default: defaults are the lowest layer of
`harness.run.config`'s merge, and a default here would hide a value from the config file.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcanary.harness.run.option_values import format_duration, parse_duration
from kvcanary.harness.run.options import Option


def add_to_parser(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    options: Iterable[Option],
    *,
    prefix: str = "--",
    parse_now: bool = True,
) -> None:
    """Add `options` as flags spelled `<prefix><key>` (and `<prefix><alias>`), unset: None.

    With `parse_now=False` values stay text until `given_values(..., parse=True)`, which
    reports a bad one as a one-line `ConfigError` rather than argparse's usage message.
    """
    for option in options:
        flag = f"{prefix}{option.key}"
        _add_flag(parser, option, flag, _help_text(option), parse_now)
        for alias in option.aliases:
            _add_flag(parser, option, f"{prefix}{alias}", f"Alias of {flag}.", parse_now)


def given_values(
    namespace: argparse.Namespace,
    options: Sequence[Option],
    *,
    parse: bool = False,
    prefix: str = "--",
) -> dict[str, Any]:
    """The options the user actually gave on the command line, keyed by name (parsed here
    with `parse`, for a parser built with `parse_now=False`; errors name `<prefix><key>`)."""
    values: dict[str, Any] = {}
    for option in options:
        value = getattr(namespace, option.name, None)
        if value is None:
            continue
        values[option.name] = tuple(value) if option.action == "append" else value
    if parse:
        from kvcanary.harness.run.config import coerce_values  # its ConfigError is no start-up cost

        return coerce_values(values, lambda option, _: f"{prefix}{option.key}")
    return values


def _help_text(option: Option) -> str:
    if option.default in (None, False, ()):
        return option.help
    shown = option.default
    if option.parse is parse_duration:
        shown = format_duration(option.default)
    return f"{option.help} Default: {shown}."


def _add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    option: Option,
    flag: str,
    help_text: str,
    parse_now: bool,
) -> None:
    if option.action == "flag":
        parser.add_argument(
            flag, dest=option.name, action="store_const", const=True, default=None, help=help_text
        )
        return
    if option.action == "optional":
        parser.add_argument(
            flag,
            dest=option.name,
            type=_argparse_type(option) if parse_now else str,
            nargs="?",
            const=option.const,
            default=None,
            metavar=option.metavar,
            help=help_text,
        )
        return
    parser.add_argument(
        flag,
        dest=option.name,
        type=_argparse_type(option) if parse_now else str,
        action="append" if option.action == "append" else "store",
        default=None,
        metavar=option.metavar,
        help=help_text,
    )


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return option.coerce_item(text)
        except ValueError as exc:
            # argparse turns ArgumentTypeError into "argument --x: <message>", exit 2
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = option.key
    return convert
