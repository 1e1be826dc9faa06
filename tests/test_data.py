"""`python -m relaympi.data`: fetch (from a local HTTP server), check, prepare-imagenet, default
root."""

# Long module: one table of cases per on-disk format, each with its writer

from __future__ import annotations

import hashlib
import http.server
import io
import logging
import subprocess
import tarfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relaympi.commands import data as cli
from relaympi.data import sets
from relaympi.data.manifest import MANIFEST
from relaympi.data.manifest import read as read_manifest
from relaympi.data.sets import AgNews, Cifar10, DistilBert, RemoteFile
from tests.conftest import ROOT, env_for_subprocess, module_command, run_train
from tests.data_factories import write_cifar10_binary
from tests.nlp_factories import write_agnews_dir

ARCHIVE = "cifar-10-binary.tar.gz"


def read(directory: Path) -> dict[str, Any]:
    """The manifest a test expects in ``directory``."""
    manifest = read_manifest(directory)
    assert manifest is not None, f"no manifest in {directory}"
    return manifest


# -- a local HTTP server ---------------------------------------------------------------------


class FileServer:
    """Serves ``files`` (path -> bytes) on 127.0.0.1 with Range support; ``cuts[path]`` lists byte
    counts after which successive requests drop the connection; ``ranges=False`` ignores Range."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.headers: dict[str, dict[str, str]] = {}  # extra response headers per path
        self.cuts: dict[str, list[int]] = {}
        self.ranges = True
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:  # noqa: N802
                server.requests.append((self.path, self.headers.get("Range")))
                path = self.path.split("?", 1)[0]
                body = server.files.get(path)
                if body is None:
                    self.send_error(404)
                    return
                start = 0
                wanted = self.headers.get("Range")
                if wanted and server.ranges:
                    start = int(wanted.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                for key, value in server.headers.get(path, {}).items():
                    self.send_header(key, value)
                self.end_headers()
                if head:
                    return
                cuts = server.cuts.get(self.path)
                if cuts:
                    self.wfile.write(body[start : start + cuts.pop(0)])
                    return  # HTTP/1.0: returning closes the connection mid-file
                self.wfile.write(body[start:])

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def closed_url() -> str:
    """A local URL nothing listens on (a port just bound and released): offline."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def server():
    s = FileServer()
    yield s
    s.close()


def cifar_tarball(tmp_path: Path) -> tuple[bytes, object]:
    """A CIFAR-10-format binary tarball (10 images per batch) and the arrays it holds."""
    src = tmp_path / "cifar-src"
    arrays = write_cifar10_binary(src, n_per_batch=10, seed=4)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(src / "cifar-10-batches-bin", arcname="cifar-10-batches-bin")
    return buffer.getvalue(), arrays


@pytest.fixture
def cifar(tmp_path, server, monkeypatch):
    """The tarball served at /kriz/<ARCHIVE>, with Cifar10 pointed at it (and its md5)."""
    blob, arrays = cifar_tarball(tmp_path)
    server.files[f"/kriz/{ARCHIVE}"] = blob
    md5 = hashlib.md5(blob).hexdigest()
    monkeypatch.setattr(
        Cifar10, "files", (RemoteFile(ARCHIVE, f"{server.url}/kriz/{ARCHIVE}", md5),)
    )
    return blob, arrays


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, caplog):
    monkeypatch.delenv("RELAYMPI_DATA", raising=False)
    monkeypatch.delenv("RELAYMPI_DATA_MIRROR", raising=False)
    caplog.set_level(logging.INFO, logger="relaympi.data")


def run_cli(*args: object) -> int:
    try:
        return cli.main([str(a) for a in args])
    except SystemExit as exc:  # argparse misuse
        return int(exc.code or 0)


