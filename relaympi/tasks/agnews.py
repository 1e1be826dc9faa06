"""AG News topic classification by fine-tuning a local DistilBERT save (Hugging Face
transformers)."""

from __future__ import annotations

import contextlib
import csv
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from relaympi.data.paths import fetch_hint
from relaympi.tasks.base import ClassificationTask, TaskDefaults, TaskError, TaskOptions
from relaympi.tasks.defaults import AGNEWS

NUM_CLASSES = 4  # World, Sports, Business, Sci/Tech
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


def model_dir_missing(directory: Path) -> list[str]:
    """What a saved model folder lacks for this task: config, weights, tokenizer ([] when
    complete)."""
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        missing.append("weights (model.safetensors or pytorch_model.bin)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json or vocab.txt)")
    return missing


# Config keys of dropout probabilities across BERT-family configs; all set to 0 (see build_model).
_DROPOUT_KEYS = (
    "dropout",
    "attention_dropout",
    "seq_classif_dropout",
    "qa_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "classifier_dropout",
)
_SAVE_HINT = (
    "save one on a machine with internet: "
    "`AutoModelForSequenceClassification.from_pretrained('distilbert-base-uncased', num_labels=4)"
    ".save_pretrained(DIR)` and `AutoTokenizer.from_pretrained('distilbert-base-uncased')"
    ".save_pretrained(DIR)`"
)
_CSV_HINT = (
    'rows "class index","title","description" with class index 1..4, as in the official '
    "AG News train.csv/test.csv"
)


