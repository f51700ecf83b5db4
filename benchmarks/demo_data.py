"""The figures README quotes about the demo's data, from one run of what `gptforge demo` and `demo --chat` prepare:
files read, copies removed (exact, near) and their share of the bytes, training and validation tokens, and the
function requests with how many train after de-duplication. tests/test_readme.py checks README quotes this record.

    python benchmarks/demo_data.py --data /tmp/demo-data/stdlib --json benchmarks/demo-data-DATE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.shards import read_manifest
from gptforge.demo import VAL_FRACTION, VOCAB_SIZE, prepare_function_conversations


def record(data: Path) -> dict:
    stdlib = PrepareSettings.from_flags("stdlib", val_fraction=VAL_FRACTION, train_tokenizer=VOCAB_SIZE)
    manifest = prepare(stdlib, data)
    stages = manifest["report"]["stages"]
    chat = data.with_name(f"{data.name}-chat")
    rows = prepare_function_conversations(data, chat)
    chat_manifest = read_manifest(chat)
    copies = stages["exact duplicates"]["docs"] + stages["near duplicates"]["docs"]
    copy_bytes = stages["exact duplicates"]["bytes"] + stages["near duplicates"]["bytes"]
    return {
        "python": platform.python_version(),
        "files": stages["read"]["docs"],
        "megabytes": round(stages["read"]["bytes"] / 1e6, 1),
        "exact_copies": stages["exact duplicates"]["docs"],
        "near_copies": stages["near duplicates"]["docs"],
        "copies": copies,
        "copies_share_of_bytes": round(copy_bytes / stages["read"]["bytes"], 4),
        "train_tokens": manifest["splits"]["train"]["tokens"],
        "val_tokens": manifest["splits"]["val"]["tokens"],
        "requests": sum(1 for line in rows.read_text().splitlines() if line.strip()),
        "training_conversations": chat_manifest["splits"]["train"]["docs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="where to prepare the stdlib (DATA and DATA-chat)")
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args()
    result = record(args.data)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
