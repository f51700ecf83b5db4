"""prepare --chat: conversations in, token shards with their loss masks out; bad rows named, copies removed."""

import json

import numpy as np
import pytest
import torch

from gptforge.data.chat.prepare import ChatSettings, chat_form, prepare_chat
from gptforge.data.clean.dedup import DedupSettings
from gptforge.data.loader import TokenLoader
from gptforge.data.shards import read_manifest, read_mask, read_shard, verify_shard
from gptforge.errors import GptforgeError
from gptforge.tokens.chat import with_chat
from gptforge.tokens.tokenizer import GPT2Tokenizer


def _turns(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


GOOD = [
    _turns(("system", "Be brief."), ("user", "Name a prime."), ("assistant", "Seven.")),
    {"instruction": "Reverse the list.", "input": "[1, 2]", "output": "[2, 1]"},
    _turns(("user", "Two plus two?"), ("assistant", "Four."), ("user", "And times three?"), ("assistant", "Twelve.")),
    {**_turns(("user", "Held out?"), ("assistant", "Yes, held out.")), "split": "val"},
]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_conversations_become_shards_whose_mask_holds_exactly_the_replies(tmp_path):
    src = _write(tmp_path / "chats.jsonl", GOOD)
    manifest = prepare_chat(str(src), tmp_path / "out", ChatSettings(val_fraction=0))
    assert manifest["chat"] == {"template": "chatml", "special_tokens": ["<|im_start|>", "<|im_end|>"]}
    assert {s: manifest["splits"][s]["docs"] for s in ("train", "val")} == {"train": 3, "val": 1}
    tok = with_chat(GPT2Tokenizer())
    replies = {"train": ["Seven.", "[2, 1]", "Four.", "Twelve."], "val": ["Yes, held out."]}
    for shard in read_manifest(tmp_path / "out")["shards"]:
        verify_shard(tmp_path / "out" / shard["file"], shard["sha256"])
        ids = np.asarray(read_shard(tmp_path / "out" / shard["file"], tok.vocab_size))
        mask = read_mask(tmp_path / "out" / shard["mask"], len(ids))
        assert tok.decode(ids[mask == 1]) == "".join(r + "<|im_end|>" for r in replies[shard["split"]])
        assert (ids == tok.eot).sum() == shard["docs"] and ids[-1] == tok.eot and mask[ids == tok.eot].sum() == 0
        assert manifest["splits"][shard["split"]]["assistant_tokens"] == int(mask.sum())
    text = tok.decode(np.asarray(read_shard(tmp_path / "out" / "train_000000.bin")))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n")
    assert "<|im_start|>user\nReverse the list.\n\n[1, 2]<|im_end|>" in text


def test_bad_rows_are_skipped_counted_and_named_by_line_and_copies_removed(tmp_path):
    bad = [
        _turns(("user", "No reply?")),
        _turns(("user", "hi"), ("robot", "beep")),
        {"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]},
        "{not json",
        {**GOOD[1], "split": "test"},
    ]
    words = [f"word{i}" for i in range(200)]
    long = _turns(("user", " ".join(words)), ("assistant", "ok"))
    near = _turns(("user", " ".join(words[:100] + ["changed"] + words[101:])), ("assistant", "ok"))
    src = _write(tmp_path / "chats.jsonl", [GOOD[0], *bad, GOOD[0], GOOD[2], long, near])
    manifest = prepare_chat(str(src), tmp_path / "out", ChatSettings(val_fraction=0))
    assert manifest["splits"]["train"]["docs"] == 3
    report = (tmp_path / "out" / "report.md").read_text()
    for line, reason in [
        (2, "no assistant turn"),
        (3, "messages[1].role: 'robot'"),
        (4, "messages[0].content"),
        (5, "not JSON"),
        (6, "split 'test'"),
    ]:
        assert f"chats.jsonl:{line}: {reason}" in report, reason
    assert f"chats.jsonl:7: exact duplicate of {src}:1" in report
    assert "| bad row: messages[i].role | 1 |" in report and "| exact duplicate | 1 |" in report
    rows = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    assert [(r["document"], r["stage"]) for r in rows] == [
        *((f"{src}:{line}", "bad row") for line in range(2, 7)),
        (f"{src}:7", "exact duplicate"),
        (f"{src}:10", "near duplicate"),
    ]
    assert rows[0]["reason"].startswith("no assistant turn")
    assert (rows[5]["kept"], rows[5]["jaccard"]) == (f"{src}:1", 1.0)
    assert rows[6]["kept"] == f"{src}:9" and 0.9 < rows[6]["jaccard"] < 1
    assert "`removed.jsonl` (7 rows)" in report


def test_a_file_with_no_usable_row_is_one_line_and_writes_nothing(tmp_path):
    src = _write(tmp_path / "chats.jsonl", [_turns(("user", "alone")), "[]"])
    with pytest.raises(
        GptforgeError, match=r"no usable conversation in 2 rows \(2 bad \(messages\)\); first bad row: "
    ):
        prepare_chat(str(src), tmp_path / "out", ChatSettings())
    assert not (tmp_path / "out").exists()
    evals = _write(tmp_path / "eval.jsonl", [{"q": " ".join(f"w{i}" for i in range(13))}])
    _write(src, [_turns(("user", " ".join(f"w{i}" for i in range(13))), ("assistant", "x"))])
    with pytest.raises(GptforgeError, match=r"no usable conversation in 1 rows \(1 contaminated\)$"):  # said no why
        prepare_chat(str(src), tmp_path / "out", ChatSettings(decontaminate=(str(evals),)))


def test_a_damaged_mask_is_named(tmp_path):
    (tmp_path / "m.npy").write_bytes(b"junk")
    with pytest.raises(GptforgeError, match="m.npy: not a readable loss mask"):
        read_mask(tmp_path / "m.npy", 3)
    np.save(tmp_path / "w.npy", np.zeros(4, dtype=np.uint8))
    with pytest.raises(GptforgeError, match="expected 3 uint8 mask values"):
        read_mask(tmp_path / "w.npy", 3)


def test_the_loader_packs_whole_conversations_and_learns_only_the_replies(tmp_path):
    rows = [_turns(("user", f"Question {i}?" + " more" * (i % 4)), ("assistant", f"Answer {i}.")) for i in range(30)]
    rows.append(_turns(("user", "long " * 80), ("assistant", "cut off")))
    src = _write(tmp_path / "chats.jsonl", rows)
    prepare_chat(str(src), tmp_path / "out", ChatSettings(val_fraction=0))
    loader = TokenLoader(tmp_path / "out", "train", batch_size=1, seq_len=48, shuffle=False)
    tok = with_chat(GPT2Tokenizer())
    seen = []
    for w in range(loader.n_windows):
        x, y = loader.batch([w])
        tokens = np.asarray(loader.window(w))
        assert tokens[0] == tok.im_start and len(tokens) == 49  # each window starts a conversation
        keep = (y[0] >= 0).numpy()
        assert (y[0].numpy()[keep] == tokens[1:][keep]).all() and (x[0].numpy() == tokens[:-1]).all()
        learned = y[0].numpy()[keep]
        seen += [t for t in tok.decode(learned).split("<|im_end|>") if t]
    assert seen == [f"Answer {i}." for i in range(30)]  # every reply once, whole; the 80-word request is cut
    assert loader.spans[-1, 1] == 49 and loader.n_windows < 30


def test_the_command_finds_conversations_in_jsonl_and_refuses_flags_that_do_not_apply(tmp_path, capsys):
    from gptforge.cli import main

    src = _write(tmp_path / "chats.jsonl", GOOD)
    assert main(["prepare", str(src), "--out", str(tmp_path / "out"), "--val-fraction", "0"]) == 0
    out = capsys.readouterr().out
    assert "conversations (OpenAI messages): preparing them for fine-tuning" in out
    assert "3 training conversations" in out and read_manifest(tmp_path / "out")["chat"]["template"] == "chatml"
    for flags in (["--train-tokenizer", "300"], ["--clean", "code"], ["--ext", "py"], ["--tasks", "3"]):
        assert main(["prepare", str(src), "--chat", "--out", str(tmp_path / "o2"), *flags]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"{flags[0]}: does not apply to conversations" in err
    for flags in (["--dedup-bands", "7"], ["--val-fraction", "-1"], ["--shard-tokens", "0"], ["--dedup", "bogus"]):
        assert main(["prepare", str(src), "--out", str(tmp_path / "o2"), *flags]) == 1
        assert flags[0] in capsys.readouterr().err
    # A text field named says the rows are documents: no detection.
    assert main(["prepare", str(src), "--out", str(tmp_path / "o3"), "--text-field", "text"]) == 1
    assert "conversations" not in capsys.readouterr().out
    assert not (tmp_path / "o2").exists()


def test_distinct_conversations_behind_one_long_system_message_are_not_copies(tmp_path):
    system = " ".join(f"rule{i} applies to every answer you give" for i in range(20))
    rows = [
        _turns(("system", system), ("user", f"What is {i} plus {i}?"), ("assistant", str(2 * i))) for i in range(30)
    ]
    twins = [
        _turns(("user", "x\nassistant\ny"), ("assistant", "z")),
        _turns(("user", "x"), ("assistant", "y\nassistant\nz")),
    ]
    src = _write(tmp_path / "chats.jsonl", rows + twins + rows[:1])
    manifest = prepare_chat(str(src), tmp_path / "out", ChatSettings(val_fraction=0))
    assert manifest["splits"]["train"]["docs"] == 32  # the 30, both twins; only the exact repeat goes
    assert manifest["removed"] == {"exact duplicate": 1}


def test_all_held_out_says_so_and_what_to_do(tmp_path):
    src = _write(tmp_path / "chats.jsonl", [{**GOOD[0], "split": "val"}, {**GOOD[2], "split": "val"}])
    with pytest.raises(
        GptforgeError, match=r"all 2 usable conversations are held out .*--val-fraction 0, or mark rows"
    ):
        prepare_chat(str(src), tmp_path / "out", ChatSettings())
    _write(src, [GOOD[0]] * 30 + ["{"])  # copies of the one held out: the count says where the rows went
    with pytest.raises(GptforgeError, match=r"all 1 usable conversations of 31 rows \(1 bad \(not JSON\), 29 exact"):
        prepare_chat(str(src), tmp_path / "out", ChatSettings())


def test_an_out_among_the_files_a_chat_prepare_reads_is_refused(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    _write(tmp_path / "d" / "a.jsonl", GOOD)
    kept = _write(tmp_path / "d" / "sub" / "b.jsonl", GOOD)
    with pytest.raises(GptforgeError, match="which this command reads"):
        prepare_chat(str(tmp_path / "d" / "**" / "*.jsonl"), tmp_path / "d" / "sub", ChatSettings(), force=True)
    evals = _write(tmp_path / "ev.jsonl", [{"q": "x"}])
    with pytest.raises(GptforgeError, match="which this command reads"):
        prepare_chat(str(kept), tmp_path, ChatSettings(decontaminate=(str(evals),)), force=True)
    assert kept.is_file() and evals.is_file()


def test_a_chat_folder_prepared_inside_its_source_is_not_read_as_conversations(tmp_path):
    """Its removed.jsonl was read as rows (every one a bad row), and a --force rerun refused as reading --out."""
    (tmp_path / "d").mkdir()
    _write(tmp_path / "d" / "a.jsonl", [*GOOD, "not json"])
    first = prepare_chat(str(tmp_path / "d"), tmp_path / "d" / "out", ChatSettings(val_fraction=0))
    for source in (str(tmp_path / "d"), str(tmp_path / "d" / "**" / "*.jsonl")):
        again = prepare_chat(source, tmp_path / "d" / "out", ChatSettings(val_fraction=0), force=True)
        assert again["removed"] == first["removed"] == {"bad rows (not JSON)": 1}


def test_the_validation_loss_of_a_chat_folder_is_the_mean_over_the_replies_tokens(tmp_path):
    from gptforge.eval.loss import evaluate_loss
    from gptforge.model.gpt import GPT, GPTConfig

    rows = [_turns(("user", "word " * (i % 7 + 1)), ("assistant", "reply " * (1 + i % 5))) for i in range(24)]
    rows.append(_turns(("user", "  "), ("assistant", "end")))
    prepare_chat(str(_write(tmp_path / "c.jsonl", rows)), tmp_path / "out", ChatSettings(val_fraction=0.5))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50259, n_layer=1, n_head=2, n_embd=16, document_token=50256))
    result = evaluate_loss(model, tmp_path / "out", 1, 32, 10_000, torch.device("cpu"), torch.float32)
    loader = TokenLoader(tmp_path / "out", "val", batch_size=1, seq_len=32, shuffle=False)
    total, count = 0.0, 0
    for w in range(loader.n_windows):
        x, y = loader.batch([w])
        logits, _ = model(x, y, all_logits=True)
        keep = y[0] >= 0
        total += torch.nn.functional.cross_entropy(logits[0][keep], y[0][keep], reduction="sum").item()
        count += int(keep.sum())
    assert result["tokens"] == count and abs(result["loss"] - total / count) < 1e-5


def test_rows_that_used_to_raise_are_bad_rows_and_text_parts_are_read(tmp_path):
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a"},
        ]
    }
    lines = [json.dumps(GOOD[0]), json.dumps(parts), '{"messages": [{"role": "user", "content": "a\\ud800"}, '
             '{"role": "assistant", "content": "b"}]}', '{"x": ' + "9" * 5000 + "}"]  # fmt: skip
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    manifest = prepare_chat(str(tmp_path / "c.jsonl"), tmp_path / "out", ChatSettings(val_fraction=0))
    assert manifest["splits"]["train"]["docs"] == 2
    report = (tmp_path / "out" / "report.md").read_text()
    assert "c.jsonl:3: messages[0].content: holds a lone surrogate" in report and "c.jsonl:4: not JSON" in report