def leftovers(root: Path) -> list[str]:
    """Everything under ``root`` except finished sets (partial files, staging folders)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if ".part" in p.name or "partial" in str(p)
    )


# -- fetch ------------------------------------------------------------------------------------


def test_fetch_cifar10_verifies_lays_out_and_is_a_no_op_the_second_time(
    tmp_path, server, cifar, capsys, caplog
):
    from relaympi.tasks.cifar10 import load_cifar10

    root = tmp_path / "root"
    assert run_cli("fetch", "cifar10", "--root", root) == 0
    err = capsys.readouterr().err
    assert ARCHIVE in err and "100%" in err  # the progress bar
    target = root / "cifar10"
    (train_x, train_y), (test_x, test_y) = load_cifar10(target)
    arrays = cifar[1]
    assert np.array_equal(train_x, arrays.train_images) and np.array_equal(
        test_y, arrays.test_labels
    )
    recorded = read(target)
    assert recorded["name"] == "cifar10" and recorded["downloads"] == {
        ARCHIVE: hashlib.md5(cifar[0]).hexdigest()
    }
    assert "cifar-10-batches-bin/data_batch_1.bin" in recorded["files"]
    assert leftovers(root) == [] and not (root / "downloads" / ARCHIVE).exists()
    requests = len(server.requests)
    caplog.clear()
    assert run_cli("fetch", "cifar10", "--root", root) == 0
    assert len(server.requests) == requests and "already present and verified" in caplog.text


def test_wrong_checksum_leaves_nothing_in_place(tmp_path, server, cifar, monkeypatch, capsys):
    monkeypatch.setattr(
        Cifar10, "files", (RemoteFile(ARCHIVE, f"{server.url}/kriz/{ARCHIVE}", "0" * 32),)
    )
    root = tmp_path / "root"
    assert run_cli("fetch", "cifar10", "--root", root) == 1
    err = capsys.readouterr().err
    assert "expected 00000000" in err and "deleted" in err
    assert not (root / "cifar10").exists() and leftovers(root) == []
    assert list((root / "downloads").iterdir()) == []


def test_an_interrupted_download_resumes_in_the_same_run(tmp_path, server, cifar, caplog):
    server.cuts[f"/kriz/{ARCHIVE}"] = [5000]
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 0
    assert [r for _, r in server.requests] == [None, "bytes=5000-"]
    assert "resuming" in caplog.text and (tmp_path / "cifar10" / MANIFEST).is_file()


def test_a_fetch_cut_every_time_resumes_on_the_next_run(tmp_path, server, cifar, capsys):
    server.cuts[f"/kriz/{ARCHIVE}"] = [3000, 3000, 3000]
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 1
    assert "rerun the same command to resume" in capsys.readouterr().err
    part = tmp_path / "downloads" / f"{ARCHIVE}.part"
    assert part.stat().st_size == 9000 and not (tmp_path / "cifar10").exists()
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 0
    assert server.requests[-1][1] == "bytes=9000-" and not part.exists()
    assert (tmp_path / "cifar10" / "cifar-10-batches-bin" / "test_batch.bin").is_file()


def test_a_server_without_ranges_restarts_the_download(tmp_path, server, cifar, caplog):
    server.ranges = False
    server.cuts[f"/kriz/{ARCHIVE}"] = [4000]
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 0
    assert "starting over" in caplog.text and (tmp_path / "cifar10" / MANIFEST).is_file()


def test_a_partial_file_longer_than_the_file_starts_over(tmp_path, server, cifar, caplog):
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / f"{ARCHIVE}.part").write_bytes(b"x" * (len(cifar[0]) + 10))
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 0
    assert "refused to resume" in caplog.text and (tmp_path / "cifar10" / MANIFEST).is_file()


def test_offline_says_where_to_put_the_file_and_uses_it(tmp_path, cifar, monkeypatch, capsys):
    closed = f"{closed_url()}/kriz/{ARCHIVE}"
    monkeypatch.setattr(Cifar10, "files", (RemoteFile(ARCHIVE, closed, Cifar10.files[0].md5),))
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 1
    err = capsys.readouterr().err
    dest = tmp_path / "downloads" / ARCHIVE
    assert "cannot reach" in err and f"save it as {dest}" in err and "login node" in err
    assert not (tmp_path / "cifar10").exists() and leftovers(tmp_path) == []
    dest.write_bytes(cifar[0])  # put there by hand: the next fetch checks and unpacks it
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 0
    assert (tmp_path / "cifar10" / MANIFEST).is_file()
    dest.write_bytes(b"not the archive")
    (tmp_path / "cifar10" / MANIFEST).unlink()
    (tmp_path / "cifar10").rename(tmp_path / "elsewhere")
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 1
    # a hand-placed file is never deleted
    assert "is not the published file" in capsys.readouterr().err and dest.exists()


def test_url_and_mirror_variable(tmp_path, server, cifar, monkeypatch):
    server.files[f"/mirror/cifar10/{ARCHIVE}"] = cifar[0]
    server.files[f"/other/{ARCHIVE}"] = cifar[0]
    monkeypatch.setenv("RELAYMPI_DATA_MIRROR", f"{server.url}/mirror")
    assert run_cli("fetch", "cifar10", "--root", tmp_path / "a") == 0
    assert server.requests[-1][0] == f"/mirror/cifar10/{ARCHIVE}"
    assert (
        run_cli("fetch", "cifar10", "--root", tmp_path / "b", "--url", f"{server.url}/other/") == 0
    )
    assert server.requests[-1][0] == f"/other/{ARCHIVE}"
    assert read(tmp_path / "b" / "cifar10")["source"] == f"{server.url}/other/{ARCHIVE}"


def test_one_fetch_of_a_set_at_a_time(tmp_path, cifar, capsys):
    import fcntl

    with open(tmp_path / ".cifar10.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert run_cli("fetch", "cifar10", "--root", tmp_path) == 1
    assert "another fetch of cifar10 is running" in capsys.readouterr().err
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 0


def test_a_file_url_serves_as_a_mirror(tmp_path, cifar):
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / ARCHIVE).write_bytes(cifar[0])
    assert (
        run_cli(
            "fetch", "cifar10", "--root", tmp_path / "root", "--url", (tmp_path / "mirror").as_uri()
        )
        == 0
    )
    assert (tmp_path / "root" / "cifar10" / MANIFEST).is_file()


def test_fetch_agnews_csvs(tmp_path, server, monkeypatch):
    from relaympi.tasks.agnews import read_agnews_csv

    write_agnews_dir(tmp_path / "src")
    remotes = []
    for name in ("train.csv", "test.csv"):
        blob = (tmp_path / "src" / name).read_bytes()
        server.files[f"/ag_news_csv/{name}"] = blob
        remotes.append(
            RemoteFile(name, f"{server.url}/ag_news_csv/{name}", hashlib.md5(blob).hexdigest())
        )
    monkeypatch.setattr(AgNews, "files", tuple(remotes))
    assert run_cli("fetch", "agnews", "--root", tmp_path / "root") == 0
    texts, labels = read_agnews_csv(tmp_path / "root" / "agnews" / "train.csv")
    assert len(texts) == 32 and set(labels.tolist()) == {0, 1, 2, 3}
    assert (
        read_agnews_csv(tmp_path / "root" / "agnews" / "test.csv")[0]
        == read_agnews_csv(tmp_path / "src" / "test.csv")[0]
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.nlp_factories import build_tiny_distilbert

    path = tmp_path_factory.mktemp("model") / "saved"
    return build_tiny_distilbert(path, ["a tiny vocabulary", "of a few words"], with_head=False)


def test_fetch_distilbert_through_the_hub_call(tmp_path, tiny_model, monkeypatch):
    """The hub call itself (huggingface_hub.snapshot_download) is replaced by a local copy: what
    is tested is the layout, the manifest and the rename around it."""
    import shutil

    calls = []

    def fake_snapshot(repo_id, local_dir, allow_patterns, progress):
        calls.append((repo_id, tuple(allow_patterns)))
        (local_dir / ".cache" / "huggingface").mkdir(parents=True)  # the hub client's resume state
        for name in allow_patterns:
            if (tiny_model / name).exists():
                shutil.copyfile(tiny_model / name, local_dir / name)
        return "c" * 40

    monkeypatch.setattr(sets, "hub_snapshot", fake_snapshot)
    assert run_cli("fetch", "distilbert", "--root", tmp_path) == 0
    target = tmp_path / "distilbert"
    assert calls == [(DistilBert.repo_id, DistilBert.hub_files)]
    assert not (target / ".cache").exists() and "model.safetensors" in read(target)["files"]
    from relaympi.tasks.agnews import check_model_dir

    assert check_model_dir(target) == target
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(target), num_labels=4, local_files_only=True
    )
    assert model.config.num_labels == 4


def serve_hub_repo(server: FileServer, repo_id: str, folder: Path, sha: str = "5" * 40) -> None:
    """The Hugging Face Hub endpoints huggingface_hub's snapshot_download calls, for ``folder``'s
    files at revision ``sha`` (model.safetensors as an LFS file, the rest as git blobs)."""
    import json

    tree = []
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        entry = {"type": "file", "path": path.name, "size": len(data), "oid": blob}
        headers = {"X-Repo-Commit": sha, "ETag": f'"{blob}"'}
        if path.suffix == ".safetensors":
            sha256 = hashlib.sha256(data).hexdigest()
            entry["lfs"] = {"size": len(data), "oid": sha256, "pointerSize": 134}
            headers.update({"X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data))})
        tree.append(entry)
        server.files[f"/{repo_id}/resolve/{sha}/{path.name}"] = data
        server.headers[f"/{repo_id}/resolve/{sha}/{path.name}"] = headers
    info = {"id": repo_id, "sha": sha, "siblings": [{"rfilename": e["path"]} for e in tree]}
    server.files[f"/api/models/{repo_id}/revision/main"] = json.dumps(info).encode()
    server.files[f"/api/models/{repo_id}/tree/{sha}"] = json.dumps(tree).encode()


@pytest.mark.slow
def test_fetch_distilbert_from_a_local_hub(tmp_path, server, tiny_model):
    """End to end through huggingface_hub.snapshot_download, against a local server that answers
    the hub's API (HF_ENDPOINT), in a fresh process as a user runs it."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model, repo)
    (repo / "README.md").write_text("not asked for\n")
    serve_hub_repo(server, DistilBert.repo_id, repo)
    env = {**env_for_subprocess(), "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf-home")}
    # huggingface_hub honours both; other tests leave them set
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    proc = subprocess.run(
        module_command("relaympi.data", "fetch", "distilbert", "--root", tmp_path / "root"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    target = tmp_path / "root" / "distilbert"
    assert sorted(p.name for p in target.iterdir()) == sorted([*DistilBert.hub_files, MANIFEST])
    for name in DistilBert.hub_files:
        assert (target / name).read_bytes() == (tiny_model / name).read_bytes()
    assert read(target)["source"] == f"{server.url}/{DistilBert.repo_id}@{'5' * 40}"
    assert "5 files match the hub's checksums" in proc.stderr
    assert not any("README" in path for path, _ in server.requests)
    served = f"/{DistilBert.repo_id}/resolve/{'5' * 40}/vocab.txt"
    server.files[served] = server.files[served].replace(b"tiny", b"tinY")  # same size, other bytes
    proc = subprocess.run(
        module_command("relaympi.data", "fetch", "distilbert", "--root", tmp_path / "bad"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "vocab.txt has git-sha1" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "bad" / "distilbert").exists()
    env["HF_ENDPOINT"] = offline = closed_url()
    proc = subprocess.run(
        module_command("relaympi.data", "fetch", "distilbert", "--root", tmp_path / "offline"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and f"cannot reach the Hugging Face Hub ({offline})" in proc.stderr
    assert "save_pretrained" in proc.stderr and not (tmp_path / "offline" / "distilbert").exists()


def test_distilbert_offline_says_how_to_save_it_by_hand(tmp_path, monkeypatch, capsys):
    def offline(repo_id, local_dir, allow_patterns, progress):
        raise sets.OfflineError(f"cannot reach the Hugging Face Hub for {repo_id}")

    monkeypatch.setattr(sets, "hub_snapshot", offline)
    assert run_cli("fetch", "distilbert", "--root", tmp_path) == 1
    err = capsys.readouterr().err
    assert "save_pretrained" in err and str(tmp_path / "distilbert") in err and "HF_ENDPOINT" in err
    assert (
        not (tmp_path / "distilbert").exists() and not (tmp_path / ".distilbert.partial").exists()
    )


def test_fetch_distilbert_from_a_file_mirror(tmp_path, server, tiny_model, monkeypatch):
    for path in tiny_model.iterdir():
        server.files[f"/mirror/distilbert/{path.name}"] = path.read_bytes()
    monkeypatch.setenv("RELAYMPI_DATA_MIRROR", f"{server.url}/mirror")
    assert run_cli("fetch", "distilbert", "--root", tmp_path) == 0
    target = tmp_path / "distilbert"
    for name in DistilBert.hub_files:
        assert (target / name).read_bytes() == (tiny_model / name).read_bytes()
    assert not list((tmp_path / "downloads").iterdir())


# -- check ------------------------------------------------------------------------------------


def test_check_reports_verified_corrupt_unverified_and_missing(tmp_path, server, cifar, capsys):
    root = tmp_path / "root"
    assert run_cli("fetch", "cifar10", "--root", root) == 0
    capsys.readouterr()
    assert run_cli("check", "cifar10", "--root", root) == 0
    out = capsys.readouterr().out
    assert f"data root: {root}" in out and "verified" in out
    batch = root / "cifar10" / "cifar-10-batches-bin" / "data_batch_2.bin"
    data = bytearray(batch.read_bytes())
    data[100] ^= 1  # same size, other bytes
    batch.write_bytes(bytes(data))
    assert run_cli("check", "cifar10", "--root", root) == 1
    assert "corrupt" in capsys.readouterr().out
    assert run_cli("check", "cifar10", "--root", root, "--quick") == 0  # sizes only
    capsys.readouterr()
    assert run_cli("check", "agnews", "--root", root) == 1  # a task: its CSVs and its model
    out = capsys.readouterr().out
    assert "agnews      missing" in out and "distilbert  missing" in out
    assert f"python -m relaympi.data fetch distilbert --root {root}" in out
    assert run_cli("check", "--root", root) == 0  # no names: a report, not a test
    assert "imagenet" in capsys.readouterr().out
    # a fetch repairs a set it wrote itself
    assert run_cli("fetch", "cifar10", "--root", root) == 0
    assert run_cli("check", "cifar10", "--root", root) == 0


def test_a_set_placed_by_hand_is_unverified_and_never_replaced(tmp_path, server, cifar, capsys):
    write_cifar10_binary(tmp_path / "cifar10", n_per_batch=2)
    assert run_cli("check", "cifar10", "--root", tmp_path) == 1
    assert "unverified" in capsys.readouterr().out
    assert run_cli("fetch", "cifar10", "--root", tmp_path) == 1
    assert "move it away" in capsys.readouterr().err
    (tmp_path / "cifar10" / "cifar-10-batches-bin" / "test_batch.bin").unlink()
    assert run_cli("check", "cifar10", "--root", tmp_path) == 1
    assert "incomplete" in capsys.readouterr().out


def test_default_root_comes_from_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RELAYMPI_DATA", str(tmp_path / "env root"))
    assert run_cli("check", "cifar10") == 1
    assert f"data root: {tmp_path / 'env root'}" in capsys.readouterr().out
    monkeypatch.delenv("RELAYMPI_DATA")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert run_cli("check", "cifar10") == 1
    assert f"data root: {tmp_path / 'home' / '.cache' / 'relaympi'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["fetch"],
        ["fetch", "imagenet", "cifar10"],
        ["fetch", "mnist"],
        ["check", "mnist"],
        ["prepare-imagenet", "--train", "x"],
        [
            "prepare-imagenet",
            "--train",
            "/nonexistent",
            "--val",
            "/nonexistent",
            "--devkit",
            "/nonexistent",
        ],
        ["prepare-imagenet", "--train", "a", "--val", "b", "--devkit", "c", "--link", "--move"],
        [],
    ],
)
def test_misuse_exits_2(tmp_path, args):
    assert run_cli(*args, *(["--root", tmp_path] if args else [])) == 2


# -- the trainer's default root ---------------------------------------------------------------


def train(tmp_path: Path, data_root: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        "--task",
        "cifar10",
        "--backend",
        "local",
        "--workers",
        "2",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--eval-batch-size",
        "64",
        "--out",
        tmp_path / "run.h5",
        *args,
    ]
    return run_train(command, env={"RELAYMPI_DATA": str(data_root)}, timeout=600)


@pytest.mark.parametrize(
    "task, data, model",
    [
        ("agnews", "agnews", "distilbert"),
        ("imagenet", "imagenet", None),
        ("digits", None, None),
    ],
)
def test_resolve_fills_the_default_folders(tmp_path, monkeypatch, task, data, model):
    from relaympi.config import RunConfig
    from relaympi.training.plan import resolve

    monkeypatch.setenv("RELAYMPI_DATA", str(tmp_path))
    cfg = resolve(RunConfig(task=task, backend="local", workers=2), 2).cfg
    assert cfg.data_dir == (tmp_path / data if data else None)
    assert cfg.model_dir == (tmp_path / model if model else None)
    given = resolve(RunConfig(task=task, backend="local", workers=2, data_dir=Path("rel")), 2).cfg
    assert given.data_dir == Path("rel").absolute()  # given: kept, made absolute for the record


@pytest.mark.slow
def test_train_reads_the_default_root_and_records_it(tmp_path):
    from relaympi.results import read_run

    root = tmp_path / "data root"
    proc = train(tmp_path, root)
    assert proc.returncode == 2
    assert (
        "python -m relaympi.data fetch cifar10" in proc.stderr
        and str(root / "cifar10") in proc.stderr
    )
    write_cifar10_binary(root / "cifar10", n_per_batch=8)
    proc = train(tmp_path, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(tmp_path / "run.h5")
    assert run.status == "completed" and run.config["data_dir"] == str(root / "cifar10")
    assert run.config["model_dir"] is None


# -- prepare-imagenet -------------------------------------------------------------------------

WNIDS = ("n00000001", "n00000002", "n00000003")  # ILSVRC2012_IDs 1, 2, 3
VAL_IDS = (1, 2, 3, 1, 2, 3)  # ground truth of ILSVRC2012_val_00000001 ... _00000006


def jpeg(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def train_images(wnid: str, count: int = 2) -> dict[str, bytes]:
    return {f"{wnid}_{i}.JPEG": jpeg(hash((wnid, i)) % 1000) for i in range(count)}


def val_images() -> dict[str, bytes]:
    return {f"ILSVRC2012_val_{i:08d}.JPEG": jpeg(100 + i) for i in range(1, len(VAL_IDS) + 1)}


def write_devkit(folder: Path) -> Path:
    """ILSVRC2012_devkit_t12/data/{meta.mat, ILSVRC2012_validation_ground_truth.txt}; a non-leaf
    synset (id 4, two children) is in meta.mat as in the real one."""
    import scipy.io

    data = folder / "ILSVRC2012_devkit_t12" / "data"
    data.mkdir(parents=True)
    rows = [(i + 1, wnid, 0) for i, wnid in enumerate(WNIDS)] + [(4, "n09999999", 2)]
    synsets = np.array(rows, dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")])
    scipy.io.savemat(data / "meta.mat", {"synsets": synsets})
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{i}\n" for i in VAL_IDS))
    return folder / "ILSVRC2012_devkit_t12"


@pytest.fixture
def official(tmp_path) -> dict[str, Path]:
    """The official files in miniature: train tar of class tars (classes 1 and 2 only: a subset),
    the flat validation tar, and the devkit tarball."""
    src = tmp_path / "official"
    src.mkdir()
    inner = {f"{wnid}.tar": tar_bytes(train_images(wnid)) for wnid in WNIDS[:2]}
    (src / "ILSVRC2012_img_train.tar").write_bytes(tar_bytes(inner))
    (src / "ILSVRC2012_img_val.tar").write_bytes(tar_bytes(val_images()))
    devkit = write_devkit(src / "devkit")
    with tarfile.open(src / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as tar:
        tar.add(devkit, arcname="ILSVRC2012_devkit_t12")
    return {
        "train": src / "ILSVRC2012_img_train.tar",
        "val": src / "ILSVRC2012_img_val.tar",
        "devkit": src / "ILSVRC2012_devkit_t12.tar.gz",
        "devkit_dir": devkit,
    }


def prepare(root: Path, train: Path, val: Path, devkit: Path, *flags: str) -> int:
    return run_cli(
        "prepare-imagenet",
        "--train",
        train,
        "--val",
        val,
        "--devkit",
        devkit,
        "--root",
        root,
        *flags,
    )


def test_prepare_imagenet_from_the_official_tars(tmp_path, official, caplog, capsys):
    from relaympi.tasks import TaskOptions
    from relaympi.tasks.imagenet import ImageNetTask

    root = tmp_path / "root"
    assert prepare(root, official["train"], official["val"], official["devkit"]) == 0
    target = root / "imagenet"
    assert sorted(p.name for p in (target / "train").iterdir()) == list(WNIDS[:2])
    assert sorted(p.name for p in (target / "train" / WNIDS[1]).iterdir()) == sorted(
        train_images(WNIDS[1])
    )
    # val images 1 and 4 are class 1, 2 and 5 class 2; 3 and 6 (class 3, no training images) are
    # left out
    assert sorted(p.name for p in (target / "val" / WNIDS[0]).iterdir()) == [
        "ILSVRC2012_val_00000001.JPEG",
        "ILSVRC2012_val_00000004.JPEG",
    ]
    assert (
        target / "val" / WNIDS[1] / "ILSVRC2012_val_00000005.JPEG"
    ).read_bytes() == val_images()["ILSVRC2012_val_00000005.JPEG"]
    recorded = read(target)
    assert (
        recorded["counts"] == {"train": 4, "val": 4, "classes": 2} and recorded["val_skipped"] == 2
    )
    assert "a subset" in recorded["coverage"] and "left out 2 validation images" in caplog.text
    assert not (root / ".imagenet.partial").exists()
    task = ImageNetTask(TaskOptions(data_dir=target, num_loader_workers=0))
    assert task.classes == list(WNIDS[:2]) and task.test_labels.tolist() == [0, 0, 1, 1]
    capsys.readouterr()
    assert run_cli("check", "imagenet", "--root", root) == 0
    assert "4 train / 4 val images in 2 classes" in capsys.readouterr().out
    caplog.clear()
    assert prepare(root, official["train"], official["val"], official["devkit"]) == 0
    assert "already prepared" in caplog.text
    (target / "val" / WNIDS[0] / "ILSVRC2012_val_00000001.JPEG").unlink()
    assert run_cli("check", "imagenet", "--root", root) == 1
    assert "val/ holds 3 images, the manifest records 4" in capsys.readouterr().out


def folder_sources(tmp_path: Path) -> tuple[Path, Path]:
    """Unpacked sources: train/<wnid>/ class folders, and a flat validation folder."""
    train, val = tmp_path / "src-train", tmp_path / "src-val"
    for wnid in WNIDS:
        (train / wnid).mkdir(parents=True)
        for name, data in train_images(wnid, 1).items():
            (train / wnid / name).write_bytes(data)
    val.mkdir()
    for name, data in val_images().items():
        (val / name).write_bytes(data)
    return train, val


def loc_csv(path: Path) -> Path:
    lines = ["ImageId,PredictionString"]
    for i, class_id in enumerate(VAL_IDS, start=1):
        wnid = WNIDS[class_id - 1]
        lines.append(f"ILSVRC2012_val_{i:08d},{wnid} 1 2 10 11 {wnid} 3 4 5 6 ")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("mode", ["--link", "--move", None])
def test_prepare_imagenet_from_folders_links_moves_or_copies(tmp_path, mode):
    train, val = folder_sources(tmp_path)
    source = val / "ILSVRC2012_val_00000002.JPEG"
    inode = source.stat().st_ino
    root = tmp_path / "root"
    assert (
        prepare(
            root, train, val, loc_csv(tmp_path / "LOC_val_solution.csv"), *([mode] if mode else [])
        )
        == 0
    )
    placed = root / "imagenet" / "val" / WNIDS[1] / source.name
    assert read(root / "imagenet")["counts"] == {"train": 3, "val": 6, "classes": 3}
    if mode == "--link":
        assert placed.stat().st_ino == inode and source.exists()
    elif mode == "--move":
        assert (
            placed.stat().st_ino == inode and not source.exists() and not any(train.rglob("*.JPEG"))
        )
    else:
        assert placed.stat().st_ino != inode and source.exists()


def test_prepare_imagenet_from_a_folder_of_class_tars_and_the_devkit_folder(tmp_path, official):
    tars = tmp_path / "class-tars"
    tars.mkdir()
    for wnid in WNIDS:
        (tars / f"{wnid}.tar").write_bytes(tar_bytes(train_images(wnid, 3)))
    assert prepare(tmp_path / "root", tars, official["val"], official["devkit_dir"]) == 0
    assert read(tmp_path / "root" / "imagenet")["counts"] == {"train": 9, "val": 6, "classes": 3}


def test_prepare_imagenet_accepts_a_sorted_validation_folder(tmp_path, official, capsys):
    train, val = folder_sources(tmp_path)
    for i, class_id in enumerate(VAL_IDS, start=1):
        (val / WNIDS[class_id - 1]).mkdir(exist_ok=True)
        (val / f"ILSVRC2012_val_{i:08d}.JPEG").rename(
            val / WNIDS[class_id - 1] / f"ILSVRC2012_val_{i:08d}.JPEG"
        )
    assert prepare(tmp_path / "root", train, val, official["devkit"], "--link") == 0
    assert read(tmp_path / "root" / "imagenet")["counts"] == {"train": 3, "val": 6, "classes": 3}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare(tmp_path / "root2", train, empty, official["devkit"]) == 1
    assert "no validation images" in capsys.readouterr().err


def test_prepare_imagenet_reports_a_truncated_tar(tmp_path, official, capsys):
    blob = official["train"].read_bytes()
    official["train"].write_bytes(blob[: len(blob) // 2 + 700])
    assert prepare(tmp_path / "root", official["train"], official["val"], official["devkit"]) == 1
    assert (
        "truncated or damaged" in capsys.readouterr().err
        and not (tmp_path / "root" / "imagenet").exists()
    )


def test_prepare_imagenet_refuses_images_without_ground_truth(tmp_path, official, capsys):
    train, val = folder_sources(tmp_path)
    (val / "ILSVRC2012_val_00000099.JPEG").write_bytes(jpeg(1))
    assert prepare(tmp_path / "root", train, val, official["devkit"]) == 1
    assert (
        "1 validation images have no ground-truth entry (first: ILSVRC2012_val_00000099.JPEG)"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "root" / "imagenet").exists()
