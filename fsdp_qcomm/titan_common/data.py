"""Offline training data for the torchtitan recipes: a text corpus and a BPE tokenizer.

Nothing is downloaded. The built-in corpus ("pystdlib") is the English prose every Python
installation carries: the docstrings of the standard library's modules, classes and functions
plus the language-reference topics of ``pydoc_data.topics`` (about 2 MB of text on CPython 3.11).
A byte-level BPE tokenizer (``tokenizers`` package) is trained on its training split. Both are
built once and cached under :func:`cache_dir` (``$FSDP_QCOMM_CACHE``, else
``$XDG_CACHE_HOME/fsdp_qcomm``, else ``~/.cache/fsdp_qcomm``); concurrent builders (the ranks of
one job, or several jobs) serialize on a file lock and publish with an atomic rename.

How torchtitan finds them (both versions; the adapters call :func:`resolve_hf_assets_path` and
:func:`register_datasets`):

* tokenizer: the HF assets path (0.2.2: ``[model] hf_assets_path``; 0.3: ``--hf_assets_path``)
  names a directory holding ``tokenizer.json`` and ``tokenizer_config.json`` (the latter names
  ``bos_token``/``eos_token``). The special value ``"fsdp_qcomm:pystdlib_bpe<N>"`` (e.g.
  ``fsdp_qcomm:pystdlib_bpe8192``) means "the cached tokenizer with vocabulary N, built if
  missing". Any real directory works as usual.
* data: the dataset name (0.2.2: ``[training] dataset``; 0.3: ``--dataloader.dataset``) picks
  an entry of torchtitan's dataset table (``torchtitan.hf_datasets.text_datasets.DATASETS``,
  the same in both versions), to which :func:`register_datasets` adds:

  - ``pystdlib`` / ``pystdlib_val``: the built-in corpus (train / held-out split, ~10% of
    the modules, all cut into ~2 KB pieces at paragraph breaks);
    ``dataset_path`` may point to another JSONL file to use instead.
  - ``text``: local plain-text files; ``dataset_path`` is a file, a directory (all ``*.txt``
    below it) or a glob. One sample per paragraph (blank-line separated), so that even a
    single file splits across data-parallel ranks.
  - ``jsonl``: local JSON-lines files with a ``"text"`` field; ``dataset_path`` as above
    (``*.jsonl``/``*.json``).
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Iterator

CORPUS_VERSION = 1
TOKENIZER_VERSION = 1
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
ASSETS_PREFIX = "fsdp_qcomm:"
_TOKENIZER_MARKER = re.compile(r"^fsdp_qcomm:pystdlib_bpe(\d+)$")
_CORPUS_MARKER = "fsdp_qcomm:pystdlib"

# Folders of the standard library that hold tests, demos, vendored wheels or third-party code.
_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip",
    "turtledemo", "__pycache__",
}
_VAL_MODULUS = 10  # sources whose crc32 % 10 == 0 form the held-out split (~10%)
_MAX_DOC_CHARS = 2048  # documents are cut at paragraph breaks into pieces of about this size


# --------------------------------------------------------------------------- cache location
def cache_dir() -> Path:
    """Root of everything this module builds (overridable with ``$FSDP_QCOMM_CACHE``)."""
    env = os.environ.get("FSDP_QCOMM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fsdp_qcomm"


def corpus_dir() -> Path:
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir() / f"pystdlib-{py}-v{CORPUS_VERSION}"


def tokenizer_dir(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    return corpus_dir().with_name(
        corpus_dir().name + f"-bpe{vocab_size}-v{TOKENIZER_VERSION}"
    )


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished build into place (a directory rename)."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
    os.replace(tmp, final)


# --------------------------------------------------------------------------- the corpus
def iter_stdlib_documents() -> Iterator[tuple[str, str]]:
    """Yield ``(source, text)`` pairs in a deterministic order.

    One document per standard-library module (all its docstrings, blank-line separated), then
    one per ``pydoc_data.topics`` entry.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            docs = []
            for node in ast.walk(tree):
                if isinstance(
                    node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
                ):
                    doc = ast.get_docstring(node, clean=True)
                    if doc and len(doc) >= 40:
                        docs.append(doc)
            if docs:
                yield str(path.relative_to(root)), "\n\n".join(docs)
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            yield f"pydoc_data.topics:{key}", text


