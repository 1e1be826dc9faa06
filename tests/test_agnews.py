"""AG News task: CSV parsing, tokenization and an offline tiny DistilBERT."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from relaympi.tasks import TaskError, TaskOptions, get_task_class  # noqa: E402
from relaympi.tasks.agnews import AgNewsTask, read_agnews_csv  # noqa: E402
from relaympi.tasks.defaults import default_topology_for  # noqa: E402
from tests.nlp_factories import agnews_rows, make_agnews_fixture, write_agnews_csv  # noqa: E402


@pytest.fixture(scope="module")
def fixture_dirs(tmp_path_factory) -> tuple[Path, Path]:
    return make_agnews_fixture(tmp_path_factory.mktemp("agnews"))


@pytest.fixture(scope="module")
def task(fixture_dirs) -> AgNewsTask:
    data_dir, model_dir = fixture_dirs
    return AgNewsTask(TaskOptions(data_dir=data_dir, model_dir=model_dir))


def test_registry_and_defaults():
    cls = get_task_class("agnews")
    assert cls is AgNewsTask and cls.name == "agnews"
    d = cls.defaults
    assert (d.epochs, d.batch_size, d.optimizer, d.weight_decay, d.metric) == (
        5,
        32,
        "adam",
        0.0,
        "mean",
    )
    assert d.milestones == () and d.warmup_epochs == 0
    assert d.lr == 3e-5
    assert d.lr_by_algo == {"allreduce": 3e-5, "relay": 9e-4, "dpsgd": 1e-6, "qgm": 1e-6}
    assert default_topology_for("agnews", "relay") == "chain"


def test_csv_parsing_with_quotes_commas_and_header(tmp_path):
    rows = [
        (
            "3",
            'Wall St. Bears Claw Back, "Into the Black"',
            "Short-sellers, Wall Street's dwindling band.",
        ),
        ("1", "Talks, end", 'He said: "no, never"'),
    ]
    plain = write_agnews_csv(tmp_path / "plain.csv", rows)
    headed = write_agnews_csv(tmp_path / "headed.csv", rows, header=True)
    assert plain.read_text().startswith('"3","Wall St. Bears Claw Back, ""Into the Black""",')
    for path in (plain, headed):
        texts, labels = read_agnews_csv(path)
        assert texts == [
            'Wall St. Bears Claw Back, "Into the Black" Short-sellers, Wall Street\'s '
            "dwindling band.",
            'Talks, end He said: "no, never"',
        ]
        assert labels.tolist() == [2, 0] and labels.dtype == np.int64


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('"5","t","d"\n', r"bad.csv:1: expected a class index 1..4, got 5"),
        ('"1","t","d"\n"x","t","d"\n', r"bad.csv:2: expected a class index 1..4, got 'x'"),
        ('"1","t"\n', r"bad.csv:1: expected 3 fields .*, got 2"),
        ("", r"bad.csv holds no rows"),
    ],
)
def test_csv_errors(tmp_path, content, message):
    (tmp_path / "bad.csv").write_text(content)
    with pytest.raises(TaskError, match=message):
        read_agnews_csv(tmp_path / "bad.csv")


@pytest.mark.slow
def test_loads_labels_and_tokens(task, fixture_dirs):
    train_rows = agnews_rows(8, seed=1)
    assert task.num_classes == 4
    assert task.train_labels.tolist() == [int(r[0]) - 1 for r in train_rows]
    assert set(task.test_labels.tolist()) == {0, 1, 2, 3}
    first = f"{train_rows[0][1]} {train_rows[0][2]}"
    want = task.tokenizer(first)["input_ids"]
    assert want[0] == task.tokenizer.cls_token_id and want[-1] == task.tokenizer.sep_token_id
    assert task.train_lengths[0] == len(want)
    inputs, targets = task.train_batch(np.array([0, 5, 2]), np.random.default_rng(0))
    assert inputs["input_ids"][0, : len(want)].tolist() == want
    width = int(task.train_lengths[[0, 5, 2]].max())
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (3, width)
    assert inputs["attention_mask"].sum(dim=1).tolist() == task.train_lengths[[0, 5, 2]].tolist()
    assert (
        inputs["input_ids"].dtype == torch.int64
        and targets.tolist() == task.train_labels[[0, 5, 2]].tolist()
    )


