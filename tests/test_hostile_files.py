"""Hostile model files end in one line naming the file and the field, in bounded time and memory.

Every case is built here: GGUF files byte by byte (an independent writer of the GGUF v3 layout, so
the header fields can lie), HF directories and layered checkpoints from the tiny random Llama.
They are loaded (or converted) in one fresh interpreter (tests/hostile_probe.py) that records
each case's error and the growth of its peak RSS, under an address-space limit and a timeout,
so a missing protection shows as a MemoryError, a hang or a traceback instead of a clear line.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile_probe import run_probe

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ModelLoadError
from deepinfer.core.models.loader import load_model
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.weights.gguf_reader import gguf_spec, iter_gguf_weights, open_gguf

MAX_RSS_GROWTH_MB = 150  # a bounded check costs far less; a missing one costs gigabytes

# --- GGUF v3, written by hand (little-endian): header, KVs, tensor infos, 32-aligned data --------

U8, U32, F32, STRING, ARRAY, U64 = 0, 4, 6, 8, 9, 10
GGML_F32 = 0


def _string(text: str, claimed: int | None = None) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw) if claimed is None else claimed) + raw


def _value(type_id: int, value) -> bytes:
    if type_id == U8:
        return struct.pack("<B", value)
    if type_id == U32:
        return struct.pack("<I", value)
    if type_id == U64:
        return struct.pack("<Q", value)
    if type_id == F32:
        return struct.pack("<f", value)
    if type_id == STRING:  # a str, or (text, the length its header claims)
        return _string(value) if isinstance(value, str) else _string(*value)
    item_type, items, claimed = value  # ARRAY
    body = b"".join(_value(item_type, item) for item in items)
    return struct.pack("<IQ", item_type, len(items) if claimed is None else claimed) + body


def write_gguf(path: Path, kvs: list, tensors: dict[str, np.ndarray], offsets: dict[str, int] | None = None,
               dims: dict[str, tuple] | None = None, kv_count: int | None = None) -> Path:
    """kvs: [(key, type, value)]; tensors: name -> float32 array (HF orientation); `offsets` and
    `dims` override what the tensor infos say, `kv_count` what the header says."""
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs) if kv_count is None else kv_count)
    header += b"".join(_string(key) + struct.pack("<I", type_id) + _value(type_id, value)
                       for key, type_id, value in kvs)
    data, infos = b"", b""
    for name, array in tensors.items():
        offset = len(data)
        data += array.astype(np.float32).tobytes()
        data += b"\0" * (-len(data) % 32)
        shape = (dims or {}).get(name, tuple(reversed(array.shape)))  # GGUF: innermost dimension first
        infos += _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        infos += struct.pack("<IQ", GGML_F32, (offsets or {}).get(name, offset))
    blob = header + infos
    path.write_bytes(blob + b"\0" * (-len(blob) % 32) + data)
    return path


def tiny_gguf_model(**meta) -> tuple[list, dict[str, np.ndarray]]:
    """A one-layer Llama (vocab 32, hidden 8, 2 heads of 4, FFN 16) as GGUF metadata and tensors."""
    values = {"block_count": 1, "context_length": 64, "embedding_length": 8, "feed_forward_length": 16,
              "attention.head_count": 2, "attention.head_count_kv": 2, "rope.freq_base": 10000.0,
              "attention.layer_norm_rms_epsilon": 1e-5, **meta}
    kvs = [("general.architecture", STRING, "llama")]
    for key, value in values.items():
        kvs.append((f"llama.{key}", F32 if isinstance(value, float) else U32 if value < 2**32 else U64, value))
    kvs.append(("tokenizer.ggml.tokens", ARRAY, (STRING, [f"t{i}" for i in range(32)], None)))
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (32, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.ffn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (8, 8),
              "blk.0.attn_v.weight": (8, 8), "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    return kvs, {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def test_the_hand_written_gguf_is_a_valid_model(tmp_path):
    """The reference point of the GGUF cases: untouched, the file reads and its weights load."""
    path = write_gguf(tmp_path / "ok.gguf", *tiny_gguf_model())
    reader = open_gguf(path)
    spec = gguf_spec(reader)
    weights = dict(iter_gguf_weights(reader, spec))
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (1, 8, 32)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (8, 16)


# --- the cases -------------------------------------------------------------------------------------

def _load(path: Path) -> str:
    return f"load_model(EngineConfig(model={str(path)!r}), 'cpu', torch.float32)"


def _convert(src: Path, out: Path) -> str:
    return f"convert_checkpoint({str(src)!r}, {str(out)!r})"


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".", 1)
            data[outer][inner] = value
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _build_cases(root: Path, llama_dir: Path, layered_dir: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (code to run, substrings its one-line error must hold)."""
    cases: dict[str, tuple[str, list[str]]] = {}

    def gguf(name: str, expected: list[str], *, meta=None, offsets=None, dims=None, kv_count=None, kvs_edit=None,
             convert=False):
        kvs, tensors = tiny_gguf_model(**(meta or {}))
        if kvs_edit:
            kvs = kvs_edit(kvs)
        path = write_gguf(root / f"{name}.gguf", kvs, tensors, offsets, dims, kv_count)
        code = _convert(path, root / f"{name}-out") if convert else _load(path)
        cases[name] = (code, [path.name, *expected])

    gguf("gguf_block_count_1e9", ["llama.block_count is 1000000000", "[1, 1024]"], meta={"block_count": 10**9})
    gguf("gguf_convert_block_count_1e9", ["llama.block_count is 1000000000"], meta={"block_count": 10**9},
         convert=True)
    gguf("gguf_context_length_2_32", ["llama.context_length is 4294967295"], meta={"context_length": 2**32 - 1})
    gguf("gguf_head_count_0", ["llama.attention.head_count is 0"], meta={"attention.head_count": 0})
    gguf("gguf_rope_theta_negative", ["llama.rope.freq_base is -1.0"], meta={"rope.freq_base": -1.0})
    gguf("gguf_more_layers_than_tensors", ["llama.block_count is 40", "tensors of 1 layers"],
         meta={"block_count": 40})
    gguf("gguf_hidden_larger_than_tensors", ["model expects"], meta={"embedding_length": 512})
    gguf("gguf_tensor_overlap", ["attn_k.weight' overlap (bytes"], offsets={"blk.0.attn_k.weight": 32 * 8 * 4 + 32})
    # data start + offset wraps past 2**64 to a small number: gguf-py's uint64 sum lands inside the file.
    gguf("gguf_offset_wraps_uint64", ["truncated", "attn_v"], offsets={"blk.0.attn_v.weight": 2**64 - 512})
    gguf("gguf_offset_misaligned", ["not a multiple of the alignment"], offsets={"blk.0.attn_v.weight": 4})
    gguf("gguf_five_dims", ["5 dimensions"], dims={"output_norm.weight": (1, 1, 1, 1, 8)})
    gguf("gguf_kv_count_2_60", ["KV count"], kv_count=2**60)

    def claim_tokens(count: int):
        return lambda kvs: [(k, t, (STRING, v[1], count) if k == "tokenizer.ggml.tokens" else v) for k, t, v in kvs]

    gguf("gguf_array_claims_2_40_strings", ["tokenizer.ggml.tokens claims 1099511627776 items"],
         kvs_edit=claim_tokens(2**40))
    gguf("gguf_array_claims_past_the_end", ["strings of tokenizer.ggml.tokens needs"],
         kvs_edit=claim_tokens(3_000_000))
    gguf("gguf_uint8_array_claims_past_the_end", ["1000000 items of general.huge needs"],
         kvs_edit=lambda kvs: [*kvs, ("general.huge", ARRAY, (U8, [1, 2, 3], 1_000_000))])
    gguf("gguf_string_claims_2_62_bytes", ["string in general.name needs 4611686018427387904 bytes"],
         kvs_edit=lambda kvs: [*kvs, ("general.name", STRING, ("tiny", 2**62))])
    (root / "gguf_symlink_to_dev_zero").mkdir()
    os.symlink("/dev/zero", root / "gguf_symlink_to_dev_zero" / "model.gguf")
    cases["gguf_symlink_to_dev_zero"] = (_load(root / "gguf_symlink_to_dev_zero"),
                                         ["model.gguf", "link out of the model directory", "(to /dev/zero)"])

    def hf(name: str, expected: list[str], convert: bool = False, **config) -> Path:
        directory = _copy(llama_dir, root / name)
        if config:
            _edit_json(directory / "config.json", **config)
        cases[name] = (_convert(directory, root / f"{name}-out") if convert else _load(directory),
                       [name, *expected])
        return directory

    hf("hf_layers_1e9", ["config.json: num_hidden_layers is 1000000000"], num_hidden_layers=10**9)
    hf("hf_convert_layers_1e9", ["num_hidden_layers is 1000000000"], convert=True, num_hidden_layers=10**9)
    hf("hf_positions_1e8", ["max_position_embeddings is 100000000"], max_position_embeddings=10**8)
    hf("hf_positions_0", ["max_position_embeddings is 0"], max_position_embeddings=0)
    hf("hf_rope_factor_0", ["rope_parameters.factor is 0"], **{"rope_parameters.factor": 0})
    hf("hf_rope_theta_negative", ["rope_parameters.rope_theta is -1"], **{"rope_parameters.rope_theta": -1})
    hf("hf_heads_0", ["num_attention_heads is 0"], num_attention_heads=0)
    hf("hf_layers_as_string", ["num_hidden_layers is '3'"], num_hidden_layers="3")
    hf("hf_model_larger_than_its_weights", ["model expects"], hidden_size=16384, intermediate_size=65536)
    directory = hf("hf_generation_config_eos", ["generation_config.json: eos_token_id is 'x'"])
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))

    def index_to(name: str, target: str) -> None:
        directory = _copy(llama_dir, root / name)
        weight_map = {key: target for key in ("model.embed_tokens.weight", "model.norm.weight")}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        cases[name] = (_load(directory), ["model.safetensors.index.json: weight_map", repr(target),
                                          "leaves the model directory"])

    index_to("hf_index_dotdot", "../../etc/passwd")
    index_to("hf_index_absolute", "/etc/passwd")
    directory = _copy(llama_dir, root / "hf_weights_link_out")
    outside = root / "outside.safetensors"
    shutil.move(directory / "model.safetensors", outside)
    os.symlink(outside, directory / "model.safetensors")
    cases["hf_weights_link_out"] = (_load(directory), ["model.safetensors", "link out of the model directory"])
    directory = _copy(llama_dir, root / "hf_tokenizer_config_fifo")
    (directory / "tokenizer_config.json").unlink()
    os.mkfifo(directory / "tokenizer_config.json")  # opening it for reading blocks forever
    cases["hf_tokenizer_config_fifo"] = (_load(directory), ["tokenizer_config.json", "not a regular file (a FIFO)"])
    directory = _copy(llama_dir, root / "hf_tokenizer_dev_zero")
    (directory / "tokenizer.json").unlink()
    os.symlink("/dev/zero", directory / "tokenizer.json")
    cases["hf_tokenizer_dev_zero"] = (_load(directory), ["tokenizer.json", "(to /dev/zero)"])

    def layered(name: str, expected: list[str], damage) -> None:
        directory = _copy(layered_dir, root / name)
        damage(directory)
        cases[name] = (_load(directory), expected)

    layer = "layers/layer_00001.safetensors"

    def to_dev_zero(d: Path) -> None:
        (d / layer).unlink()
        os.symlink("/dev/zero", d / layer)

    def sparse_4gib(d: Path) -> None:
        with open(d / layer, "r+b") as handle:
            handle.truncate(4 << 30)  # a hole: no disk, but 4 GiB to read and hash

    def manifest_edit(edit):
        def damage(d: Path) -> None:
            manifest = json.loads((d / "manifest.json").read_text())
            edit(manifest)
            (d / "manifest.json").write_text(json.dumps(manifest))
        return damage

    def rename_entry(old: str, new: str):
        return manifest_edit(lambda m: m["files"].__setitem__(new, m["files"].pop(old)))

    def link_out(d: Path) -> None:
        shutil.move(d / layer, root / "outside_layer.safetensors")
        os.symlink(root / "outside_layer.safetensors", d / layer)

    def tamper(file: str):
        def damage(d: Path) -> None:
            with open(d / file, "a") as handle:
                handle.write("{{ 'tampered' }}" if file.endswith(".jinja") else " ")
        return damage

    def to_fifo(d: Path) -> None:
        (d / layer).unlink()
        os.mkfifo(d / layer)

    layered("layered_layer_dev_zero", [layer, "link out of the model directory", "(to /dev/zero)"], to_dev_zero)
    layered("layered_layer_fifo", [layer, "not a regular file (a FIFO)"], to_fifo)
    layered("layered_sparse_4gib_layer", [layer, "it has 4294967296 bytes", "does not match the manifest"],
            sparse_4gib)
    layered("layered_layer_link_out", [layer, "link out of the model directory"], link_out)
    layered("layered_tampered_chat_template", ["chat_template.jinja", "does not match the manifest"],
            tamper("chat_template.jinja"))
    layered("layered_tampered_tokenizer", ["tokenizer.json", "does not match the manifest"], tamper("tokenizer.json"))
    layered("layered_tampered_generation_config", ["generation_config.json", "does not match the manifest"],
            tamper("generation_config.json"))
    layered("layered_unlisted_template", ["chat_template.jinja", "not listed in manifest.json"],
            manifest_edit(lambda m: m["files"].pop("chat_template.jinja")))
    layered("layered_manifest_dotdot", ["manifest.json: files", "'../../etc/passwd'", "leaves the model directory"],
            rename_entry("tokenizer.json", "../../etc/passwd"))
    layered("layered_manifest_absolute", ["'/etc/passwd'", "leaves the model directory"],
            rename_entry("tokenizer.json", "/etc/passwd"))
    layered("layered_num_layers_1e9", ["num_layers is 1000000000"], manifest_edit(lambda m: m.update(num_layers=10**9)))
    return cases


