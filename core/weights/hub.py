"""Hugging Face Hub ids as model sources: `ORG/NAME`, `ORG/NAME:QUANT` or `ORG/NAME:FILE.gguf`.

`resolve_model(model, revision)` is the one entry point: a path that exists is returned as is (a
local path always wins); a Hub id is fetched through huggingface_hub into the standard HF cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), honouring `HF_HUB_OFFLINE`
and `HF_TOKEN`, and the local snapshot path (a directory, or the chosen .gguf file) is returned.

Only what deepinfer reads is downloaded:
- an HF safetensors repo: config.json, generation_config.json, the tokenizer and chat-template
  files, and the weights: the shards `model.safetensors.index.json` lists, else `model.safetensors`,
  else every top-level `*.safetensors` (so `consolidated.safetensors` beside HF shards is skipped);
- a deepinfer layered checkpoint: manifest.json and the files it lists;
- a GGUF repo: one .gguf file, picked as llama.cpp's `-hf` does: the file named after `:`, else
  the one whose quant tag is given (`:Q4_K_M`), else Q4_K_M when the repo has it, else the first.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from deepinfer.core.errors import ModelLoadError

# huggingface_hub's own rule for repo ids: ORG/NAME of letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.+/-]+))?")
# quantize_config.json / quant_config.json: a GPTQ / AWQ export's quantization, where config.json lacks it
CONFIG_FILES = ("config.json", "generation_config.json", "quantize_config.json", "quant_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
LAYERED_MANIFEST = "manifest.json"
DEFAULT_GGUF_TAG = "Q4_K_M"


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    tag: str | None  # a quant tag (Q4_K_M) or a .gguf file name; None: the repo's default choice


def parse_hub_id(model: str) -> HubRef | None:
    """`ORG/NAME[:TAG]` -> HubRef; None for anything that cannot be a Hub id (`./x`, `/abs`, `a/b/c`)."""
    match = _HUB_ID.fullmatch(model)
    if match is None or ".." in match["repo"] or match["repo"].endswith("."):
        return None
    return HubRef(match["repo"], match["tag"])


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps its cache, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "on", "yes", "true")


def resolve_model(model: str, revision: str | None = None) -> Path:
    """The local path of `model`: itself when it exists, else the cached snapshot of the Hub id `model`.

    A string that is neither an existing path nor a Hub id comes back unchanged as a Path, so the
    loader reports it as a missing path. Raises ModelLoadError (one line) when a Hub id cannot be
    had: unknown repo, gated without a token, not cached while offline or unreachable.
    """
    local = Path(model).expanduser()
    ref = parse_hub_id(model)
    if local.exists() or ref is None:
        return local
    return _HubFetch(ref, revision, hub_cache_dir()).resolve()


def select_weights(files: list[str], ref: HubRef) -> tuple[list[str], str | None, str | None]:
    """What to fetch from a repo whose files are `files`, before any list file is read.

    Returns (files to fetch now, the list file whose entries are fetched next or None, the .gguf
    file the model path points at or None for a directory model).
    """
    top_level = [f for f in files if "/" not in f]
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if ref.tag is None and LAYERED_MANIFEST in top_level and "config.json" in top_level:
        return _present(files, CONFIG_FILES + TOKENIZER_FILES) + [LAYERED_MANIFEST], LAYERED_MANIFEST, None
    has_safetensors = "config.json" in top_level and any(f.endswith(".safetensors") for f in top_level)
    if ref.tag is None and has_safetensors:
        base = _present(files, CONFIG_FILES + TOKENIZER_FILES)
        if SAFETENSORS_INDEX in top_level:
            return base + [SAFETENSORS_INDEX], SAFETENSORS_INDEX, None
        if SAFETENSORS_SINGLE in top_level:
            return base + [SAFETENSORS_SINGLE], None, None
        return base + sorted(f for f in top_level if f.endswith(".safetensors")), None, None
    if ggufs:
        chosen = _choose_gguf(ggufs, ref)
        return [chosen], None, chosen
    if ref.tag is not None:
        raise ModelLoadError(f"{ref.repo_id} has no GGUF files, so ':{ref.tag}' names nothing; "
                             f"use {ref.repo_id} alone")
    raise ModelLoadError(f"{ref.repo_id} holds no weights deepinfer reads "
                         "(config.json + *.safetensors, a deepinfer layered manifest.json, or a .gguf file)")


def listed_files(list_file: Path) -> list[str]:
    """The repo files an index or manifest names: safetensors shards, or a layered checkpoint's files."""
    try:
        data = json.loads(list_file.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {list_file}: {err}") from None
    if list_file.name == SAFETENSORS_INDEX:
        names = list((data.get("weight_map") or {}).values())
    else:
        names = list(data.get("files") or {})
    if not names or not all(isinstance(n, str) for n in names):
        raise ModelLoadError(f"{list_file} lists no files")
    return list(dict.fromkeys(names))


def _present(files: list[str], wanted: tuple[str, ...]) -> list[str]:
    return [name for name in wanted if name in files]


def _quant_tag_matches(path: str, tag: str) -> bool:
    """Whether `path`'s name carries quant tag `tag` (case-insensitive), e.g. `Model-Q4_K_M.gguf`:
    the tag ends the stem or precedes a split suffix (`-00001-of-00002`), after a '-', '.' or '_'."""
    stem = path.rsplit("/", 1)[-1][: -len(".gguf")].lower()
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)
    tag = tag.lower()
    return stem == tag or any(stem.endswith(sep + tag) for sep in "-._")


