"""The one table of files gptforge reads as text: extension (or well-known file name) -> language -> kind.

Kinds: 'code' (programming languages, shell, SQL, build files, CSS), 'markup' (HTML), 'prose' (Markdown,
reStructuredText, plain text, TeX, ...) and 'data' (JSON, YAML, TOML, XML, CSV, notebooks, ...). Every kind but
'data' is read by default: data files are mostly values rather than language, and a repository's lock files
and fixtures would outweigh its code (StarCoder kept only 50..5,000-character JSON/YAML files for that reason);
`--ext +json` reads them. JSONL and parquet are containers of documents, not documents: sources.py reads them.

`--ext` takes a comma-separated list (see `parse_extensions`):
  py,js,c           exactly these (a leading dot is optional; a well-known file name like Makefile also works)
  +go,-md           the defaults plus .go, minus .md (every item signed: an edit of the defaults)
  code,prose,-html  groups: all, default, and one per kind (code, markup, prose, data)
"""

from __future__ import annotations

from gptforge.errors import GptforgeError

# language -> (kind, extensions). Names follow GitHub Linguist's; an ambiguous extension goes to its
# commonest language (.h: C, .m: Objective-C, .pl: Perl).
_TABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "Python": ("code", (".py", ".pyi")),
    "Cython": ("code", (".pyx", ".pxd")),
    "JavaScript": ("code", (".js", ".mjs", ".cjs", ".jsx")),
    "TypeScript": ("code", (".ts", ".mts", ".cts", ".tsx")),
    "C": ("code", (".c", ".h")),
    "C++": ("code", (".cc", ".cpp", ".cxx", ".c++", ".hh", ".hpp", ".hxx", ".h++", ".inl", ".ipp")),
    "CUDA": ("code", (".cu", ".cuh")),
    "Objective-C": ("code", (".m", ".mm")),
    "Go": ("code", (".go",)),
    "Rust": ("code", (".rs",)),
    "Java": ("code", (".java",)),
    "Kotlin": ("code", (".kt", ".kts")),
    "Scala": ("code", (".scala", ".sc")),
    "Groovy": ("code", (".groovy", ".gradle")),
    "C#": ("code", (".cs", ".csx")),
    "F#": ("code", (".fs", ".fsi", ".fsx")),
    "Ruby": ("code", (".rb", ".rake", ".gemspec")),
    "PHP": ("code", (".php",)),
    "Perl": ("code", (".pl", ".pm")),
    "Swift": ("code", (".swift",)),
    "Dart": ("code", (".dart",)),
    "Shell": ("code", (".sh", ".bash", ".zsh", ".ksh")),
    "PowerShell": ("code", (".ps1", ".psm1")),
    "Batchfile": ("code", (".bat", ".cmd")),
    "Lua": ("code", (".lua",)),
    "R": ("code", (".r",)),
    "Julia": ("code", (".jl",)),
    "Haskell": ("code", (".hs", ".lhs")),
    "OCaml": ("code", (".ml", ".mli")),
    "Elixir": ("code", (".ex", ".exs")),
    "Erlang": ("code", (".erl", ".hrl")),
    "Clojure": ("code", (".clj", ".cljs", ".cljc")),
    "Lisp": ("code", (".lisp", ".el", ".scm", ".rkt")),
    "Zig": ("code", (".zig",)),
    "Nim": ("code", (".nim",)),
    "Fortran": ("code", (".f", ".for", ".f90", ".f95", ".f03")),
    "Assembly": ("code", (".s", ".asm")),
    "GLSL": ("code", (".glsl", ".vert", ".frag")),
    "SQL": ("code", (".sql",)),
    "Makefile": ("code", (".mk", ".mak")),
    "CMake": ("code", (".cmake",)),
    "Dockerfile": ("code", (".dockerfile",)),
    "Starlark": ("code", (".bzl", ".bazel")),
    "Nix": ("code", (".nix",)),
    "HCL": ("code", (".tf", ".hcl")),
    "Protocol Buffer": ("code", (".proto",)),
    "GraphQL": ("code", (".graphql", ".gql")),
    "Vue": ("code", (".vue",)),
    "Svelte": ("code", (".svelte",)),
    "XSLT": ("code", (".xsl", ".xslt")),
    "CSS": ("code", (".css", ".scss", ".sass", ".less")),
    "HTML": ("markup", (".html", ".htm", ".xhtml")),
    "Markdown": ("prose", (".md", ".markdown")),
    "reStructuredText": ("prose", (".rst",)),
    "AsciiDoc": ("prose", (".adoc", ".asciidoc")),
    "Org": ("prose", (".org",)),
    "Text": ("prose", (".txt", ".text")),
    "TeX": ("prose", (".tex", ".sty", ".ltx")),
    "JSON": ("data", (".json", ".jsonc", ".json5")),
    "Jupyter Notebook": ("data", (".ipynb",)),
    "YAML": ("data", (".yaml", ".yml")),
    "TOML": ("data", (".toml",)),
    "XML": ("data", (".xml", ".xsd", ".svg")),
    "INI": ("data", (".ini", ".cfg", ".conf")),
    "CSV": ("data", (".csv", ".tsv")),
}
# Files known by their whole name (matched exactly, before any extension: CMakeLists.txt is CMake, not Text).
FILENAMES: dict[str, str] = {
    "Makefile": "Makefile",
    "makefile": "Makefile",
    "GNUmakefile": "Makefile",
    "Dockerfile": "Dockerfile",
    "Containerfile": "Dockerfile",
    "CMakeLists.txt": "CMake",
    "Rakefile": "Ruby",
    "Gemfile": "Ruby",
    "Vagrantfile": "Ruby",
    "Jenkinsfile": "Groovy",
}
KINDS = ("code", "markup", "prose", "data")
KIND: dict[str, str] = {language: kind for language, (kind, _) in _TABLE.items()}
EXTENSIONS: dict[str, str] = {ext: language for language, (_, exts) in _TABLE.items() for ext in exts}
_KEYS: dict[str, str] = {**EXTENSIONS, **FILENAMES}  # a selection key (".py" or "Makefile") -> language
GROUPS: dict[str, frozenset[str]] = {
    "all": frozenset(_KEYS),
    **{kind: frozenset(key for key, lang in _KEYS.items() if KIND[lang] == kind) for kind in KINDS},
}
DEFAULT_EXTENSIONS: frozenset[str] = frozenset(key for key, lang in _KEYS.items() if KIND[lang] != "data")
# Files of many documents (sources.py reads them): read by default, and under an --ext that names them or edits the
# default (`--ext py` reads no JSONL; `--ext py,jsonl` and `--ext +go` do).
CONTAINERS = frozenset({".jsonl", ".parquet"})
GROUPS["default"] = DEFAULT_EXTENSIONS
GROUPS["all"] = GROUPS["all"] | CONTAINERS


