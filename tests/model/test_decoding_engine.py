"""The decoding engine under every caller: each sequence writes what it writes alone and what a naive loop over
the whole window writes, one token a step, whatever joins or leaves the batch beside it."""

import copy
import dataclasses

import pytest
import torch

import gptforge.model.engine as engine_module
from gptforge.model.engine import LENGTH, STOP, Engine, Sequence, column_major
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.sampling import Sampling

MODERN = {"norm": "rmsnorm", "position": "rotary", "qk_norm": True, "bias": False, "mlp": "relu2"}


def tiny(block: dict | None = None, block_size: int = 24) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=64, n_layer=2, n_head=2, n_embd=16, **(block or {})))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)  # the next token depends on the context, so mixed-up rows or positions show
    return model.eval()


@torch.no_grad()
def naive_greedy(model: GPT, ids: list[int], new: int) -> list[int]:
    """The reference: every token from a forward over the whole window, no cache."""
    ids = list(ids)
    for _ in range(new):
        ids.append(int(model(torch.tensor([ids[-model.config.block_size :]]))[0][0, -1].argmax()))
    return ids


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13] * 5, [14, 15, 16, 17], [18] * 20]


@pytest.mark.parametrize("block", [None, MODERN], ids=["gpt2", "modern"])
def test_greedy_sequences_in_a_changing_batch_write_what_a_naive_loop_writes(block):
    """Rows join as others leave (2 rows for 6 sequences), some slide past the 24-token context."""
    model = tiny(block)
    budgets = [9, 4, 12, 16, 2, 10]
    seqs = [Sequence(list(p), n) for p, n in zip(PROMPTS, budgets, strict=True)]
    Engine(model, rows=2).run(*seqs)
    for seq, prompt, n in zip(seqs, PROMPTS, budgets, strict=True):
        assert seq.ids == naive_greedy(model, prompt, n) and seq.finish == LENGTH
        assert seq.new == seq.ids[len(prompt) :] and len(seq.new) == n


def test_every_step_gives_each_sequence_one_token_the_first_from_its_prefill():
    model = tiny()
    engine = Engine(model, rows=4)
    first, second = Sequence([1, 2, 3], 5), Sequence([4, 5], 5)
    engine.submit(first)
    engine.step()
    assert len(first.new) == 1
    engine.submit(second)
    engine.step()
    assert (len(first.new), len(second.new)) == (2, 1)
    engine.step()
    assert (len(first.new), len(second.new)) == (3, 2)


def test_n_samples_share_one_prefill_and_each_draws_from_its_own_generator(monkeypatch):
    model = tiny()
    prompt, rule = [3, 1, 4, 1, 5], Sampling(1.0)
    seeds = [1, 2, 1]
    prefills = []
    real = engine_module.forward_logits

    def counted(m, x, cache):
        if x.size(1) > 1:
            prefills.append(x.shape)
        return real(m, x, cache)

    monkeypatch.setattr(engine_module, "forward_logits", counted)
    shared = [Sequence(list(prompt), 12, rule, torch.Generator().manual_seed(s), prompt_key="p") for s in seeds]
    Engine(model, rows=3).run(*shared)
    assert prefills == [torch.Size([1, len(prompt)])]  # one prefill for the three
    monkeypatch.setattr(engine_module, "forward_logits", real)
    alone = []
    for s in seeds:
        alone.append(Sequence(list(prompt), 12, rule, torch.Generator().manual_seed(s)))
        Engine(model, rows=1).run(alone[-1])
    assert [s.ids for s in shared] == [s.ids for s in alone]
    assert shared[0].ids == shared[2].ids and shared[0].ids != shared[1].ids  # the seed decides, not the row


def test_a_stop_id_ends_a_sequence_keeps_the_token_and_frees_its_row_for_the_next():
    model = tiny()
    free_run = naive_greedy(model, [1, 2, 3], 10)[3:]
    stop = free_run[4]
    cut = free_run.index(stop)  # the first time it comes
    watched = []
    seq = Sequence([1, 2, 3], 10, ends=frozenset({stop}), watch=lambda s, t, is_stop: watched.append((t, is_stop)))
    after = Sequence([7, 8], 6)
    ended = []
    seq.ended = after.ended = ended.append
    engine = Engine(model, rows=1)
    engine.run(seq, after)
    assert seq.new == free_run[: cut + 1] and seq.finish == STOP
    assert watched[-1] == (stop, True) and all(not s for _, s in watched[:-1])
    assert after.ids == naive_greedy(model, [7, 8], 6) and ended == [seq, after] and not engine.busy