def test_a_base_model_on_conversations_and_windows_with_no_reply_are_one_line(tmp_path):
    from gptforge.eval.loss import evaluate_loss
    from gptforge.model.gpt import GPT, GPTConfig

    prepare_chat(str(_write(tmp_path / "c.jsonl", GOOD)), tmp_path / "out", ChatSettings(val_fraction=0))
    base = GPT(GPTConfig(block_size=32, vocab_size=50259, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(GptforgeError, match="conversations .*this one is a base model"):
        evaluate_loss(base, tmp_path / "out", 1, 32, 1000, torch.device("cpu"), torch.float32, split="train")
    long = [_turns(("user", "word " * 60), ("assistant", f"r{i}")) for i in range(4)]
    prepare_chat(str(_write(tmp_path / "l.jsonl", long)), tmp_path / "long", ChatSettings(val_fraction=0))
    with pytest.raises(GptforgeError, match="every conversation is cut before its reply"):
        TokenLoader(tmp_path / "long", "train", batch_size=1, seq_len=32)


def test_contaminated_conversations_are_rows_of_removed_jsonl_and_no_copy_names_one_as_kept(tmp_path):
    """report.md counted contaminated conversations that removed.jsonl could lose unseen; their copies said
    `"kept": "<the contaminated one>"`."""
    leak = " ".join(f"w{i}" for i in range(13))
    evals = _write(tmp_path / "eval.jsonl", [{"q": leak}])
    rows = [
        _turns(("user", "Name a prime."), ("assistant", "Seven.")),
        _turns(("user", f"Explain {leak}."), ("assistant", "It is a list of words, each one a w and a number.")),
        _turns(("user", f"Explain {leak}."), ("assistant", "It is a list of words, each one a w and a number.")),
        _turns(("user", "Explain w0 to w12."), ("assistant", "It is a list of words, each one a w and a number.")),
    ]
    src = _write(tmp_path / "chats.jsonl", rows)
    for dedup in ("near", "exact"):
        out = tmp_path / dedup
        settings = ChatSettings(val_fraction=0, decontaminate=(str(evals),), dedup=DedupSettings(mode=dedup))
        prepare_chat(str(src), out, settings)
        removed = [json.loads(line) for line in (out / "removed.jsonl").read_text().splitlines()]
        assert [(r["document"], r["stage"]) for r in removed] == [
            (f"{src}:2", "contaminated"),
            (f"{src}:3", "contaminated"),
        ], removed
        assert "contaminated | 2" in (out / "report.md").read_text().replace("*", "")


def test_a_file_whose_name_is_not_utf8_is_read_and_named_as_backslashreplace_shows_it(tmp_path):
    """b'caf\\xe9.jsonl' reaches Python as 'caf\\udce9.jsonl', which removed.jsonl and report.md cannot hold."""
    import os

    (tmp_path / "d").mkdir()
    _write(tmp_path / "d" / os.fsdecode(b"caf\xe9.jsonl"), [*GOOD, "not json", GOOD[0]])
    manifest = prepare_chat(str(tmp_path / "d"), tmp_path / "out", ChatSettings(val_fraction=0))
    assert manifest["removed"] == {"bad rows (not JSON)": 1, "exact duplicate": 1}
    named = f"{tmp_path / 'd'}/caf\\xe9.jsonl"
    removed = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_bytes().decode().splitlines()]
    assert [(r["document"], r.get("kept")) for r in removed] == [(f"{named}:5", None), (f"{named}:6", f"{named}:1")]
    assert f"- {named}:5: not JSON" in (tmp_path / "out" / "report.md").read_bytes().decode()


def test_a_row_that_is_not_utf8_is_a_bad_row_named_by_its_line_and_the_rest_are_read(tmp_path):
    """One byte that is not UTF-8 in one row aborted the whole prepare, naming no line."""
    src = tmp_path / "chats.jsonl"
    good = [json.dumps(row) + "\n" for row in GOOD[:3]]
    src.write_bytes("".join(good[:2]).encode() + b'{"instruction": "caf\xe9", "output": "x"}\n' + good[2].encode())
    manifest = prepare_chat(str(src), tmp_path / "out", ChatSettings(val_fraction=0))
    assert manifest["splits"]["train"]["docs"] == 3
    removed = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    assert removed == [
        {
            "document": f"{src}:3",
            "stage": "bad row",
            "reason": "not valid UTF-8 text (byte 0xe9 at character 21)",
        }
    ]


def test_a_bare_carriage_return_in_a_row_neither_splits_it_nor_shifts_the_lines_named(tmp_path):
    """Rows were split at a bare \\r (JSON whitespace, but a line break to Python's text files): a good row became
    two bad ones and every later row was named a line too far."""
    src = tmp_path / "chats.jsonl"
    row = json.dumps(GOOD[0]).replace(", ", ",\r")
    src.write_bytes(f"{row}\r\n{{not json\n{json.dumps(GOOD[2])}\n".encode())
    assert chat_form(str(src)) == "OpenAI messages"
    manifest = prepare_chat(str(src), tmp_path / "out", ChatSettings(val_fraction=0))
    assert manifest["splits"]["train"]["docs"] == 2
    removed = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().split("\n") if line]
    assert [(r["document"], r["reason"][:8]) for r in removed] == [(f"{src}:2", "not JSON")]
