"""Fill-in-the-middle: the PSM/SPM transformations are exact, deterministic per window, equal across ranks and on
resume; a FIM-trained checkpoint infills with `sample --suffix`, one trained without refuses in one line."""

import shutil

import numpy as np
import pytest
import torch
from tests.helpers import losses, weights

from gptforge.checkpoint import load_checkpoint
from gptforge.cli import main
from gptforge.config import load_config
from gptforge.data.fim import FIM
from gptforge.data.loader import TokenLoader
from gptforge.tokens.fim import FIM_TEXTS, FIMTokenizer, with_fim
from gptforge.tokens.tokenizer import load_tokenizer
from gptforge.train.trainer import train

DOCS = [
    "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    "naïve café — 東京 🚀 unicode in a docstring, then code: x = [i * i for i in range(10)]\n",
    "import os\n\nfor name in sorted(os.listdir('.')):\n    print(name)\n" * 3,
]


@pytest.fixture(scope="module")
def tok():
    return FIMTokenizer(load_tokenizer("gpt2"))


def window(tok):
    ids = []
    for doc in DOCS:
        ids += [*tok.encode(doc), tok.eot]
    return np.asarray(ids, dtype=np.int64)


def parts(out, tok):
    """(format, prefix, middle, suffix) token lists of one rearranged document."""
    s = tok.sentinels
    out = list(out)
    assert out[0] == s.prefix and out.count(s.suffix) == out.count(s.middle) == 1
    mid = out.index(s.middle)
    if out[1] == s.suffix:  # SPM: <pre> <suf> suffix <mid> prefix+middle
        return "spm", None, out[mid + 1 :], out[2:mid]
    suf = out.index(s.suffix)
    return "psm", out[1:suf], out[mid + 1 :], out[suf + 1 : mid]


@pytest.mark.parametrize("spm_rate, expected", [(0.0, "psm"), (1.0, "spm")])
def test_each_document_is_cut_and_rearranged_exactly(tok, spm_rate, expected):
    fim = FIM(tok, rate=1.0, spm_rate=spm_rate)
    original, rearranged = window(tok), 0
    for key in range(20):
        out = fim.window(original, (0, 0, key))
        assert len(out) == len(original) and out.dtype == original.dtype
        ends = np.flatnonzero(out == tok.eot)
        assert (ends == np.flatnonzero(original == tok.eot)).all()  # documents keep their places
        for doc, segment in zip(DOCS, np.split(out, ends + 1)[:-1], strict=True):
            if tok.sentinels.prefix not in segment:  # a suffix too short to make room for the sentinels
                assert tok.decode(segment[:-1]) == doc
                continue
            rearranged += 1
            form, prefix, middle, suffix = parts(segment[:-1], tok)
            assert form == expected
            # SPM puts prefix and middle together after <mid>: the document's head, whole
            head = tok.decode(prefix) + tok.decode(middle) if form == "psm" else tok.decode(middle)
            # prefix + middle is the document's start; the suffix gave up only its tail to make room for sentinels
            assert doc.startswith(head) and doc[len(head) :].startswith(tok.decode(suffix))
    assert rearranged >= 0.7 * 20 * len(DOCS)


def test_rate_zero_changes_nothing_and_the_same_window_gets_the_same_cut(tok):
    original = window(tok)
    assert (FIM(tok, rate=0.0, spm_rate=0.5).window(original, (0, 0, 1)) == original).all()
    fim = FIM(tok, rate=0.5, spm_rate=0.5)
    outs = [fim.window(original, (7, e, w)) for e in range(3) for w in range(3)]
    assert all((fim.window(original, (7, e, w)) == outs[3 * e + w]).all() for e in range(3) for w in range(3))
    assert len({o.tobytes() for o in outs}) > 3  # epochs and windows draw their own cuts


def forms(fim, tok, original, key):
    """Each document's form in one window: 'psm', 'spm', or None where it stayed as it was."""
    out = fim.window(original, key)
    segments = np.split(out, np.flatnonzero(out == tok.eot) + 1)[:-1]
    return [parts(seg[:-1], tok)[0] if tok.sentinels.prefix in seg else None for seg in segments]


def test_psm_or_spm_is_a_draw_of_its_own_in_the_stated_proportion(tok):
    # At fim_rate 0.5 the rearranged documents are those whose first draw fell under 0.5: were the form read from
    # that draw too, every one of them would be SPM.
    fim, original = FIM(tok, rate=0.5, spm_rate=0.5), window(tok)
    drawn = [f for key in range(100) for f in forms(fim, tok, original, (3, 0, key))]
    rearranged = [f for f in drawn if f is not None]
    assert len(rearranged) > 100 and 0.4 < rearranged.count("spm") / len(rearranged) < 0.6
    assert [forms(fim, tok, original, (3, 0, key)) for key in range(6)] == [  # as seeded: each form, and neither
        [None, "psm", None],
        [None, None, None],
        [None, None, "spm"],
        ["psm", None, None],
        ["spm", None, None],
        [None, "spm", None],
    ]