def test_a_watcher_ends_a_sequence_and_one_that_may_not_slide_ends_at_the_context():
    model = tiny()
    word = Sequence([1, 2], 10, watch=lambda s, t, stop: len(s.new) == 3)
    fixed = Sequence([5] * 20, 10, slides=False)  # 20 + 4 fill the 24-token context, which predicts one more
    Engine(model, rows=2).run(word, fixed)
    assert (len(word.new), word.finish) == (3, STOP)
    assert (len(fixed.ids), fixed.finish) == (25, LENGTH)


def test_a_removed_sequence_frees_its_row_and_the_rest_go_on_as_alone():
    model = tiny()
    engine = Engine(model, rows=2)
    leaving, staying, waiting = Sequence([1, 2, 3], 50), Sequence([9, 8, 7, 6], 8), Sequence([4], 6)
    engine.submit(leaving, staying, waiting)
    engine.step()
    engine.step()
    engine.remove(leaving)
    while engine.busy:
        engine.step()
    assert staying.ids == naive_greedy(model, [9, 8, 7, 6], 8) and waiting.ids == naive_greedy(model, [4], 6)
    assert leaving.finish is None and len(leaving.new) == 2


def test_uncached_decoding_writes_what_the_cache_does():
    model = tiny(MODERN)
    cached = [Sequence(list(p), 8) for p in PROMPTS]
    uncached = [Sequence(list(p), 8) for p in PROMPTS]
    Engine(model, rows=3).run(*cached)
    Engine(model, rows=3, use_cache=False).run(*uncached)
    assert [s.ids for s in cached] == [s.ids for s in uncached]


def test_no_budget_ends_at_once_and_an_empty_prompt_is_refused():
    ended = []
    seq = Sequence([1], 0, ended=ended.append)
    engine = Engine(tiny(), rows=1)
    engine.submit(seq)
    assert seq.finish == LENGTH and ended == [seq] and not engine.busy
    with pytest.raises(ValueError, match="at least one token"):
        engine.submit(Sequence([], 3))


def test_a_stop_id_drawn_from_the_prefill_ends_the_sequence_before_it_takes_a_row():
    model = tiny()
    first = naive_greedy(model, [1, 2, 3], 1)[-1]
    seq = Sequence([1, 2, 3], 10, ends=frozenset({first}))
    engine = Engine(model, rows=1)
    engine.submit(seq)
    engine.step()
    assert seq.new == [first] and seq.finish == STOP and not engine.busy


def test_a_prompt_key_used_again_after_its_sequences_took_their_prefill_gets_a_fresh_one():
    """A spent prefill kept under its key would hand another prompt's cache to a later sequence of that key."""
    model = tiny()
    engine = Engine(model, rows=2)
    engine.run(Sequence([1, 2, 3], 4, prompt_key="k"), Sequence([1, 2, 3], 4, prompt_key="k"))
    later = Sequence([9, 9, 9, 9], 5, prompt_key="k")
    engine.run(later)
    assert later.ids == naive_greedy(model, [9, 9, 9, 9], 5)


@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_the_static_and_compiled_steps_write_what_a_naive_loop_writes(decode):
    """Fixed shapes: a mask over the whole context, batches padded to a power of two (3 rows decode as 4)."""
    model = tiny(MODERN)
    budgets = [9, 4, 12, 16, 2, 10]
    seqs = [Sequence(list(p), n) for p, n in zip(PROMPTS, budgets, strict=True)]
    Engine(model, rows=3 if decode == "static" else 1, decode=decode).run(*seqs)
    for seq, prompt, n in zip(seqs, PROMPTS, budgets, strict=True):
        assert seq.ids == naive_greedy(model, prompt, n), prompt


def test_an_unknown_decode_is_refused():
    with pytest.raises(ValueError, match="decode='fast': expected one of rows, static, compiled"):
        Engine(tiny(), decode="fast")