def _transformers() -> Any:
    """Import transformers with the hub switched off: this task never downloads anything."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise TaskError(
            "task agnews needs Hugging Face transformers: pip install 'relaympi[nlp]'"
        ) from exc
    return transformers


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """Silence load-time notices and progress bars (missing head weights are expected: we
    initialise them), which every rank would otherwise print."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def read_agnews_csv(path: Path) -> tuple[list[str], np.ndarray]:
    """(texts, labels) of one AG News CSV: text = title + " " + description, label = index - 1.

    Fields are CSV-quoted (commas and doubled quotes inside them); a header row is skipped.
    """
    if not path.is_file():
        raise TaskError(
            f"{path} not found; expected {_CSV_HINT}. {fetch_hint('agnews', path.parent)}"
        )
    texts: list[str] = []
    labels: list[int] = []
    with open(path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            if not row:
                continue
            if len(row) != 3:
                raise TaskError(f"{path}:{line}: expected 3 fields ({_CSV_HINT}), got {len(row)}")
            index, title, description = row
            try:
                label = int(index)
            except ValueError:
                if line == 1:  # a header row
                    continue
                raise TaskError(
                    f"{path}:{line}: expected a class index 1..4, got {index!r}"
                ) from None
            if not 1 <= label <= NUM_CLASSES:
                raise TaskError(f"{path}:{line}: expected a class index 1..4, got {label}")
            texts.append(f"{title} {description}")
            labels.append(label - 1)
    if not texts:
        raise TaskError(f"{path} holds no rows; expected {_CSV_HINT}")
    return texts, np.array(labels, dtype=np.int64)


def check_model_dir(model_dir: Path | None) -> Path:
    """``model_dir`` if it holds config.json, weights and a tokenizer; TaskError otherwise."""
    expected = (
        "expected DIR/config.json, weights (DIR/model.safetensors or DIR/pytorch_model.bin) "
        "and a tokenizer (DIR/tokenizer.json or DIR/vocab.txt)"
    )
    if model_dir is None:
        raise TaskError(f"task agnews needs --model-dir DIR; {expected}. {_SAVE_HINT}")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TaskError(
            f"{model_dir} is not a directory; {expected}. "
            f"{fetch_hint('distilbert', model_dir)} Or {_SAVE_HINT}"
        )
    missing = model_dir_missing(model_dir)
    if missing:
        raise TaskError(f"{model_dir} lacks {', '.join(missing)}; {expected}. {_SAVE_HINT}")
    return model_dir


def _data_dir(options: TaskOptions) -> Path:
    if options.data_dir is None:
        raise TaskError(
            f"task agnews needs --data-dir DIR with DIR/train.csv and DIR/test.csv ({_CSV_HINT})"
        )
    return Path(options.data_dir)


class _TokenizedSplit:
    """Token ids of every text, padded to the longest text, plus each text's length."""

    def __init__(self, ids: list[list[int]], labels: np.ndarray, pad_id: int):
        self.lengths = np.array([len(x) for x in ids], dtype=np.int64)
        self.ids = np.full((len(ids), int(self.lengths.max())), pad_id, dtype=np.int32)
        for row, tokens in enumerate(ids):
            self.ids[row, : len(tokens)] = tokens
        self.labels = labels

    def batch(self, indices: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Inputs padded to the longest sequence in the batch (attention_mask marks real tokens)."""
        lengths = self.lengths[indices]
        width = int(lengths.max()) if len(indices) else 0
        input_ids = torch.from_numpy(self.ids[indices, :width].astype(np.int64))
        attention_mask = torch.from_numpy(
            (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        )
        targets = torch.from_numpy(self.labels[indices])
        return {"input_ids": input_ids, "attention_mask": attention_mask}, targets


class AgNewsTask(ClassificationTask):
    """AG News (4 classes) with DistilBERT fine-tuning (paper appendix, "DistilBERT finetuning").

    ``--data-dir`` holds the official ``train.csv`` and ``test.csv``; ``--model-dir`` a local
    ``save_pretrained`` directory (config.json, weights, tokenizer). Texts are tokenized once at
    load (truncated to ``max_length`` tokens); batches are padded to their longest text. Inputs
    are dicts of ``input_ids`` and ``attention_mask``; ``forward`` returns the logits.
    """

    name: ClassVar[str] = "agnews"
    defaults: ClassVar[TaskDefaults] = AGNEWS
    max_length: ClassVar[int] = 128  # tokens per text, including [CLS] and [SEP]

    @classmethod
    def check_data(cls, options: TaskOptions) -> None:
        data_dir = _data_dir(options)
        check_model_dir(options.model_dir)
        for name in ("train.csv", "test.csv"):
            if not (data_dir / name).is_file():
                raise TaskError(
                    f"{data_dir / name} not found; expected {_CSV_HINT}. "
                    f"{fetch_hint('agnews', data_dir)}"
                )

    def __init__(self, options: TaskOptions):
        super().__init__(options)
        data_dir = _data_dir(options)
        self.model_dir = check_model_dir(options.model_dir)
        train_texts, train_labels = read_agnews_csv(data_dir / "train.csv")
        test_texts, test_labels = read_agnews_csv(data_dir / "test.csv")
        self.tokenizer = self._load_tokenizer()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._train = _TokenizedSplit(self._tokenize(train_texts), train_labels, pad_id)
        self._test = _TokenizedSplit(self._tokenize(test_texts), test_labels, pad_id)

    def _load_tokenizer(self) -> Any:
        transformers = _transformers()
        try:
            with _quiet_transformers(transformers):
                return transformers.AutoTokenizer.from_pretrained(
                    str(self.model_dir), local_files_only=True
                )
        except (OSError, ValueError) as exc:
            raise TaskError(f"cannot load a tokenizer from {self.model_dir}: {exc}") from exc

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        encoded = self.tokenizer(
            texts,
            truncation=True,
            max_length=self.max_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return encoded["input_ids"]

    @property
    def num_classes(self) -> int:
        return NUM_CLASSES

    @property
    def train_labels(self) -> np.ndarray:
        return self._train.labels

    @property
    def test_labels(self) -> np.ndarray:
        return self._test.labels

    @property
    def train_lengths(self) -> np.ndarray:
        """Tokens per training text (after truncation), in index order."""
        return self._train.lengths

    def build_model(self, seed: int) -> nn.Module:
        """The pre-trained encoder from ``model_dir`` with a fresh 4-way head drawn from ``seed``.

        The classification head (``pre_classifier`` and ``classifier`` for DistilBERT) is always
        re-initialised, N(0, initializer_range) weights and zero biases, from a generator seeded
        with ``seed``, whether or not the save holds one. All dropout probabilities are set to 0,
        so a step is a deterministic function of the weights and the batch (the paper's runs used
        the default 0.1; with dropout on, masks would come from torch's global RNG). The global
        RNG is left untouched.
        """
        transformers = _transformers()
        directory = str(self.model_dir)
        try:
            with _quiet_transformers(transformers), torch.random.fork_rng(devices=[]):
                config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
                config.num_labels = NUM_CLASSES
                for key in _DROPOUT_KEYS:
                    if isinstance(getattr(config, key, None), float):
                        setattr(config, key, 0.0)
                model = transformers.AutoModelForSequenceClassification.from_pretrained(
                    directory, config=config, local_files_only=True, ignore_mismatched_sizes=True
                )
        except (OSError, ValueError) as exc:
            raise TaskError(f"cannot load a model from {self.model_dir}: {exc}") from exc
        model = model.float()
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        self._init_head(model, seed)
        model.train()
        return model

    @staticmethod
    def _init_head(model: nn.Module, seed: int) -> None:
        found = [getattr(model, name, None) for name in ("pre_classifier", "classifier")]
        head = [layer for layer in found if isinstance(layer, nn.Linear)]
        if not head:
            raise TaskError(f"{type(model).__name__} has no linear 'classifier' head to initialise")
        std = float(getattr(model.config, "initializer_range", 0.02))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in head:
                weight = torch.empty(layer.weight.shape).normal_(0.0, std, generator=generator)
                layer.weight.copy_(weight)
                if layer.bias is not None:
                    layer.bias.zero_()

    def train_batch(
        self, indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self._train.batch(np.asarray(indices, dtype=np.int64))

    def test_batches(
        self, batch_size: int
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        count = len(self._test.labels)
        for start in range(0, count, batch_size):
            yield self._test.batch(np.arange(start, min(start + batch_size, count)))

    def forward(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits [batch, 4]; inputs move to the model's device if they are not there yet."""
        device = next(model.parameters()).device
        return model(
            input_ids=inputs["input_ids"].to(device, non_blocking=True),
            attention_mask=inputs["attention_mask"].to(device, non_blocking=True),
        ).logits


def distilbert_parameter_count(num_labels: int = NUM_CLASSES) -> int:
    """Parameters of distilbert-base (the default DistilBertConfig) with a ``num_labels`` head,
    counted on a model built on the meta device (no weights allocated, nothing downloaded)."""
    transformers = _transformers()
    config = transformers.DistilBertConfig(num_labels=num_labels)
    with torch.device("meta"):
        model = transformers.DistilBertForSequenceClassification(config)
    return sum(p.numel() for p in model.parameters())
