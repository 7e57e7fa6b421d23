"""Learn while reading (faast/hf/reading.py): each chunk of a stream is scored with the memory of the chunks before it,
then learned; the state is what learn() gives on the same windows, stays fixed-size, and the model reads it after."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from faast.hf import FaastConfig, MiddleLayers, ResidualOutput, apply_faast, chunk_windows, read_stream
from faast.hf.reading import ReadReport
from hf_models import VOCAB, tiny_model
from tolerances import ELEMENTWISE, rel

CHUNK = 48
# Sums of the same float32 products over windows batched differently (learn() pads and batches them, the stream reads
# one window a pass): the float32 activations differ in their last bits.
STATE_REL = 1e-6


def phrase_stream(length: int, seed: int, noise: float = 0.2) -> torch.Tensor:
    """A repeated random phrase of 23 tokens, a share `noise` of them replaced at random: a stream whose earlier
    chunks predict its later ones."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (23,), generator=g)
    text = phrase.repeat(length // 23 + 1)[:length]
    swap = torch.rand(length, generator=g) < noise
    return torch.where(swap, torch.randint(3, VOCAB, (length,), generator=g), text)


def fresh(config: FaastConfig | None = None):
    return apply_faast(tiny_model("llama"), config or FaastConfig())


def learned_state(model) -> dict[str, torch.Tensor]:
    layer = model.output_memory_layer
    memory = layer.memory
    return {"gram": memory.gram.clone(), "cross": memory.cross.clone(), "count": memory.count.clone(),
            "fisher": layer.curvature.gram.clone(), "mass": layer.token_mass.probability.clone(),
            "gradient": layer.gradient_sum.gradient.clone(),
            "gradient count": layer.gradient_sum.count.clone()}  # fmt: skip


def window_nll(model, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The NLL [end - start - 1] float64 of ids[start + 1:end] under the model's own forward pass on the window."""
    with torch.no_grad():
        logits = model(input_ids=ids[None, start:end]).logits[0, :-1].float()
    return -logits.log_softmax(-1).gather(-1, ids[start + 1 : end, None]).squeeze(-1).double()


def test_chunk_windows_predict_every_pair_once():
    for n, chunk in [(2, 2), (10, 3), (96, 32), (97, 32), (1000, 48)]:
        windows = chunk_windows(n, chunk)
        predicted = [j for start, end in windows for j in range(start + 1, end)]
        assert predicted == list(range(1, n))
        assert all(end - start <= chunk + 1 for start, end in windows)
        assert windows[0][0] == 0 and all(s == i * chunk - 1 for i, (s, _) in enumerate(windows) if i)


def test_reading_improves_a_repetitive_stream_and_the_first_chunk_is_the_base_model():
    ids = phrase_stream(720, seed=3)
    model = fresh()
    report = model.read_stream(ids, chunk=CHUNK)
    with model.disable_faast():
        base = torch.cat([window_nll(model, ids, s, e) for s, e in chunk_windows(ids.numel(), CHUNK)])
    assert report.tokens == [e - max(s, 0) - 1 for s, e in chunk_windows(ids.numel(), CHUNK)]
    assert report.token_nll.shape == (ids.numel() - 1,)
    atol, rtol = ELEMENTWISE[torch.float32]
    torch.testing.assert_close(report.token_nll[: CHUNK - 1], base[: CHUNK - 1], atol=atol, rtol=rtol)
    zero_shot = float(base[CHUNK - 1 :].mean().exp())
    assert report.perplexity() < 0.5 * zero_shot
    assert report.steps[1] == 0.0 and max(report.steps) > 0.0  # off until tuned on a chunk it had not seen


def test_score_of_a_chunk_is_unchanged_whatever_the_later_chunks_contain():
    ids = phrase_stream(480, seed=5)
    t = 5
    changed = ids.clone()
    g = torch.Generator().manual_seed(9)
    changed[t * CHUNK :] = torch.randint(3, VOCAB, (ids.numel() - t * CHUNK,), generator=g)
    a, b = fresh().read_stream(ids, chunk=CHUNK), fresh().read_stream(changed, chunk=CHUNK)
    before = sum(a.tokens[:t])
    assert torch.equal(a.token_nll[:before], b.token_nll[:before])
    assert (a.steps[: t + 1], a.weights[: t + 1], a.key_widths[: t + 1]) == (
        b.steps[: t + 1], b.weights[: t + 1], b.key_widths[: t + 1])  # fmt: skip
    # Chunk t itself is read with what chunks < t taught: the model that read only them gives the same scores.
    model = fresh()
    model.read_stream(ids[: t * CHUNK], chunk=CHUNK)
    start, end = chunk_windows(ids.numel(), CHUNK)[t]
    atol, rtol = ELEMENTWISE[torch.float32]
    for report, stream in ((a, ids), (b, changed)):
        got = report.token_nll[before : before + report.tokens[t]]
        torch.testing.assert_close(got, window_nll(model, stream, start, end), atol=atol, rtol=rtol)


@pytest.mark.parametrize("key_layers", [[], "auto"])
def test_state_after_reading_equals_learn_on_the_same_windows(key_layers):
    # Reading learns from its scoring pass, at the model's precision and with float32 head products; learn()'s 'auto'
    # pass and head products run in bfloat16 on a CPU that multiplies it natively (AMX, AVX512-BF16), so the two are
    # compared at one precision on every machine.
    output = ResidualOutput(key_layers=key_layers, head_dtype="float32")
    config = FaastConfig(output=output, learn_dtype="model")
    ids = phrase_stream(500, seed=7)
    reader, learner = fresh(config), fresh(config)
    reader.read_stream(ids, chunk=CHUNK)
    learner.learn([ids[s:e].tolist() for s, e in chunk_windows(ids.numel(), CHUNK)], max_length=CHUNK + 1)
    got, want = learned_state(reader), learned_state(learner)
    assert float(got["count"]) == float(want["count"]) == float(got["gradient count"]) == ids.numel() - 1
    for name in ("gram", "cross", "fisher", "mass", "gradient"):
        assert rel(got[name], want[name]) < STATE_REL, name
    assert reader.fast_weight_bytes() == learner.fast_weight_bytes()


class _Work(TorchDispatchMode):
    """Counts every aten op and the elements it writes: the work of what runs inside, independent of a clock."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.ops[str(func)] += 1
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.elements += value.numel()
        return out


@pytest.mark.parametrize("step", [0.05, "auto"])
def test_update_work_and_state_size_do_not_grow_with_the_position(step):
    config = FaastConfig(output=ResidualOutput(key_layers=[], step=step))
    model = fresh(config)
    ids = phrase_stream(12 * CHUNK, seed=11)
    per_chunk, sizes = [], []
    work = _Work()

    def mark(t: int, report: ReadReport) -> None:
        per_chunk.append((Counter(work.ops), work.elements))
        sizes.append(model.fast_weight_bytes())

    with work:
        model.read_stream(ids, chunk=CHUNK, on_chunk=mark)
    deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(per_chunk, per_chunk[1:], strict=False)]
    assert len(set(sizes)) == 1  # the learned state is the same size after every chunk
    steady = deltas[1:-1]  # chunk 1 onwards reads a memory; the last chunk is shorter
    if step == "auto":
        # The step's search takes a data-dependent number of passes (each over at most STREAM_TUNE_ROWS positions):
        # with it, the work per chunk stays within the bound of a full search, never a function of the position.
        assert max(e for _, e in steady) <= 2 * min(e for _, e in steady)
    else:
        assert all(ops == steady[0][0] and elements == steady[0][1] for ops, elements in steady)


def test_generation_after_reading_uses_the_memory_and_reads_like_the_stream():
    ids = phrase_stream(600, seed=13)
    model = fresh()
    report = model.read_stream(ids, chunk=CHUNK)
    layer = model.output_memory_layer
    assert report.step > 0.0
    assert (layer.chosen_step(), layer.chosen_weight(), layer.chosen_key_width()) == (
        report.step, report.weight, report.key_width)  # fmt: skip
    prompt = ids[None, -30:]
    out = model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False)
    with model.disable_faast():
        base = model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False)
        base_logits = model(input_ids=prompt).logits
    assert not torch.equal(model(input_ids=prompt).logits, base_logits)
    assert out.shape == base.shape


def test_read_stream_function_and_a_named_memory_leave_the_default_alone():
    ids = phrase_stream(300, seed=17)
    model = fresh()
    before = learned_state(model)
    report = read_stream(model, ids.tolist(), chunk=CHUNK, memory="book")
    assert isinstance(report, ReadReport) and "book" in model.memories
    assert all(torch.equal(v, before[k]) for k, v in learned_state(model).items())
    with pytest.raises(TypeError, match="model"):
        read_stream(tiny_model("llama"), ids, chunk=CHUNK)


def test_text_stream_is_tokenised_like_learn():
    class Chars:
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    text = "the quick brown fox jumps over the lazy dog. " * 8
    a, b = fresh(), fresh()
    a.read_stream(text, tokenizer=Chars(), chunk=CHUNK)
    b.read_stream(torch.tensor(Chars()(text)["input_ids"]), chunk=CHUNK)
    assert all(torch.equal(v, learned_state(b)[k]) for k, v in learned_state(a).items())


BAD_INPUTS = [
    ({"stream": []}, ValueError, "stream: nothing to read"),
    ({"stream": torch.tensor([5])}, ValueError, "stream: nothing to read"),
    ({"stream": torch.zeros(0, dtype=torch.long)}, ValueError, "stream: nothing to read"),
    ({"stream": "", "tokenizer": lambda text, add_special_tokens: {"input_ids": []}}, ValueError, "stream: nothing"),
    ({"stream": "some text"}, ValueError, "tokenizer: required"),
    ({"stream": None}, TypeError, "stream: expected a text"),
    ({"stream": {"input_ids": [1, 2, 3]}}, TypeError, "stream: expected a text"),
    ({"stream": [1, 2, "3"]}, TypeError, "stream: expected a list of int"),
    ({"stream": [1, 2, 3.0]}, TypeError, "stream: expected a list of int"),
    ({"stream": torch.rand(50)}, TypeError, "stream: expected integer token ids"),
    ({"stream": torch.ones(2, 50, dtype=torch.long)}, ValueError, r"stream: expected token ids of shape \[N\]"),
    ({"stream": [1, 2, VOCAB]}, ValueError, "stream: token ids must lie in"),
    ({"chunk": 1}, ValueError, "chunk: expected an int >= 2"),
    ({"chunk": 0}, ValueError, "chunk: expected an int >= 2"),
    ({"chunk": True}, ValueError, "chunk: expected an int >= 2"),
    ({"chunk": 32.0}, ValueError, "chunk: expected an int >= 2"),
    ({"chunk": 128}, ValueError, "chunk: 128 \\+ 1 tokens .* context window of 128"),
    ({"memory": ""}, ValueError, "memory"),
    ({"on_chunk": 3}, TypeError, "on_chunk"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_INPUTS)
def test_bad_input_raises_naming_it_and_leaves_the_model_unchanged(options, error, message):
    model = fresh()
    model.learn([phrase_stream(200, seed=1).tolist()], max_length=100)
    before, memories = learned_state(model), list(model.memories)
    tail = model.output_memory_layer.held_out_positions()
    options = {"stream": phrase_stream(200, seed=2), "chunk": CHUNK, **options}
    with pytest.raises(error, match=message):
        model.read_stream(**options)
    assert all(torch.equal(v, before[k]) for k, v in learned_state(model).items())
    assert model.memories == memories and model.output_memory_layer.held_out_positions() == tail


def test_an_error_part_way_leaves_the_memory_as_it_was():
    model = fresh()
    model.learn([phrase_stream(200, seed=1).tolist()], max_length=100)
    before, tail = learned_state(model), model.output_memory_layer.held_out_positions()

    def stop(t: int, report: ReadReport) -> None:
        if t == 3:
            raise KeyboardInterrupt

    for memory in ("default", "new"):
        with pytest.raises(KeyboardInterrupt):
            model.read_stream(phrase_stream(400, seed=2), chunk=CHUNK, on_chunk=stop, memory=memory)
        assert all(torch.equal(v, before[k]) for k, v in learned_state(model).items())
        assert model.output_memory_layer.held_out_positions() == tail
    assert model.memories == ["default"]


def test_middle_layers_are_refused():
    model = fresh(FaastConfig(middle=MiddleLayers(num_layers=2)))
    with pytest.raises(ValueError, match="residual output layer alone"):
        model.read_stream(phrase_stream(100, seed=1), chunk=CHUNK)


def test_what_was_read_saves_and_loads_back_reading_the_same(tmp_path):
    from faast.hf import from_pretrained

    ids = phrase_stream(600, seed=19)
    model = fresh()
    report = model.read_stream(ids, chunk=CHUNK)
    prompt = ids[None, -40:]
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
    model.save_pretrained(tmp_path / "read")
    again = from_pretrained(tiny_model("llama"), tmp_path / "read")
    assert again.output_memory_layer.chosen_step() == report.step
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=prompt).logits, logits, atol=0, rtol=0)