def test_truncation_to_max_length(fixture_dirs):
    data_dir, model_dir = fixture_dirs

    class Short(AgNewsTask):
        max_length = 8

    task = Short(TaskOptions(data_dir=data_dir, model_dir=model_dir))
    assert task.train_lengths.max() == 8
    inputs, _ = task.train_batch(np.arange(4), np.random.default_rng(0))
    assert inputs["input_ids"].shape == (4, 8)
    assert (inputs["input_ids"][:, -1] == task.tokenizer.sep_token_id).all()


def test_test_batches_cover_test_set_in_order(task):
    batches = list(task.test_batches(5))
    assert [len(t) for _, t in batches] == [5, 5, 2]
    assert torch.cat([t for _, t in batches]).tolist() == task.test_labels.tolist()


def test_missing_inputs_name_what_is_expected(tmp_path, fixture_dirs):
    data_dir, model_dir = fixture_dirs
    with pytest.raises(TaskError, match="needs --data-dir DIR with DIR/train.csv and DIR/test.csv"):
        AgNewsTask(TaskOptions(model_dir=model_dir))
    with pytest.raises(
        TaskError, match=r"needs --model-dir DIR; expected DIR/config.json.*save_pretrained"
    ):
        AgNewsTask(TaskOptions(data_dir=data_dir))
    with pytest.raises(TaskError, match="is not a directory"):
        AgNewsTask(TaskOptions(data_dir=data_dir, model_dir=tmp_path / "distilbert-base-uncased"))
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(model_dir / "config.json", partial)
    with pytest.raises(
        TaskError, match=r"lacks weights .*, a tokenizer \(tokenizer.json or vocab.txt\)"
    ):
        AgNewsTask(TaskOptions(data_dir=data_dir, model_dir=partial))
    with pytest.raises(TaskError, match=r"train.csv not found; expected rows \"class index\""):
        AgNewsTask(TaskOptions(data_dir=tmp_path, model_dir=model_dir))


def test_model_offline_forward_and_seeding(task, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    state = torch.random.get_rng_state()
    model = task.build_model(seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    same, other = task.build_model(seed=7), task.build_model(seed=8)
    named = dict(model.named_parameters())
    for name, p in same.named_parameters():
        assert torch.equal(named[name], p), name
    differing = {n for n, p in other.named_parameters() if not torch.equal(named[n], p)}
    assert differing == {"pre_classifier.weight", "classifier.weight"}  # encoder is pre-trained
    inputs, _ = task.train_batch(np.arange(6), np.random.default_rng(0))
    logits = task.forward(model, inputs)
    assert logits.shape == (6, 4)
    assert model.training and torch.equal(logits, task.forward(model, inputs))  # no dropout noise


def test_two_label_save_gets_a_four_way_head(tmp_path):
    data_dir, model_dir = make_agnews_fixture(tmp_path, num_labels=2)
    task = AgNewsTask(TaskOptions(data_dir=data_dir, model_dir=model_dir))
    inputs, _ = task.train_batch(np.arange(3), np.random.default_rng(0))
    assert task.forward(task.build_model(seed=0), inputs).shape == (3, 4)


def test_bare_encoder_save_and_vocab_only_tokenizer(tmp_path):
    data_dir, model_dir = make_agnews_fixture(
        tmp_path, header=True, with_head=False, fast_tokenizer_file=False
    )
    assert not (model_dir / "tokenizer.json").exists()
    task = AgNewsTask(TaskOptions(data_dir=data_dir, model_dir=model_dir))
    assert len(task.train_labels) == 32
    inputs, _ = task.train_batch(np.arange(3), np.random.default_rng(0))
    assert task.forward(task.build_model(seed=0), inputs).shape == (3, 4)


def test_adam_steps_reduce_the_loss(task):
    model = task.build_model(seed=0)
    inputs, targets = task.train_batch(np.arange(len(task.train_labels)), np.random.default_rng(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    with torch.no_grad():
        before = task.loss(task.forward(model, inputs), targets).item()
    for _ in range(20):
        optimizer.zero_grad()
        task.loss(task.forward(model, inputs), targets).backward()
        optimizer.step()
    with torch.no_grad():
        after = task.loss(task.forward(model, inputs), targets).item()
    assert after < 0.5 * before


def test_no_hub_access_configured(task):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
