"""The one exception type the CLI turns into a one-line error and a non-zero exit."""


class GptforgeError(Exception):
    """Bad input or state, with a message naming the file or flag and what was expected."""