def test_sentinels_follow_the_vocabulary_and_decode_to_their_names(tok):
    assert (tok.sentinels.prefix, tok.sentinels.middle, tok.sentinels.suffix) == (50257, 50258, 50259)
    assert tok.vocab_size == 50260 and tok.name == "gpt2" and tok.eot == 50256
    assert tok.decode([tok.sentinels.prefix, *tok.encode("x = 1"), tok.sentinels.middle]) == (
        f"{FIM_TEXTS[0]}x = 1{FIM_TEXTS[1]}"
    )
    assert with_fim(tok.base, 0.0) is tok.base and with_fim(tok, 0.5) is tok


def loader(data_dir, tok, **kw):
    return TokenLoader(data_dir, "train", seq_len=64, seed=3, fim=FIM(tok, rate=0.5, spm_rate=0.5), **kw)


def test_two_ranks_read_what_one_reads_and_resume_is_exact(data_dir, tok):
    one = loader(data_dir, tok, batch_size=4)
    ranks = [loader(data_dir, tok, batch_size=2, rank=r, world_size=2) for r in range(2)]
    placed = 0
    for _ in range(4):
        x, _ = one.next_batch()
        assert torch.equal(x, torch.cat([r.next_batch()[0] for r in ranks]))
        placed += int((x == tok.sentinels.middle).sum())
    assert placed > 0
    state = one.state_dict()
    expected = [one.next_batch() for _ in range(2)]
    again = loader(data_dir, tok, batch_size=4)
    again.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, [again.next_batch()
               for _ in range(2)], strict=True))  # fmt: skip


def tiny(data_dir, *overrides):
    return load_config("tiny", [f"data.path={data_dir}", "data.fim_rate=0.5", "eval.every=0", *overrides])


@pytest.mark.slow
def test_a_fim_run_resumes_exactly_and_infills(data_dir, tmp_path, capsys):
    cfg = tiny(data_dir, "train.max_steps=6", "checkpoint.every=3")
    straight = train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000006")
    resumed = train(cfg, tmp_path / "b", resume="auto")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    a, b = weights(straight.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(a[name], b[name]) for name in a)
    model, tok, _, _ = load_checkpoint(tmp_path / "a")
    assert isinstance(tok, FIMTokenizer) and model.config.vocab_size == 50260
    capsys.readouterr()
    args = ["sample", str(tmp_path / "a"), "--prompt", "def f(x):\n", "--suffix", "\n    return y\n"]
    assert main([*args, "--temperature", "0", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- sample 0\ndef f(x):\n") and out.endswith("\n    return y\n\n")


def test_infilling_with_a_model_trained_without_fim_is_one_line(data_dir, tmp_path, capsys):
    train(load_config("tiny", [f"data.path={data_dir}", "train.max_steps=1", "eval.every=0"]), tmp_path / "run")
    assert main(["sample", str(tmp_path / "run"), "--prompt", "def f(", "--suffix", ")"]) == 1
    err = capsys.readouterr().err
    assert "--suffix:" in err and "trained without fill-in-the-middle" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_an_infill_prompt_past_the_context_is_one_line(data_dir, tmp_path, capsys):
    train(tiny(data_dir, "train.max_steps=1"), tmp_path / "run")
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--prompt", "x = 1\n" * 200, "--suffix", "return"]) == 1
    err = capsys.readouterr().err
    assert "--prompt/--suffix: the infill prompt has" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("trained", [False, True])
def test_exports_carry_the_sentinels_and_transformers_infills_as_we_do(tmp_path, trained):
    transformers = pytest.importorskip("transformers")
    from tests.hub.test_gguf_export import tiny_model

    from gptforge.hub.convert import export_hf
    from gptforge.model.generate import generate
    from gptforge.tokens.fim import infill_prompt
    from gptforge.tokens.tokenizer import train_bpe

    base = train_bpe(DOCS * 20, 300, tmp_path / "tokenizer.json") if trained else load_tokenizer("gpt2")
    tok = FIMTokenizer(base)
    model = tiny_model(vocab_size=tok.vocab_size)
    out = export_hf(model, tok, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert [hf_tok.convert_tokens_to_ids(t) for t in FIM_TEXTS] == list(vars(tok.sentinels).values())
    prompt = infill_prompt(tok, "def add(a, b):\n", "\n    return c\n")
    assert hf_tok.encode(f"{FIM_TEXTS[0]}def add(a, b):\n{FIM_TEXTS[2]}\n    return c\n{FIM_TEXTS[1]}") == prompt
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert theirs[0, len(prompt) :].tolist() == generate(model, prompt, 10, temperature=0.0)[0]
