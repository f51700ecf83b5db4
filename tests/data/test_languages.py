"""The extension table, the --ext parser, and telling text from binary by content."""

from __future__ import annotations

import pytest

from gptforge.data.languages import (
    CONTAINERS,
    DEFAULT_EXTENSIONS,
    decode,
    is_binary,
    kind_of,
    language_of,
    parse_extensions,
    selects,
)
from gptforge.errors import GptforgeError


@pytest.mark.parametrize(
    ("name", "language"),
    [
        ("stdlib/json/__init__.py", "Python"),
        ("src/app.ts", "TypeScript"),
        ("kernel/sched.c", "C"),
        ("include/util.H", "C"),  # extensions match case-insensitively
        ("lib/vec.hpp", "C++"),
        ("cmd/main.go", "Go"),
        ("src/lib.rs", "Rust"),
        ("App.java", "Java"),
        ("build.gradle", "Groovy"),
        ("notes.txt.gz", "Text"),  # sources read .gz transparently; so does the table
        ("docs/index.rst", "reStructuredText"),
        ("README.md", "Markdown"),
        ("Makefile", "Makefile"),
        ("CMakeLists.txt", "CMake"),  # the whole name wins over .txt
        ("docker/Dockerfile.gpu", "Dockerfile"),
        ("package.json", "JSON"),
        ("data.jsonl:12", None),  # a JSONL record: a container's line, language unknown
        ("codeparrot/codeparrot-clean:5", None),
        (".bashrc", None),  # a hidden file has no extension
        ("archive.tar.gz", None),
        ("photo.png", None),
    ],
)
def test_language_of_a_file_name(name, language):
    assert language_of(name) == language


def test_kinds_separate_code_prose_markup_and_data():
    assert [kind_of(x) for x in ("Python", "Markdown", "HTML", "YAML", None)] == [
        "code",
        "prose",
        "markup",
        "data",
        None,
    ]


def test_defaults_read_code_and_prose_but_not_data_files():
    for ext in (".py", ".js", ".ts", ".c", ".h", ".cpp", ".go", ".rs", ".java", ".md", ".rst", ".txt", "Makefile"):
        assert ext in DEFAULT_EXTENSIONS, ext
    for ext in (".json", ".yaml", ".toml", ".xml", ".csv", ".ipynb"):
        assert ext not in DEFAULT_EXTENSIONS, ext
    assert selects("a/b.go") and not selects("a/b.json") and not selects("a/b.png")


def test_ext_lists_replace_the_defaults():
    assert parse_extensions("py,.js,c,Makefile") == {".py", ".js", ".c", "Makefile"}
    assert selects("src/x.js", parse_extensions("py,js")) and not selects("src/x.go", parse_extensions("py,js"))


def test_signed_ext_items_edit_the_defaults():
    edited = parse_extensions("+json,-md,-markdown")
    assert edited == (DEFAULT_EXTENSIONS | CONTAINERS | {".json"}) - {".md", ".markdown"}


def test_ext_groups():
    code_only = parse_extensions("code")
    assert ".py" in code_only and ".md" not in code_only and ".json" not in code_only
    assert parse_extensions("all,-data") == DEFAULT_EXTENSIONS | CONTAINERS
    assert ".yaml" in parse_extensions("default,data")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("pyy", "--ext: unknown file type 'pyy'"),
        ("py,,js", "expected a comma-separated list"),
        ("-all", "selects no file type"),
        ("py,-py", "selects no file type"),
    ],
)
def test_bad_ext_values_are_one_line_errors(value, message):
    with pytest.raises(GptforgeError, match=message) as caught:
        parse_extensions(value)
    assert "\n" not in str(caught.value)


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10" + bytes(range(256)) * 4


def test_binary_files_are_told_by_content():
    assert is_binary(PNG) and decode(PNG) is None
    assert is_binary(b"x = 1\n" * 5000 + b"\x00")  # a NUL past the first 8 KB still counts
    assert is_binary(bytes(range(1, 32)) * 50)  # control bytes without a NUL


def test_text_with_tabs_form_feeds_and_terminal_colours_is_not_binary():
    text = "def f():\n\treturn 1\n\x0c\n\x1b[31mred\x1b[0m café\n"
    assert not is_binary(text.encode()) and decode(text.encode()) == text


def test_utf16_and_utf32_with_a_byte_order_mark_are_decoded():
    text = "print('héllo wörld')\n"
    for encoding in ("utf-16", "utf-16-be", "utf-32"):
        data = text.encode(encoding)
        if encoding == "utf-16-be":
            data = b"\xfe\xff" + data
        assert not is_binary(data) and decode(data) == text, encoding


def test_utf16_without_a_byte_order_mark_is_binary():
    assert is_binary("print(1)\n".encode("utf-16-le"))


def test_a_utf8_byte_order_mark_is_dropped():
    assert decode(b"\xef\xbb\xbfimport os\n") == "import os\n"


def test_latin1_text_is_not_binary_but_is_not_decoded_either():
    data = "# café crème brûlée\nx = 1\n".encode("latin-1")
    assert not is_binary(data)
    assert decode(data) is None  # skipped, not guessed: Latin-1 cannot be told from other 8-bit encodings
