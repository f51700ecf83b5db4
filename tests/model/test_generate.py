import pytest
import torch
import torch.nn.functional as F

from gptforge.errors import GptforgeError
from gptforge.model.generate import generate, stream
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.sampling import sample_next


def tiny(block_size=16, vocab_size=1000):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32)).eval()


def test_cache_gives_the_same_greedy_tokens_also_past_the_block_size():
    model = tiny(block_size=16)
    prompt = [5, 17, 300, 2, 999]
    for new in (3, 11, 30):  # within, exactly to, and well past the block size
        cached = generate(model, prompt, new, temperature=0, use_cache=True)
        uncached = generate(model, prompt, new, temperature=0, use_cache=False)
        assert cached == uncached and len(cached[0]) == new


def test_cached_logits_match_a_full_forward():
    model = tiny()
    idx = torch.randint(0, 1000, (2, 12))
    full = model(idx, all_logits=True)[0]
    from gptforge.model.gpt import KVCache

    cache = KVCache(model.config, 2, torch.device("cpu"))
    with torch.no_grad():
        step_logits = [model(idx[:, :8], cache=cache)[0][:, -1]]
        step_logits += [model(idx[:, t : t + 1], cache=cache)[0][:, -1] for t in range(8, 12)]
    torch.testing.assert_close(torch.stack(step_logits, 1), full[:, 7:12].detach(), atol=1e-5, rtol=1e-5)


def test_padded_vocabulary_is_never_sampled():
    model = tiny(vocab_size=1000)  # padded to 1024
    with torch.no_grad():
        # Make the padded rows dominate every logit if they were ever scored.
        model.transformer.wte.weight[1000:] = 50 * model.transformer.ln_f.bias.sign() + 50
    g = torch.Generator().manual_seed(0)
    for top_k, top_p in ((None, None), (50, None), (None, 0.9), (20, 0.5)):
        out = generate(model, [1, 2, 3], 40, num_samples=4, temperature=1.5, top_k=top_k, top_p=top_p, generator=g)
        assert all(0 <= t < 1000 for row in out for t in row)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, 1.0, None, 0.7, g)) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert {int(sample_next(logits, 1.0, None, 0.4, g)) for _ in range(50)} == {0}


def test_seeded_sampling_is_reproducible_and_stops_at_eot():
    model = tiny()
    a = generate(model, [1, 2], 20, num_samples=3, generator=torch.Generator().manual_seed(7))
    b = generate(model, [1, 2], 20, num_samples=3, generator=torch.Generator().manual_seed(7))
    assert a == b
    eot = a[0][2]
    stopped = generate(model, [1, 2], 20, num_samples=3, eot=eot, generator=torch.Generator().manual_seed(7))
    assert stopped[0] == a[0][:2]  # everything from the EOT on is dropped
    steps = list(stream(model, [1, 2], 20, 3, eot=eot, generator=torch.Generator().manual_seed(7)))
    assert all(int(s[0]) == eot for s in steps[2:])


def test_a_tiny_temperature_is_greedy_in_effect_not_an_error():
    model = tiny()
    greedy = generate(model, [1, 2, 3], 12, temperature=0)
    for t in (1e-40, 1e-300, 5e-324):  # 5e-324: the smallest positive float
        g = torch.Generator().manual_seed(0)
        assert generate(model, [1, 2, 3], 12, num_samples=2, temperature=t, top_k=None, generator=g) == greedy * 2


def test_a_diverged_model_is_an_error_on_the_greedy_path_too():
    model = tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "top_k": 1}, {"temperature": 0.7}):
        with pytest.raises(GptforgeError, match="diverged"):
            generate(model, [1, 2, 3], 4, **kwargs)
    logits = torch.zeros(2, 10)
    logits[1, 3] = float("inf")
    with pytest.raises(GptforgeError, match="diverged"):
        sample_next(logits, temperature=0)


MODERN = dict(norm="rmsnorm", position="rotary", qk_norm=True, bias=False, tie_embeddings=False, mlp="relu2")