def key_of(name: str) -> str | None:
    """The table key a file name goes by: its whole name if well known, else its lowercase extension
    (looking through .gz); None when the table has neither. Hidden files ('.bashrc') have no extension."""
    base = name.rsplit("/", 1)[-1]
    if base.endswith(".gz"):
        base = base[:-3]
    if base in FILENAMES:
        return base
    if base.startswith("Dockerfile."):  # Dockerfile.dev, Dockerfile.gpu: a naming convention
        return "Dockerfile"
    dot = base.rfind(".")
    ext = base[dot:].lower() if dot > 0 else ""
    return ext if ext in EXTENSIONS else None


def language_of(name: str) -> str | None:
    """The language of a document by its name ('src/app.go' -> 'Go'), or None when unknown (JSONL records)."""
    key = key_of(name)
    return None if key is None else _KEYS[key]


def kind_of(language: str | None) -> str | None:
    """'code', 'markup', 'prose' or 'data' for a language of the table; None for an unknown one."""
    return KIND.get(language) if language is not None else None


def selects(name: str, extensions: frozenset[str] = DEFAULT_EXTENSIONS) -> bool:
    """Whether a file of this name is read under a selection from `parse_extensions`."""
    return key_of(name) in extensions


def parse_extensions(value: str, flag: str = "--ext") -> frozenset[str]:
    """The selection an `--ext` value names (the module docstring has the forms); one line for a bad item."""
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise GptforgeError(f"{flag} {value!r}: expected a comma-separated list like py,js,c or +go,-md")
    edit = all(item[0] in "+-" for item in items)
    selected = set(DEFAULT_EXTENSIONS | CONTAINERS) if edit else set()
    for item in items:
        sign, body = (item[0], item[1:]) if item[0] in "+-" else ("+", item)
        keys = _keys_named(body, flag)
        selected = selected - keys if sign == "-" else selected | keys
    if not selected:
        raise GptforgeError(f"{flag} {value!r}: selects no file type (expected at least one extension)")
    return frozenset(selected)


def _keys_named(body: str, flag: str) -> frozenset[str]:
    if body in GROUPS:
        return GROUPS[body]
    if body in FILENAMES:
        return frozenset({body})
    ext = "." + body.lstrip(".").lower()
    if ext in EXTENSIONS or ext in CONTAINERS:
        return frozenset({ext})
    raise GptforgeError(
        f"{flag}: unknown file type {body!r} (expected an extension such as py or .rs, a file name such as "
        f"Makefile, or a group: {', '.join(GROUPS)}; the table is gptforge/data/languages.py)"
    )


# Bytes that never occur in text: C0 controls except tab, LF, VT, FF, CR and ESC (terminal colours in logs).
_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
_SAMPLE = 8192  # bytes whose control characters are counted (git looks at the first 8,000 for a NUL)
_MAX_CONTROL = 0.1  # fraction of control bytes in the sample above which a file is binary
# Byte-order marks of the encodings whose text holds NUL bytes; the 4-byte UTF-32 LE mark starts like UTF-16 LE's.
_WIDE_BOMS = {
    b"\x00\x00\xfe\xff": "utf-32",
    b"\xff\xfe\x00\x00": "utf-32",
    b"\xff\xfe": "utf-16",
    b"\xfe\xff": "utf-16",
}


def _wide_encoding(data: bytes) -> str | None:
    return _WIDE_BOMS.get(data[:4]) or _WIDE_BOMS.get(data[:2])


def is_binary(data: bytes) -> bool:
    """Whether a file's bytes are binary: a NUL anywhere, or more than 10% control bytes in its first 8 KB.
    UTF-16 and UTF-32 text holds NULs too: it is text when it starts with a byte-order mark."""
    if _wide_encoding(data):
        return False
    if b"\0" in data:
        return True
    sample = data[:_SAMPLE]
    return len(sample) - len(sample.translate(None, _CONTROL)) > _MAX_CONTROL * len(sample)


def decode(data: bytes) -> str | None:
    """A file's text: UTF-8 (a byte-order mark dropped), or UTF-16/32 that starts with a byte-order mark.
    None when the bytes are binary or not valid in that encoding: Latin-1 and the other legacy encodings
    cannot be told apart reliably, so such files are skipped rather than guessed."""
    if is_binary(data):
        return None
    try:
        return data.decode(_wide_encoding(data) or "utf-8-sig")
    except UnicodeDecodeError:
        return None