def _choose_gguf(ggufs: list[str], ref: HubRef) -> str:
    if ref.tag is not None and ref.tag.lower().endswith(".gguf"):
        named = [f for f in ggufs if f == ref.tag or f.rsplit("/", 1)[-1] == ref.tag]
        if not named:
            raise ModelLoadError(f"{ref.repo_id} has no file {ref.tag}; its GGUF files: {', '.join(ggufs)}")
        return named[0]
    tag = ref.tag or DEFAULT_GGUF_TAG
    matching = sorted(f for f in ggufs if _quant_tag_matches(f, tag))
    if not matching:
        if ref.tag is not None:
            raise ModelLoadError(f"{ref.repo_id} has no GGUF file with quant {ref.tag}; "
                                 f"its GGUF files: {', '.join(sorted(ggufs))}")
        matching = sorted(ggufs)
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", matching[0], re.IGNORECASE):
        raise ModelLoadError(f"{ref.repo_id}: {matching[0]} is one part of a split GGUF; deepinfer reads "
                             "single-file GGUFs only (merge it with llama.cpp's gguf-split --merge)")
    return matching[0]


class _HubFetch:
    """One resolution of a Hub id: list the repo's files, choose, download (or find in the cache)."""

    def __init__(self, ref: HubRef, revision: str | None, cache_dir: Path) -> None:
        self.ref, self.revision, self.cache_dir = ref, revision, cache_dir
        self.offline = hub_offline()
        self.unreachable: str | None = None  # why the Hub could not be asked, when it could not

    def resolve(self) -> Path:
        files = self._repo_files()
        wanted, list_file, gguf = select_weights(files, self.ref)
        folder = self._fetch(wanted)
        if list_file is not None:  # the index or manifest names the rest
            wanted += listed_files(folder / list_file)
            folder = self._fetch(wanted)
        missing = [name for name in wanted if not (folder / name).is_file()]
        if missing:
            raise ModelLoadError(f"{self._name()} in {self.cache_dir} is incomplete (missing {', '.join(missing[:3])})"
                                 f"{self._why_not_fetched()}")
        return folder / gguf if gguf else folder

    def _name(self) -> str:
        return self.ref.repo_id + (f"@{self.revision}" if self.revision else "")

    def _why_not_fetched(self) -> str:
        if self.offline:
            return "; HF_HUB_OFFLINE is set, so nothing was downloaded"
        if self.unreachable:
            return f"; the Hub could not be reached ({self.unreachable})"
        return ""

    def _not_available(self) -> ModelLoadError:
        return ModelLoadError(f"{self.ref.repo_id} is not a local path, and {self._name()} is not in the HF cache "
                              f"{self.cache_dir}{self._why_not_fetched()}")

    def _repo_files(self) -> list[str]:
        if not self.offline:
            from huggingface_hub import HfApi

            try:  # one request (model_info is not retried, so a machine without network learns it at once)
                info = HfApi().model_info(self.ref.repo_id, revision=self.revision)
                return sorted(sibling.rfilename for sibling in info.siblings or [])
            except Exception as err:  # noqa: BLE001 - sorted below: the Hub's answers vs no answer at all
                self._raise_hub_answer(err)
                self.unreachable = f"{type(err).__name__}: {_first_line(err)}"
        cached = self._cached_snapshot()
        if cached is None:
            raise self._not_available()
        return sorted(p.relative_to(cached).as_posix() for p in cached.rglob("*") if p.is_file())

    def _cached_snapshot(self) -> Path | None:
        """The snapshot folder of the revision in the cache (refs/<revision>, or a commit hash)."""
        storage = self.cache_dir / ("models--" + self.ref.repo_id.replace("/", "--"))
        revision = self.revision or "main"
        if (storage / "snapshots" / revision).is_dir():
            return storage / "snapshots" / revision
        ref_file = storage / "refs" / revision
        if not ref_file.is_file():
            return None
        snapshot = storage / "snapshots" / ref_file.read_text().strip()
        return snapshot if snapshot.is_dir() else None

    def _fetch(self, names: list[str]) -> Path:
        if self.offline or self.unreachable:
            cached = self._cached_snapshot()
            if cached is None:
                raise self._not_available()
            return cached
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(self.ref.repo_id, revision=self.revision, cache_dir=self.cache_dir,
                                          allow_patterns=names))
        except Exception as err:  # noqa: BLE001 - one line for the user whatever huggingface_hub raised
            self._raise_hub_answer(err)
            raise ModelLoadError(f"cannot download {self._name()} into {self.cache_dir}: "
                                 f"{type(err).__name__}: {_first_line(err)}") from None

    def _raise_hub_answer(self, err: Exception) -> None:
        """Turn the Hub's own refusals (no such repo or revision, gated, no access) into one line."""
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        if isinstance(err, GatedRepoError):
            raise ModelLoadError(f"{self.ref.repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                                 "to a token of that account") from None
        if isinstance(err, RevisionNotFoundError):
            raise ModelLoadError(f"{self.ref.repo_id} has no revision {self.revision!r}") from None
        if isinstance(err, RepositoryNotFoundError):
            raise ModelLoadError(f"{self.ref.repo_id} is neither a local path nor a Hugging Face repo you can read "
                                 "(for a private repo set HF_TOKEN)") from None


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