def test_column_major_weights_decode_the_same_tokens_and_keep_the_tied_table_one():
    model = tiny(MODERN)
    reference = [Sequence(list(p), 8) for p in PROMPTS]
    Engine(model, rows=3).run(*reference)
    column_major(model)
    assert model.lm_head.weight.stride() == (1, model.lm_head.weight.size(0))
    assert model.transformer.wte.weight is model.lm_head.weight
    again = [Sequence(list(p), 8) for p in PROMPTS]
    Engine(model, rows=3).run(*again)
    assert [s.ids for s in again] == [s.ids for s in reference]


def test_past_torch_s_limit_of_compiled_graphs_the_step_runs_eagerly():
    """A server decodes batches of many sizes for several models: past the limit the step must go on, not fail."""
    import torch._dynamo.config

    model = tiny(MODERN)
    with torch._dynamo.config.patch(recompile_limit=1):  # a monkeypatch's undo deleted the option for later tests
        for rows in (1, 2, 4):
            seqs = [Sequence(list(p), 5) for p in PROMPTS[:rows]]
            Engine(model, rows=rows, decode="compiled").run(*seqs)
            assert [s.ids for s in seqs] == [naive_greedy(model, p, 5) for p in PROMPTS[:rows]]


def test_a_padding_row_left_by_a_sequence_starts_over_each_step():
    """4 rows, the last leaves early: the 3 left decode as 4, the fourth a padding row whose old position must not
    run on past the context."""
    model = tiny(MODERN)
    prompts, budgets = [[1, 2], [3], [4, 5, 6], list(range(7, 25))[:19]], [12, 12, 12, 2]
    seqs = [Sequence(list(p), n) for p, n in zip(prompts, budgets, strict=True)]
    Engine(model, rows=4, decode="static").run(*seqs)
    assert [s.ids for s in seqs] == [naive_greedy(model, p, n) for p, n in zip(prompts, budgets, strict=True)]


class Negated(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -super().forward(x)


def test_models_alike_but_where_no_tensor_shows_decode_compiled_each_as_itself():
    """Models of one structure share a compiled step whose guards on their modules are skipped: one that differs
    only where no tensor's shape shows (its config, a module's attribute or class, its weights' layout, a hook)
    gets its own, and another model of the same structure decodes with its own weights."""
    relu2, gelu, again = tiny(MODERN), tiny({**MODERN, "mlp": "gelu"}), tiny(MODERN)
    with torch.no_grad():
        for p in again.parameters():
            p.normal_(0, 0.4)  # a later checkpoint of relu2's run, say
    narrow = tiny(MODERN)
    narrow.config = dataclasses.replace(narrow.config, vocab_size=60)  # the same padded table: logits cut at 60
    loose, swapped, hooked = tiny(MODERN), tiny(MODERN), tiny(MODERN)
    for module in loose.modules():
        if hasattr(module, "eps"):
            module.eps = 10.0
    swapped.lm_head.__class__ = Negated
    hooked.lm_head.register_forward_hook(lambda module, args, out: out.roll(1, dims=-1))
    others = [gelu, narrow, loose, swapped, column_major(copy.deepcopy(relu2))]
    structures = [engine_module._structure(m) for m in [relu2, *others]]
    assert len(set(structures)) == len(structures) and engine_module._structure(again) == structures[0]
    assert engine_module._structure(hooked) is None  # the compile whose guards check every module
    # Compiling each would take seconds: four show the steps at work, each decoding otherwise. The hooked model's
    # compile, which guards every module, must not take the graphs whose guards skip them.
    assert len({tuple(naive_greedy(m, PROMPTS[0], 8)) for m in (relu2, gelu, again, hooked)}) == 4
    assert Engine(relu2, decode="compiled")._decode is Engine(again, decode="compiled")._decode
    if engine_module.ISOLATES:  # torch >= 2.13: another structure, another compile
        assert Engine(relu2, decode="compiled")._decode is not Engine(gelu, decode="compiled")._decode
    for _ in range(2):  # each model after the others have compiled
        for model in (relu2, gelu, again, hooked):
            seq = Sequence(list(PROMPTS[0]), 8)
            Engine(model, rows=1, decode="compiled").run(seq)
            assert seq.ids == naive_greedy(model, PROMPTS[0], 8)