@pytest.mark.parametrize("block", [{}, MODERN], ids=["gpt2", "modern"])
def test_a_row_cache_decodes_rows_of_different_lengths_as_separate_forwards(block):
    from gptforge.model.gpt import KVCache, RowCache

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=2, n_head=2, n_embd=16, **block)).eval()
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    rows = RowCache(model.config, 4, torch.device("cpu"))
    with torch.no_grad():
        for ids in seqs:
            prompt = KVCache(model.config, 1, torch.device("cpu"))
            model(torch.tensor([ids]), cache=prompt)
            assert rows.add(prompt) == len(rows.lengths) - 1
        for new in ([11, 12, 13], [14, 15, 16]):
            got = model(torch.tensor(new)[:, None], cache=rows)[0][:, -1]
            seqs = [s + [t] for s, t in zip(seqs, new, strict=True)]
            expected = torch.stack([model(torch.tensor([s]))[0][0, -1] for s in seqs])
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        rows.remove(0)  # the last row moves into row 0
        seqs = [seqs[2], seqs[1]]
        assert rows.lengths == [len(s) for s in seqs]
        got = model(torch.tensor([[17], [18]]), cache=rows)[0][:, -1]
        expected = torch.stack([model(torch.tensor([s + [t]]))[0][0, -1] for s, t in zip(seqs, (17, 18), strict=True)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_row_cache_attends_each_row_to_its_own_positions_exactly_as_alone():
    from gptforge.model.gpt import RowCache

    rows = RowCache(GPTConfig(block_size=512, n_layer=1, n_head=4, n_embd=256), 4, torch.device("cpu"))
    rows.lengths = [3, 300, 3, 130]  # rows 0 and 2 attend together, 1 and 3 alone
    rows.positions(1, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, n, 64, generator=g).bfloat16() for n in (1, 301, 301))
    y = rows.attend(q, k, v)
    for row, n in enumerate(rows.lengths):  # bf16: a mask over padded keys would round differently (~4e-3)
        alone = F.scaled_dot_product_attention(
            q[row : row + 1], k[row : row + 1, :, : n + 1], v[row : row + 1, :, : n + 1]
        )
        assert torch.equal(y[row : row + 1], alone)


@pytest.mark.parametrize("block", [{}, MODERN], ids=["gpt2", "modern"])
def test_batched_generation_writes_what_each_prompt_writes_alone(block):
    from gptforge.model.generate import Generation, Sampling, generate_batch

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=48, vocab_size=100, n_layer=2, n_head=2, n_embd=16, **block)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # a context-dependent next token, so that mixed-up rows would show
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17], [18] * 20]
    rules = [Sampling(0.0), Sampling(0.9), Sampling(0.0), Sampling(1.2, top_k=5), Sampling(0.8, top_p=0.7), Sampling()]
    pairs = enumerate(zip(prompts, rules, strict=True))
    items = [Generation(p, 9 + i, rule, torch.Generator().manual_seed(i)) for i, (p, rule) in pairs]
    generate_batch(model, items, ends={7}, done=lambda item: len(item.new) >= 12, rows=3)  # rows join as others end
    for i, item in enumerate(items):
        g = torch.Generator().manual_seed(i)
        r = rules[i]
        alone = generate(model, prompts[i], min(9 + i, 12), temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                         eot=7, generator=g)[0]  # fmt: skip
        assert item.new == alone, i
    assert any(len(item.new) < item.max_new_tokens for item in items)  # some ended at token 7


