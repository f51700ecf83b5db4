"""argparse's pieces shared by the subcommands: one-line errors and the types that check numbers."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from gptforge.inputs import not_utf8
from gptforge.serve.protocol import allowed_host

# Flags whose value may start with '-' (`--ext -md` drops a kind): argparse would read such a value as a flag.
DASH_VALUE_FLAGS = ("--ext",)
# How a flag is spelled, told from a value after an unknown one that starts with '-' (secrets.token_urlsafe's can).
FLAG = re.compile(r"--[a-z][a-z0-9_-]*|-[A-Za-z]")
HIDDEN = "(its value not shown)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `gptforge train: error: ... (see --help)`. A flag is only ever its whole name:
    an abbreviation argparse finds ambiguous is echoed with its value, which may be an --api-key."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # subparsers too: add_subparsers(parser_class=Parser)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(unknown_flags_shown(extras))}")
        return parsed

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        for i in range(len(args) - 1, 0, -1):  # from the end: joining two items leaves earlier indexes valid
            if args[i - 1] in DASH_VALUE_FLAGS and str(args[i]).startswith("-"):
                args[i - 1 : i + 1] = [f"{args[i - 1]}={args[i]}"]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def unknown_flags_shown(extras: list[str]) -> list[str]:
    """The unrecognized arguments as an error shows them: a misspelt flag by its name alone, the values attached to
    or following it hidden (`--apikey KEY` may be the key); other extras as given."""
    shown: list[str] = []
    after_flag = False
    for arg in extras:
        name, equals, _ = arg.partition("=")
        if arg.startswith("-") and (not after_flag or FLAG.fullmatch(name)):
            shown.append(f"{name} {HIDDEN}" if equals else name)
            after_flag = True
        elif not after_flag:
            shown.append(arg)
        elif not shown[-1].endswith(HIDDEN):
            shown[-1] = f"{shown[-1]} {HIDDEN}"
    return shown


def file_name(text: str) -> str:
    """An --out that names a file: one ending in a slash names a folder (Path() would drop the slash and write a
    file of the folder's name)."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r} (it ends in a slash: a folder)")
    return text


def preset_name(text: str) -> str:
    """A --config value: an empty one would quietly mean the built-in defaults."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a preset name or a .toml path, got {text!r}")
    return text


def positive_ints(text: str) -> tuple[int, ...]:
    """--k 1,10 -> (1, 10)."""
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if any(k <= 0 for k in ks):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return ks


def utf8_text(text: str) -> str:
    """A text flag (--prompt, --suffix, --system): bytes that are not UTF-8 reach Python as lone surrogates, which
    no tokenizer encodes."""
    reason = not_utf8(text)
    if reason:
        raise argparse.ArgumentTypeError(reason)
    return text


def api_key(text: str) -> str:
    """--api-key (or $GPTFORGE_API_KEY): an empty key would serve without authentication, one with spaces at either
    end or a character an HTTP header cannot carry would start a server no client can use. The key is not shown."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty (or only spaces; $GPTFORGE_API_KEY too): an empty key would serve everyone; give a key, or leave "
            "out --api-key and unset GPTFORGE_API_KEY"
        )
    if text != text.strip():
        raise argparse.ArgumentTypeError("spaces at either end, which a client's header loses ($GPTFORGE_API_KEY too)")
    bad = next((i for i, c in enumerate(text) if not " " <= c <= "~"), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(
            f"character {bad + 1} is not printable ASCII, which an Authorization header carries ($GPTFORGE_API_KEY too)"
        )
    return text


def host_allowed(text: str) -> str:
    """--allow-host: a name a Host header can carry (the server reads it again as it starts)."""
    try:
        allowed_host(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, got {text!r}") from None
    return text


# An origin as a browser sends it (RFC 6454): lower-case scheme://host[:port], no path, not even a trailing slash.
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://([a-z0-9._~-]+|\[[0-9a-f:.]+\])(:[0-9]{1,5})?")


def cors_origin(text: str) -> str:
    """--cors: '*' or an origin a browser can send; any other value (such as a URL's trailing slash) matched no
    page, and the server refused every preflight while seeming to allow it."""
    if text != "*" and not ORIGIN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"expected an origin such as https://example.com:8080 (lower case, no path or trailing slash) or '*', "
            f"got {text!r}"
        )
    return text


def at_least(low: float, kind: type = int, high: float | None = None):
    """An argparse type: a finite number of `kind` that is >= low (and <= high, if given)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
            finite = math.isfinite(value)
        except (ValueError, OverflowError):  # OverflowError: an integer past a float's range
            value, finite = None, False
        if not finite or value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(
                f"expected a{'n integer' if kind is int else ' number'} {bounds}, got {text!r}"
            )
        return value

    return parse


def seed_value(text: str) -> int:
    """--seed: what torch.Generator.manual_seed takes."""
    value = at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text!r}")
    return value


def probability(text: str) -> float:
    """--top-p: a mass in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value