def _pieces(text: str, limit: int = _MAX_DOC_CHARS) -> Iterator[str]:
    """Cut ``text`` at blank lines into pieces of at most ~``limit`` characters.

    Many small samples shard evenly across data-parallel ranks (torchtitan gives each rank a
    contiguous slice of the samples), which keeps fixed-step validation from running dry.
    """
    piece: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        if piece and size + len(para) > limit:
            yield "\n\n".join(piece)
            piece, size = [], 0
        piece.append(para)
        size += len(para) + 2
    if piece:
        yield "\n\n".join(piece)


def ensure_corpus() -> Path:
    """Build (once) and return the directory holding ``train.jsonl`` and ``val.jsonl``."""
    final = corpus_dir()
    if (final / "meta.json").exists():
        return final
    with _locked(final):
        if (final / "meta.json").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=final.parent))
        counts = {"train": [0, 0], "val": [0, 0]}
        with open(tmp / "train.jsonl", "w", encoding="utf-8") as ftr, open(
            tmp / "val.jsonl", "w", encoding="utf-8"
        ) as fval:
            for source, text in iter_stdlib_documents():
                split = "val" if zlib.crc32(source.encode()) % _VAL_MODULUS == 0 else "train"
                for piece in _pieces(text):
                    (fval if split == "val" else ftr).write(
                        json.dumps({"text": piece, "source": source}, ensure_ascii=False) + "\n"
                    )
                    counts[split][0] += 1
                    counts[split][1] += len(piece)
        meta = {
            "corpus": "pystdlib",
            "version": CORPUS_VERSION,
            "python": sys.version,
            "stdlib": sysconfig.get_paths()["stdlib"],
            "documents": {k: v[0] for k, v in counts.items()},
            "characters": {k: v[1] for k, v in counts.items()},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _publish(tmp, final)
    return final


def _iter_jsonl_text(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


# --------------------------------------------------------------------------- the tokenizer
def ensure_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Build (once) and return a torchtitan ``hf_assets_path`` directory for a BPE tokenizer."""
    if not 256 + 2 < vocab_size <= 65536:
        raise ValueError(f"tokenizer vocab_size={vocab_size} must be in (258, 65536]")
    final = tokenizer_dir(vocab_size)
    if (final / "tokenizer.json").exists():
        return final
    corpus = ensure_corpus()
    with _locked(final):
        if (final / "tokenizer.json").exists():
            return final
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS_TOKEN, EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_iter_jsonl_text(corpus / "train.jsonl"), trainer=trainer)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=final.parent))
        tok.save(str(tmp / "tokenizer.json"))
        config = {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": 1 << 20,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "fsdp_qcomm": {
                "corpus": str(corpus),
                "vocab_size": tok.get_vocab_size(),
                "version": TOKENIZER_VERSION,
            },
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        _publish(tmp, final)
    return final


def resolve_hf_assets_path(value: str) -> str:
    """Turn ``fsdp_qcomm:pystdlib_bpe<N>`` into a built directory; pass real paths through."""
    if not value.startswith(ASSETS_PREFIX):
        return value
    m = _TOKENIZER_MARKER.match(value)
    if not m:
        raise ValueError(
            f"unknown built-in tokenizer {value!r}; use 'fsdp_qcomm:pystdlib_bpe<vocab>', "
            "e.g. 'fsdp_qcomm:pystdlib_bpe8192', or a directory holding tokenizer.json"
        )
    return str(ensure_tokenizer(int(m.group(1))))


def tokenizer_vocab_size(hf_assets_path: str) -> int | None:
    """Vocabulary size of the tokenizer at ``hf_assets_path`` (None if it cannot be read)."""
    path = Path(resolve_hf_assets_path(hf_assets_path)) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size()


def check_tokenizer_fits(
    hf_assets_path: str, vocab_size: int, model: str, warn: Callable[[str], None]
) -> None:
    """Refuse a tokenizer with more tokens than the model's embedding has rows (the first
    out-of-range token id would crash, or on GPUs corrupt, the embedding lookup)."""
    try:
        tok_vocab = tokenizer_vocab_size(hf_assets_path)
    except (OSError, ValueError) as e:  # no readable tokenizer: nothing to compare
        warn(f"qcomm: cannot read the tokenizer's vocabulary size: {e}")
        return
    if tok_vocab is not None and tok_vocab > vocab_size:
        raise ValueError(
            f"tokenizer at {hf_assets_path!r} has {tok_vocab} tokens but {model} has "
            f"vocab_size {vocab_size}; use a smaller tokenizer or a flavor with a larger "
            "vocabulary"
        )


# --------------------------------------------------------------------------- datasets
def _files(path: str, patterns: tuple[str, ...]) -> list[str]:
    p = Path(path).expanduser()
    if p.is_file():
        return [str(p)]
    if p.is_dir():
        found = sorted(str(f) for pat in patterns for f in p.rglob(pat) if f.is_file())
    else:
        found = sorted(f for f in glob.glob(str(p), recursive=True) if os.path.isfile(f))
    if not found:
        raise FileNotFoundError(
            f"no data files at {path!r} (a file, a directory holding {'/'.join(patterns)}, "
            "or a glob)"
        )
    return found


def _hf_cache() -> str:
    return str(cache_dir() / "hf_datasets")


def load_jsonl(path: str):
    """A map-style ``datasets.Dataset`` from local JSON-lines files with a ``text`` field."""
    from datasets import load_dataset

    files = _files(path, ("*.jsonl", "*.json"))
    return load_dataset("json", data_files=files, split="train", cache_dir=_hf_cache())


def load_text(path: str):
    """A map-style ``datasets.Dataset`` from local text files, one sample per paragraph."""
    from datasets import load_dataset

    files = _files(path, ("*.txt",))
    return load_dataset(
        "text", data_files=files, split="train", sample_by="paragraph", cache_dir=_hf_cache()
    )


def _load_pystdlib(path: str, split: str):
    if path == _CORPUS_MARKER:
        path = str(ensure_corpus() / f"{split}.jsonl")
    return load_jsonl(path)


def _text_field(sample: dict) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add our entries to torchtitan's dataset table (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig, text_datasets

    def _needs_path(name: str):
        def loader(path: str):
            raise ValueError(
                f"dataset {name!r} needs a dataset path (got {path!r}): torchtitan 0.2.2 "
                "--training.dataset_path, torchtitan 0.3 --dataloader.dataset_path"
            )

        return loader

    table = text_datasets.DATASETS
    table["pystdlib"] = DatasetConfig(
        path=_CORPUS_MARKER,
        loader=lambda path: _load_pystdlib(path, "train"),
        sample_processor=_text_field,
    )
    table["pystdlib_val"] = DatasetConfig(
        path=_CORPUS_MARKER,
        loader=lambda path: _load_pystdlib(path, "val"),
        sample_processor=_text_field,
    )
    table["text"] = DatasetConfig(
        path="",
        loader=lambda path: load_text(path) if path else _needs_path("text")(path),
        sample_processor=_text_field,
    )
    table["jsonl"] = DatasetConfig(
        path="",
        loader=lambda path: load_jsonl(path) if path else _needs_path("jsonl")(path),
        sample_processor=_text_field,
    )


def clear_cache() -> None:  # pragma: no cover - convenience for users
    shutil.rmtree(cache_dir(), ignore_errors=True)


if __name__ == "__main__":  # python -m fsdp_qcomm.titan_common.data [vocab_size]
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_VOCAB_SIZE
    print("corpus   ", ensure_corpus())
    print("tokenizer", ensure_tokenizer(vocab))
    print(json.loads((corpus_dir() / "meta.json").read_text()))
