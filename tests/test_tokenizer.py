from gptforge.tokenizer import load_tokenizer


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
