"""The one exception type the CLI turns into a one-line error and a non-zero exit."""


class GptforgeError(Exception):
    """Bad input or state, with a message naming the file or flag and what was expected."""


def one_line(text: str) -> str:
    """`text` kept to one line: a newline, tab or other control character in it (a path may hold one) written as
    its escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def first_detail(error: BaseException) -> str:
    """The first informative line of a library's multi-line message (torch's start with a bare header)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if not line.endswith(":")), lines[0] if lines else type(error).__name__)