def test_rows_drawn_together_get_the_tokens_each_gets_alone_over_gpt2s_vocabulary():
    """A greedy row among drawn ones, rules of every kind, float32 and bfloat16 logits."""
    from gptforge.model.sampling import Sampling, sample_rows

    g = torch.Generator().manual_seed(0)
    rules = [Sampling(1.0), Sampling(0.0), Sampling(0.7), Sampling(1.3, top_k=40), Sampling(0.9, top_p=0.8)]
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(2):
            logits = (torch.randn(len(rules), 50257, generator=g) * 4).to(dtype)
            uniforms = torch.rand(len(rules), generator=g, dtype=torch.float64)
            together = sample_rows(logits, rules, uniforms).tolist()
            alone = [int(sample_rows(logits[i : i + 1], rules[i : i + 1], uniforms[i : i + 1])) for i in range(5)]
            assert together == alone


def test_drawing_at_temperature_1_makes_one_pass_over_the_vocabulary_in_float32():
    """The serving step's cost at small models: a float64 copy and rescaling of every row halved the tokens/s, and
    a cumsum over the whole vocabulary took half of what was left."""
    from torch.overrides import TorchFunctionMode

    from gptforge.model.sampling import Sampling, sample_rows

    class Passes(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.made = []  # each new (8, V) tensor: a pass over the whole batch's vocabulary

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == (8, 50257) and all(out is not a for a in args):
                self.made.append((func.__name__, out.dtype))
            return out

    logits, uniforms = torch.randn(8, 50257), torch.rand(8, dtype=torch.float64)
    with Passes() as passes:
        tokens = sample_rows(logits, [Sampling(1.0)] * 8, uniforms)
    assert passes.made == [("softmax", torch.float32)]
    alone = [int(sample_rows(row[None], [Sampling(1.0)], u[None])) for row, u in zip(logits, uniforms, strict=True)]
    assert tokens.tolist() == alone


@pytest.mark.parametrize("vocab", [50257, 8192, 300, 7])
def test_a_draw_inverts_the_cumulative_distribution_and_never_picks_a_token_without_mass(vocab):
    """Against a float64 cumsum over the whole row: the same token for every uniform but those within float32
    rounding of a bound, and never one that top-k (or the row's end) left without probability."""
    from gptforge.model.sampling import Sampling, sample_rows

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(1, vocab, generator=g) * 3
    logits[0, torch.randperm(vocab, generator=g)[: vocab // 3]] = float("-inf")  # gaps inside blocks
    if vocab % 2:  # the last column without mass: a fallback to the row's end would pick it
        logits[0, -1] = float("-inf")
    probs = torch.softmax(logits.double(), dim=-1)[0]
    cdf = probs.cumsum(0)
    edges = torch.tensor([0.0, 1 - 2**-53, 1e-9], dtype=torch.float64)
    uniforms = torch.cat((torch.rand(3000, generator=g, dtype=torch.float64), edges))
    tokens = torch.stack([sample_rows(logits, [Sampling(1.0)], u[None])[0] for u in uniforms])
    expected = torch.searchsorted(cdf, ((1 - uniforms) * cdf[-1]).clamp(max=cdf[-1]))
    assert bool((probs[tokens] > 0).all())
    differ = tokens != expected
    bound = cdf[expected] - probs[expected]  # the lower bound of the expected token's interval
    near = torch.minimum((1 - uniforms) - bound, cdf[expected] - (1 - uniforms)).abs() < 1e-5
    assert bool((~differ | near).all()) and int(differ.sum()) <= 3
    assert int(tokens[-3]) == int(probs.nonzero().max())  # u = 0: the last token with mass
    assert int(tokens[-2]) == int(probs.nonzero().min())  # u just below 1: the first


def test_a_huge_temperature_still_draws_only_from_the_top_k():
    """Past float32's largest a temperature rounded every scaled logit to a tie with the k-th, so top-k kept all."""
    from gptforge.model.sampling import Sampling, sample_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1000, generator=g)
    top = set(torch.topk(logits[0], 5).indices.tolist())
    for temperature in (1e39, float("inf")):
        uniforms = torch.rand(200, generator=g, dtype=torch.float64)
        tokens = {int(sample_rows(logits, [Sampling(temperature, top_k=5)], u[None])) for u in uniforms}
        assert tokens == top  # all five, as at a temperature that makes them equally likely
