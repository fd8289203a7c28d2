"""IncrementalDetokenizer against the tokenizer's own full decode (SmolLM2's byte-level BPE)."""

import pytest

from deepinfer.core.engine.frontend.detokenizer import IncrementalDetokenizer
from deepinfer.core.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from deepinfer.core.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).hf_tokenizer


def stream(tokenizer, token_ids, params, prompt="Write something:"):
    """Feeds token_ids until finished; returns (deltas, last step, detokenizer)."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params, {tokenizer.eos_token_id})
    deltas = []
    for token_id in token_ids:
        step = detok.append(token_id)
        deltas.append(step.delta_text)
        if step.finished:
            break
    return deltas, step, detok


@pytest.mark.parametrize(
    "text",
    [
        "Héllo wörld, naïve café — Ångström",
        "你好世界！这是一个测试。日本語もテスト",
        "Party 🎉🎉 time 👩‍👩‍👧 and 🇫🇷 flags",
        " leading space and\nnew lines\t tabs",
    ],
)
def test_streamed_deltas_join_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.startswith(" leading")
    deltas, step, detok = stream(tokenizer, ids, SamplingParams(max_tokens=len(ids)))
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == detok.text
    assert (step.finished, step.finish_reason, step.stop_reason) == (True, "length", None)
    assert detok.num_tokens == len(ids)


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The quick brown fox jumps over the lazy dog.", "umps ov", "The quick brown fox j"),
        ("The quick brown fox jumps over the lazy dog.", "lazy dog", "The quick brown fox jumps over the "),
        ("你好世界，再见世界", "世界", "你好"),
        ("Ok, stop at the very start", "Ok, st", ""),
    ],
)
def test_stop_string_split_across_tokens_never_leaks(tokenizer, text, stop, expected):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # the stop string spans tokens
    deltas, step, detok = stream(tokenizer, ids, SamplingParams(max_tokens=100, stop=["never here", stop]))
    assert "".join(deltas) == expected == detok.text
    assert (step.finished, step.finish_reason, step.stop_reason) == (True, "stop", stop)
    with pytest.raises(RuntimeError, match="after finish"):
        detok.append(ids[0])


def test_earliest_stop_string_wins_and_unresolved_prefix_is_released(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    _, step, detok = stream(tokenizer, ids, SamplingParams(max_tokens=100, stop=["four", "two"]))
    assert (detok.text, step.stop_reason) == ("one ", "two")
    # The token " three" completes all three at once; the one that starts first wins.
    _, step, detok = stream(tokenizer, ids, SamplingParams(max_tokens=100, stop=["ree", "thr", "hree"]))
    assert (detok.text, step.stop_reason) == ("one two ", "thr")
    # "thr" could start the stop string "three!", so it is held until the request ends by length.
    ids = tokenizer.encode("one two thr", add_special_tokens=False)
    deltas, step, detok = stream(tokenizer, ids, SamplingParams(max_tokens=len(ids), stop=["three!"]))
    assert not "".join(deltas[:-1]).endswith("thr")
    assert "".join(deltas) == "one two thr"
    assert step.finish_reason == "length"


def test_stop_token_and_eos_finish_without_their_text(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    params = SamplingParams(max_tokens=100, stop_token_ids=[ids[2]], skip_special_tokens=False)
    _, step, detok = stream(tokenizer, ids, params)
    assert detok.text == tokenizer.decode(ids[:2])
    assert (step.finish_reason, step.stop_reason) == ("stop", ids[2])
    assert detok.num_tokens == 3  # the stop token was taken; nothing after it

    eos = tokenizer.eos_token_id
    with_eos = ids[:2] + [eos] + ids[2:]
    _, step, detok = stream(tokenizer, with_eos, SamplingParams(max_tokens=100, skip_special_tokens=False))
    assert (detok.text, step.finish_reason, step.stop_reason) == (tokenizer.decode(ids[:2]), "stop", None)

    ignoring = SamplingParams(max_tokens=len(with_eos), ignore_eos=True, skip_special_tokens=False)
    _, step, detok = stream(tokenizer, with_eos, ignoring)
    assert detok.text == tokenizer.decode(with_eos) and tokenizer.eos_token in detok.text
    assert step.finish_reason == "length"


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi there", add_special_tokens=False)
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert special in ids
    for skip in (True, False):
        _, _, detok = stream(tokenizer, ids, SamplingParams(max_tokens=len(ids), skip_special_tokens=skip))
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
        assert ("<|im_start|>" in detok.text) is not skip


def test_first_token_keeps_leading_space_from_prompt_context():
    """A SentencePiece-style decoder drops a leading space at the start of what it decodes."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.decode([1]) == "world"  # what decoding the new token alone would give
    detok = IncrementalDetokenizer(tokenizer, [0], SamplingParams(max_tokens=2), set())
    assert [detok.append(1).delta_text, detok.append(2).delta_text] == [" world", "!"]


def test_byte_tokenizer_of_dummy_models_streams_whole_characters():
    from deepinfer.core.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer(vocab_size=300)
    text = "héllo 🎉 世界 stop here"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(max_tokens=100, stop=[" stop"]), set())
    deltas = [detok.append(i).delta_text for i in ids[: text.encode().index(b" here")]]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == "héllo 🎉 世界" == detok.text
    assert detok.finish_reason == "stop"


DECODERS = ("byte_level_tables", "library_stream", "python_window")


def _forced_decoder(module, tokenizer, context, skip_special_tokens, kind):
    backend = tokenizer.backend_tokenizer
    if kind == "byte_level_tables":
        return module._ByteLevelDecoder(module._byte_level_table(backend, skip_special_tokens))
    if kind == "library_stream":
        return module._StreamDecoder(backend, list(context), skip_special_tokens)
    return module._WindowDecoder(tokenizer, list(context), skip_special_tokens)