SETUP = """
import torch
from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ModelLoadError
from deepinfer.core.models.loader import load_model
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.chat_template import ChatTemplate
load_model(EngineConfig(model={warmup!r}), 'cpu', torch.float32)  # imports and first-load costs
"""


@pytest.fixture(scope="module")
def layered_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    out = tmp_path_factory.mktemp("hostile_layered") / "llama-layered"
    convert_checkpoint(tiny_llama_dir, out)
    assert (out / "generation_config.json").is_file() and (out / "chat_template.jinja").is_file()
    return out


@pytest.fixture(scope="module")
def probe(tmp_path_factory, tiny_llama_dir, layered_dir):
    root = tmp_path_factory.mktemp("hostile")
    cases = _build_cases(root, tiny_llama_dir, layered_dir)
    results = run_probe(SETUP.format(warmup=str(layered_dir)), {name: code for name, (code, _) in cases.items()})
    return cases, results


CASE_NAMES = [
    "gguf_block_count_1e9", "gguf_convert_block_count_1e9", "gguf_context_length_2_32", "gguf_head_count_0",
    "gguf_rope_theta_negative", "gguf_more_layers_than_tensors", "gguf_hidden_larger_than_tensors",
    "gguf_tensor_overlap", "gguf_offset_wraps_uint64", "gguf_offset_misaligned", "gguf_five_dims",
    "gguf_kv_count_2_60", "gguf_array_claims_2_40_strings", "gguf_array_claims_past_the_end",
    "gguf_uint8_array_claims_past_the_end", "gguf_string_claims_2_62_bytes", "gguf_symlink_to_dev_zero",
    "hf_layers_1e9", "hf_convert_layers_1e9", "hf_positions_1e8", "hf_positions_0", "hf_rope_factor_0",
    "hf_rope_theta_negative", "hf_heads_0", "hf_layers_as_string", "hf_model_larger_than_its_weights",
    "hf_generation_config_eos", "hf_index_dotdot", "hf_index_absolute", "hf_weights_link_out", "hf_tokenizer_config_fifo",
    "hf_tokenizer_dev_zero",
    "layered_layer_dev_zero", "layered_layer_fifo", "layered_sparse_4gib_layer", "layered_layer_link_out",
    "layered_tampered_chat_template", "layered_tampered_tokenizer", "layered_tampered_generation_config",
    "layered_unlisted_template", "layered_manifest_dotdot", "layered_manifest_absolute", "layered_num_layers_1e9",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_hostile_file_is_one_clear_line_in_bounded_memory(probe, name):
    cases, results = probe
    _, expected = cases[name]
    result = results[name]
    assert result["error"] is not None, f"{name} loaded"
    assert "ModelLoadError" in result["classes"], f"{name}: {result['error']}: {result['message']}"
    assert "\n" not in result["message"]
    for part in expected:
        assert part in result["message"], f"{name}: {part!r} not in {result['message']!r}"
    assert result["rss_growth_mb"] < MAX_RSS_GROWTH_MB, f"{name} grew peak RSS by {result['rss_growth_mb']:.0f} MB"


def test_every_case_is_checked(probe):
    cases, _ = probe
    assert sorted(cases) == sorted(CASE_NAMES)


def test_an_hf_cache_snapshot_loads_through_its_blob_links(tmp_path, tiny_llama_dir):
    """Confinement allows the HF cache layout: snapshots/<rev>/* are links to ../../blobs/*."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(tiny_llama_dir.iterdir())):
        shutil.copyfile(file, repo / "blobs" / f"blob{index}")
        os.symlink(f"../../blobs/blob{index}", snapshot / file.name)
    loaded = load_model(EngineConfig(model=str(snapshot)), "cpu", torch.float32)
    reference = load_model(EngineConfig(model=str(tiny_llama_dir)), "cpu", torch.float32)
    assert loaded.tokenizer.encode("The capital of France") == reference.tokenizer.encode("The capital of France")
    assert torch.equal(loaded.model.model.embed_tokens.weight, reference.model.model.embed_tokens.weight)


def test_a_gguf_the_user_names_through_their_own_link_loads(tmp_path, smollm2_gguf):
    """A link the user names is their choice and is followed; inside a model directory a link out is refused."""
    (tmp_path / "mine").mkdir()
    named = tmp_path / "mine" / "model.gguf"
    os.symlink(smollm2_gguf, named)
    loaded = load_model(EngineConfig(model=str(named)), "cpu", torch.float32)
    assert loaded.spec.num_layers == 30
    with pytest.raises(ModelLoadError, match="link out of the model directory"):
        load_model(EngineConfig(model=str(tmp_path / "mine")), "cpu", torch.float32)  # the directory's member
