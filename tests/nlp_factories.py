"""Offline NLP fixtures: AG-News-format CSVs and a tiny random DistilBERT save with its
tokenizer."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np

AG_NEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Words that make each class recognisable, so a few optimizer steps can lower the loss.
_CLASS_WORDS = (
    ("minister", "election", "embassy", "talks", "troops", "parliament"),
    ("match", "goal", "season", "coach", "league", "striker"),
    ("shares", "profit", "market", "merger", "investors", "bank"),
    ("software", "chip", "internet", "robot", "researchers", "browser"),
)
_COMMON_WORDS = ("the", "a", "on", "in", "says", "after", "new", "report", "week", "monday")


def _sentence(rng: np.random.Generator, label: int, length: int) -> str:
    words = [
        str(rng.choice(_CLASS_WORDS[label]))
        if rng.random() < 0.5
        else str(rng.choice(_COMMON_WORDS))
        for _ in range(length)
    ]
    return " ".join(words)


def agnews_rows(per_class: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(class index "1".."4", title, description) rows; titles hold commas and double quotes."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(per_class):
        for label in range(4):
            title = f'{_sentence(rng, label, 3).capitalize()}, "{_sentence(rng, label, 2)}"'
            description = f"{_sentence(rng, label, int(rng.integers(4, 14)))}, {k} reports."
            rows.append((str(label + 1), title, description))
    return rows


def write_agnews_csv(path: Path, rows: list[tuple[str, str, str]], header: bool = False) -> Path:
    """The official layout: every field quoted, no header unless asked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        if header:
            writer.writerow(("Class Index", "Title", "Description"))
        writer.writerows(rows)
    return path


def write_agnews_dir(
    data_dir: Path, train_per_class: int = 8, test_per_class: int = 3, header: bool = False
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """data_dir/train.csv and data_dir/test.csv; returns their rows."""
    train = agnews_rows(train_per_class, seed=1)
    test = agnews_rows(test_per_class, seed=2)
    write_agnews_csv(data_dir / "train.csv", train, header=header)
    write_agnews_csv(data_dir / "test.csv", test, header=header)
    return train, test


def build_vocab(texts: list[str]) -> list[str]:
    """A WordPiece vocabulary: special tokens, every lower-cased word and punctuation mark of
    ``texts``, then single characters (and their ``##`` continuations) so nothing is [UNK]."""
    words = sorted({w for text in texts for w in re.findall(r"\w+|[^\w\s]", text.lower())})
    chars = sorted({c for text in texts for c in text.lower() if not c.isspace()})
    vocab = list(SPECIAL_TOKENS)
    for token in [*words, *chars, *(f"##{c}" for c in chars)]:
        if token not in vocab:
            vocab.append(token)
    return vocab


def build_tiny_distilbert(
    model_dir: Path,
    texts: list[str],
    *,
    with_head: bool = True,
    num_labels: int = 4,
    seed: int = 0,
    fast_tokenizer_file: bool = True,
) -> Path:
    """A randomly initialised 2-layer DistilBERT (dim 32) and its tokenizer, saved like a hub model.

    ``with_head=False`` saves a bare DistilBertModel (what a pre-trained checkpoint holds);
    ``fast_tokenizer_file=False`` leaves only vocab.txt (no tokenizer.json).
    """
    import torch
    from transformers import (
        AutoTokenizer,
        DistilBertConfig,
        DistilBertForSequenceClassification,
        DistilBertModel,
    )

    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab(texts)
    config = DistilBertConfig(
        vocab_size=len(vocab),
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        max_position_embeddings=128,
        num_labels=num_labels,  # type: ignore[call-arg]  # a PretrainedConfig keyword
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (
            DistilBertForSequenceClassification(config) if with_head else DistilBertModel(config)
        )
    model.save_pretrained(model_dir)
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer_config = {"do_lower_case": True, "model_max_length": 128}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if fast_tokenizer_file:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        tokenizer.save_pretrained(str(model_dir))
    return model_dir


def make_agnews_fixture(root: Path, header: bool = False, **model_kwargs) -> tuple[Path, Path]:
    """(data_dir, model_dir) under ``root``: AG-News CSVs and a tiny DistilBERT trained on
    nothing."""
    data_dir, model_dir = root / "ag_news", root / "distilbert"
    train, test = write_agnews_dir(data_dir, header=header)
    texts = [f"{title} {description}" for _, title, description in train + test]
    build_tiny_distilbert(model_dir, texts, **model_kwargs)
    return data_dir, model_dir