@pytest.mark.parametrize("finish", ["length", "stop_token"])
def test_byte_level_tables_and_library_stream_give_the_python_windows_deltas(tokenizer, finish):
    """The byte-level tables, the tokenizers-library stream and the Python window yield the same deltas,
    token for token, including an output that ends mid-character (its partial text is flushed either way)."""
    from deepinfer.core.engine.frontend import detokenizer as module

    text = "Party 🎉🎉 time 👩‍👩‍👧 and 你好世界, done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if "\ufffd" in tokenizer.decode(ids[:i + 1]))  # mid-character
    stop_id = tokenizer.eos_token_id
    ids = ids[:cut + 1] + [stop_id] if finish == "stop_token" else ids[:cut + 1]
    params = SamplingParams(max_tokens=len(ids) if finish == "length" else 100)
    runs = []
    for kind in DECODERS:
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params, {stop_id})
        if kind == DECODERS[0]:
            assert isinstance(detok._decoder, module._ByteLevelDecoder)  # SmolLM2 is byte-level BPE
        detok._decoder = _forced_decoder(module, tokenizer, [1, 2, 3], params.skip_special_tokens, kind)
        runs.append([detok.append(i).delta_text for i in ids])
    assert runs[0] == runs[1] == runs[2]
    assert "".join(runs[0]).endswith("\ufffd")  # the incomplete character's partial text came out


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_tables_equal_the_library_stream_on_random_ids(tokenizer, skip_special_tokens):
    """Random outputs of partial-character pieces, special tokens, whole words and ids past the vocabulary
    (a model's padded rows): every delta and the final flush equal the library stream's and the window's."""
    import random

    from deepinfer.core.engine.frontend import detokenizer as module

    table = module._byte_level_table(tokenizer.backend_tokenizer, skip_special_tokens)
    partial = [i for i, text in enumerate(table.texts) if text is None][:400]
    assert len(partial) > 100  # the vocabulary spells multi-byte characters in pieces
    pool = partial + list(range(17)) + list(range(17, 49152, 97)) + [49152, 50000]
    rng = random.Random(0)
    for _ in range(100):
        context = [rng.randrange(17, 49152) for _ in range(rng.randrange(0, 6))]
        if tokenizer.backend_tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            continue
        output = [rng.choice(pool) for _ in range(32)]
        runs = []
        for kind in DECODERS:
            decoder = _forced_decoder(module, tokenizer, context, skip_special_tokens, kind)
            runs.append([decoder.next(t) for t in output] + [decoder.flush()])
        assert runs[0] == runs[1] == runs[2], (context, output)


def test_library_stream_equals_the_python_window_on_random_ids(tiny_tokenizer):
    """Random prompt contexts and outputs (many end mid-character): every delta and the final flush
    agree, whichever decoder the detokenizer picks for the context."""
    import random

    from deepinfer.core.engine.frontend import detokenizer as module

    rng = random.Random(0)
    picked_stream = 0
    for _ in range(200):
        context = [rng.randrange(3, 340) for _ in range(rng.randrange(0, 7))]
        output = [rng.randrange(3, 340) for _ in range(24)]
        chosen = module._stream_decoder(tiny_tokenizer, list(context), True) or module._WindowDecoder(
            tiny_tokenizer, list(context), True)
        window = module._WindowDecoder(tiny_tokenizer, list(context), True)
        picked_stream += isinstance(chosen, (module._ByteLevelDecoder, module._StreamDecoder))
        assert [chosen.next(t) for t in output] + [chosen.flush()] == [window.next(t) for t in output] + [
            window.flush()], context
    assert picked_stream > 100  # most contexts end on a whole character and take the library's stream


def _wrapped(backend, clean_up: bool):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=clean_up)


def test_a_clean_up_flag_that_decode_ignores_keeps_the_byte_level_tables(tokenizer):
    """transformers 5 keeps clean_up_tokenization_spaces=True from a config (Llama 3's) but does not apply it
    to a BPE tokenizer: the detokenizer still takes the tables, and its deltas join to HF's own decode."""
    from deepinfer.core.engine.frontend import detokenizer as module

    flagged = _wrapped(tokenizer.backend_tokenizer, clean_up=True)
    ids = flagged.encode("Don't stop , it 's fine . Really ?", add_special_tokens=False)
    if flagged.decode(ids) != flagged.backend_tokenizer.decode(ids):
        pytest.skip("this transformers applies the clean-up to BPE tokenizers")
    detok = IncrementalDetokenizer(flagged, [], SamplingParams(max_tokens=len(ids)), set())
    assert isinstance(detok._decoder, module._ByteLevelDecoder)
    assert "".join(detok.append(i).delta_text for i in ids) == flagged.decode(ids)


def test_a_decode_that_cleans_up_spaces_takes_the_window_that_reproduces_it():
    """A WordPiece tokenizer whose HF decode cleans up spaces (" ." -> "."): the library stream would not,
    so the detokenizer decodes windows through HF, and its deltas join to HF's decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from deepinfer.core.engine.frontend import detokenizer as module

    vocab = {w: i for i, w in enumerate(["[UNK]", "it", "is", "fine", ".", ",", "stop", "?", "!"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(cleanup=False)
    cleaning = _wrapped(backend, clean_up=True)
    ids = cleaning.encode("it is fine , stop . it is ? stop !", add_special_tokens=False)
    assert cleaning.decode(ids) != backend.decode(ids)  # the clean-up changes this text
    detok = IncrementalDetokenizer(cleaning, [], SamplingParams(max_tokens=len(ids)), set())
    assert isinstance(detok._decoder, module._WindowDecoder)
    assert "".join(detok.append(i).delta_text for i in ids) == cleaning.decode(ids)
