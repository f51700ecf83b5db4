import pytest

from gptforge.data.tokenizer import check_data_tokenizer
from gptforge.errors import GptforgeError
from gptforge.tokens.tokenizer import load_tokenizer, train_bpe


def test_gpt2_ids_match_openai():
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eot == 50256
    assert tok.vocab_size == 50257


def test_round_trip_of_code_and_unicode():
    tok = load_tokenizer("gpt2")
    text = "def f(x):\n    return x ** 2  # naïve ✓\n\tpass\n"
    assert tok.decode(tok.encode(text)) == text


def test_literal_eot_text_is_not_the_eot_token():
    tok = load_tokenizer("gpt2")
    assert tok.eot not in tok.encode("<|endoftext|>")


def test_trained_bpe_round_trips_and_keeps_eot_literal(tmp_path):
    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "héllo wörld ✓\n"] * 20
    tok = train_bpe(texts, 300, tmp_path / "tok.json")
    assert tok.eot == 0 and 257 <= tok.vocab_size <= 300
    for text in [*texts[:3], "unseen → text\t\r\n"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eot not in tok.encode("<|endoftext|>")
    again = load_tokenizer("tok.json", tmp_path)
    assert again.encode(texts[0]) == tok.encode(texts[0]) and again.name == "tok.json"


def test_a_long_run_of_one_letter_trains_in_moments(tmp_path):
    import time

    start = time.perf_counter()
    tok = train_bpe(["x = 1\n", "key = '" + "a" * 400_000 + "'\n"], 300, tmp_path / "tok.json")  # minutes, uncapped
    assert time.perf_counter() - start < 10
    assert tok.decode(tok.encode("b" + "a" * 3000)) == "b" + "a" * 3000  # encoding is not capped


def test_unknown_or_bad_tokenizer(tmp_path):
    with pytest.raises(GptforgeError, match="unknown tokenizer 'nope'"):
        load_tokenizer("nope")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(GptforgeError, match=r"bad\.json: not a tokenizer file"):
        load_tokenizer("bad.json", tmp_path)


def test_a_tokenizer_file_in_a_folder_whose_name_is_not_utf8_loads(tmp_path):
    """`tokenizers` opens UTF-8 paths only; Python reads the byte 0xfe of a name as a lone surrogate."""
    import os

    folder = tmp_path / os.fsdecode(b"b\xfe")
    folder.mkdir()
    trained = train_bpe(["x = 1\n"] * 9, 300, folder / "tokenizer.json")
    assert load_tokenizer("tokenizer.json", folder).encode("x = 1") == trained.encode("x = 1")


def test_data_made_with_another_tokenizer_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    words = [f"word{i} thing{i * 7} " for i in range(200)]
    a = train_bpe(words, 300, tmp_path / "a" / "tokenizer.json")
    b = train_bpe(list(reversed([w.upper() for w in words])), 300, tmp_path / "b" / "tokenizer.json")
    assert a.vocab_size == b.vocab_size == 300 and a.encode("word1") != b.encode("word1")
    check_data_tokenizer(a, "data", load_tokenizer("tokenizer.json", tmp_path / "a"), "checkpoint c")
    with pytest.raises(
        GptforgeError,
        match=r"^data: made with tokenizer tokenizer.json \(300 tokens\), but checkpoint c "
        r"uses another tokenizer.json \(300 tokens\); prepare the data with --tokenizer .*b/tokenizer.json$",
    ):
        check_data_tokenizer(a, "data", b, "checkpoint c")
    with pytest.raises(
        GptforgeError, match=r"made with tokenizer gpt2 \(50,257 tokens\), but checkpoint c uses tokenizer"
    ):
        check_data_tokenizer(load_tokenizer("gpt2"), "data", b, "checkpoint c")


def test_a_vocabulary_too_large_to_train_is_refused_and_a_short_one_is_said(tmp_path, capsys):
    from gptforge.tokens.tokenizer import check_vocab_size

    with pytest.raises(GptforgeError, match=r"--train-tokenizer 1048577: .* at most 1,048,576"):
        check_vocab_size(2**20 + 1)
    tok = train_bpe(["x = 1\n"] * 3, 100_000, tmp_path / "t.json")
    assert tok.vocab_size < 300
    assert (
        f"the trained vocabulary has {tok.vocab_size:,} tokens, fewer than the 100,000 asked" in capsys.readouterr().out
    )
