"""The data sets relaympi can fetch or check: where they come from, their checksums, their
layout."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relaympi.data import manifest
from relaympi.data.download import ChecksumError, DataError, OfflineError, download
from relaympi.data.manifest import CORRUPT, INCOMPLETE, MISSING, UNVERIFIED, VERIFIED, Status
from relaympi.data.paths import MIRROR_ENV, data_root, fetch_command, fix_command, set_dir

log = logging.getLogger("relaympi.data")

DOWNLOADS = "downloads"  # <root>/downloads: archives while (and until) they are unpacked


@dataclass(frozen=True)
class RemoteFile:
    """One file of a data set as published: its name, official URL and published md5."""

    name: str
    url: str
    md5: str | None


class DataSet(ABC):
    """A data set folder ``<root>/<name>``: its state, and (if it can) how to fetch it."""

    name: str
    description: str

    def path(self, root: Path | str | None = None) -> Path:
        return set_dir(self.name, root)

    def status(self, root: Path | str | None = None, hashes: bool = True) -> Status:
        """What is in ``<root>/<name>``: verified against its manifest, complete by hand, or not."""
        return self.status_of(self.path(root), hashes)

    def status_of(self, directory: Path, hashes: bool = True) -> Status:
        """The same for a folder anywhere (a --data-dir given by hand)."""
        if not directory.is_dir():
            return Status(self.name, directory, MISSING, "not there")
        recorded = manifest.read(directory)
        if recorded is None:
            problem = self.layout_problem(directory)
            if problem:
                return Status(self.name, directory, INCOMPLETE, problem)
            return Status(
                self.name,
                directory,
                UNVERIFIED,
                "complete, but no manifest (not written by relaympi.data)",
            )
        problem = self.verify(directory, recorded, hashes)
        if problem:
            return Status(self.name, directory, CORRUPT, problem)
        return Status(self.name, directory, VERIFIED, self.summary(recorded))

    def verify(self, directory: Path, recorded: dict, hashes: bool) -> str:
        """'' when the folder still holds what its manifest recorded; else what differs."""
        return manifest.check_files(directory, recorded.get("files", {}), hashes)

    def summary(self, recorded: dict) -> str:
        files = recorded.get("files", {})
        size = sum(r["size"] for r in files.values())
        return f"{len(files)} files, {size / 1e6:.1f} MB, from {recorded.get('source', '?')}"

    @abstractmethod
    def layout_problem(self, directory: Path) -> str:
        """'' if ``directory`` holds every file the task reads; else what is missing."""


class FetchableSet(DataSet):
    """A public data set: files downloaded (and checked) into ``<root>/downloads``, then laid
    out in a staging folder ``<root>/.<name>.partial`` that is renamed into place only once it
    is complete and its manifest is written. A verified set makes a fetch a no-op."""

    files: tuple[RemoteFile, ...] = ()
    keep_staging: bool = False  # keep a partial staging folder between runs (it resumes there)

    def fetch(
        self, root: Path | str | None = None, url: str | None = None, progress: bool = True
    ) -> Path:
        """``<root>/<name>``, fetched unless it is there and verified (one fetch per set at a
        time)."""
        shown_root = None if root is None else data_root(root)  # for the commands in messages
        root = data_root(root)
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f".{self.name}.lock", self.name):
            return self._fetch(root, shown_root, url, progress)

    def _fetch(self, root: Path, shown_root: Path | None, url: str | None, progress: bool) -> Path:
        target = self.path(root)
        status = self.status(root)  # checksums too: a second fetch repairs a damaged set
        if status.state == VERIFIED:
            log.info("%s: already present and verified in %s", self.name, target)
            return target
        if status.state == CORRUPT:  # replaced only once the new copy is complete
            log.warning(
                "%s: %s no longer matches its manifest (%s); fetching it again",
                self.name,
                target,
                status.detail,
            )
        elif status.state != MISSING:
            raise DataError(
                f"{target} exists but was not written by `{fetch_command(self.name, shown_root)}` "
                f"({status.state}: {status.detail}), so it is not replaced; move it away "
                "and fetch: "
                f"`{fix_command(self.name, target, shown_root)}`"
                + (" (or use it as it is: it is complete)" if status.state == UNVERIFIED else "")
            )
        staging = root / f".{self.name}.partial"
        if staging.exists() and not self.keep_staging:
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)
        try:
            source, downloaded = self.fill(staging, root, url, progress, shown_root)
        except BaseException:
            if not any(staging.iterdir()):  # leave no empty folder behind a failed download
                staging.rmdir()
            raise
        problem = self.layout_problem(staging)
        if problem:
            raise DataError(f"{self.name} from {source}: {problem}; nothing was put in place")
        manifest.write(
            staging,
            self.name,
            source,
            files=manifest.file_records(staging),
            downloads={f.name: f.md5 for f in self.files} or None,
        )
        if target.exists():  # the corrupt copy: out of the way first, deleted after the rename
            old = root / f".{self.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
            os.rename(staging, target)
            shutil.rmtree(old)
        else:
            os.rename(staging, target)
        for path in downloaded:
            path.unlink(missing_ok=True)
        log.info("%s: ready in %s", self.name, target)
        return target

    def fill(
        self, staging: Path, root: Path, url: str | None, progress: bool, shown_root: Path | None
    ) -> tuple[str, list[Path]]:
        """Put the set's files into ``staging``; returns (source, downloads to remove after)."""
        paths = [self.download(f, root, url, progress, shown_root) for f in self.files]
        self.unpack(paths, staging)
        return self.source(url), paths

    def url_for(self, remote: RemoteFile, url: str | None) -> str:
        """The official URL, or the file's name under ``--url`` /
        ``$RELAYMPI_DATA_MIRROR/<set>``."""
        base = url or (
            os.environ[MIRROR_ENV].rstrip("/") + f"/{self.name}"
            if os.environ.get(MIRROR_ENV)
            else None
        )
        if base is None:
            return remote.url
        base = base.rstrip("/")
        return base if base.endswith("/" + remote.name) else f"{base}/{remote.name}"

    def source(self, url: str | None) -> str:
        return " ".join(self.url_for(f, url) for f in self.files)

    def download(
        self,
        remote: RemoteFile,
        root: Path,
        url: str | None,
        progress: bool,
        shown_root: Path | None,
    ) -> Path:
        dest = root / DOWNLOADS / remote.name
        source = self.url_for(remote, url)
        try:
            return download(source, dest, remote.md5, progress=progress)
        except OfflineError as exc:
            raise OfflineError(
                f"{exc}. Offline? Run this fetch where there is internet (a login node) with the "
                f"same --root, or put the file there by hand: download {source} and save it as "
                f"{dest}, then rerun `{fetch_command(self.name, shown_root)}` (it checks "
                "the md5 and "
                f"lays the files out). A site mirror: --url URL or {MIRROR_ENV}"
            ) from None

    def unpack(self, downloads: list[Path], staging: Path) -> None:
        """Lay the downloaded files out in ``staging`` the way the task reads them (default: as
        they are; copied, since ``downloads/`` is emptied only once the set is in place)."""
        for path in downloads:
            shutil.copyfile(path, staging / path.name)


class Cifar10(FetchableSet):
    """The CIFAR-10 binary version from Alex Krizhevsky's page, md5 as published there."""

    name = "cifar10"
    description = "CIFAR-10, binary version (https://www.cs.toronto.edu/~kriz/cifar.html)"
    files = (
        RemoteFile(
            "cifar-10-binary.tar.gz",
            "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
            "c32a1d4ab5d03f1284b67883e8d87530",
        ),
    )

    def unpack(self, downloads: list[Path], staging: Path) -> None:
        (archive,) = downloads
        log.info("unpacking %s", archive)
        try:
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
                if sys.version_info >= (3, 12):
                    tar.extractall(staging, members=members, filter="data")
                else:
                    _check_members(members, archive)
                    tar.extractall(staging, members=members)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise DataError(f"cannot unpack {archive}: {exc}") from exc

    def layout_problem(self, directory: Path) -> str:
        from relaympi.data.layouts import cifar10_problem

        return cifar10_problem(directory)


class AgNews(FetchableSet):
    """AG News train/test CSVs (Zhang et al. 2015, the char-CNN release) from the public
    mirror in mhjabreel/CharCnn_Keras on GitHub that torchtext downloads; the md5s are the
    ones torchtext publishes for these two files (120,000 and 7,600 rows)."""

    name = "agnews"
    description = "AG News topic classification CSVs (torchtext's mirror of Zhang et al. 2015)"
    _BASE = "https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/ag_news_csv"
    files = (
        RemoteFile("train.csv", f"{_BASE}/train.csv", "b1a00f826fdfbd249f79597b59e1dc12"),
        RemoteFile("test.csv", f"{_BASE}/test.csv", "d52ea96a97a2d943681189a97654912d"),
    )

    def layout_problem(self, directory: Path) -> str:
        missing = [f.name for f in self.files if not (directory / f.name).is_file()]
        return f"missing {', '.join(missing)}" if missing else ""


class DistilBert(FetchableSet):
    """distilbert-base-uncased from the Hugging Face Hub (huggingface_hub.snapshot_download;
    honours HF_ENDPOINT for hub mirrors), saved flat the way ``--model-dir`` reads it, checked
    against the hub's per-file checksums; the manifest records the commit and every file's
    sha256. With --url or RELAYMPI_DATA_MIRROR the same files come from a plain file mirror
    (no published checksums there: the manifest records the sha256 of what was fetched)."""

    name = "distilbert"
    description = "DistilBERT base uncased (Hugging Face distilbert/distilbert-base-uncased)"
    repo_id = "distilbert/distilbert-base-uncased"
    hub_files = (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    )
    keep_staging = True  # snapshot_download resumes from its own partial files there

    def fill(
        self, staging: Path, root: Path, url: str | None, progress: bool, shown_root: Path | None
    ) -> tuple[str, list[Path]]:
        if url or os.environ.get(MIRROR_ENV):
            for stale in staging.iterdir():  # a plain-mirror fetch resumes in downloads/, not here
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            remotes = [RemoteFile(name, "", None) for name in self.hub_files]
            paths = [self.download(r, root, url, progress, shown_root) for r in remotes]
            self.unpack(paths, staging)
            return " ".join(self.url_for(r, url) for r in remotes), paths
        try:
            commit = hub_snapshot(self.repo_id, staging, list(self.hub_files), progress)
        except OfflineError as exc:
            raise OfflineError(
                f"{exc}. Offline? Run this fetch where there is internet (a login node) "
                "with the same "
                f"--root, or save the model by hand into {self.path(root)}: "
                "`AutoModelForSequenceClassification"
                f".from_pretrained('{self.repo_id}').save_pretrained(DIR)` "
                f"and `AutoTokenizer.from_pretrained('{self.repo_id}').save_pretrained(DIR)`; "
                "a hub mirror: "
                f"HF_ENDPOINT=URL, a plain file mirror: --url URL or {MIRROR_ENV}"
            ) from None
        shutil.rmtree(staging / ".cache", ignore_errors=True)  # the hub client's resume state
        endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        return f"{endpoint}/{self.repo_id}@{commit}", []

    def layout_problem(self, directory: Path) -> str:
        from relaympi.data.layouts import model_dir_problem

        return model_dir_problem(directory)


def hub_snapshot(repo_id: str, local_dir: Path, allow_patterns: list[str], progress: bool) -> str:
    """The one place that talks to the Hugging Face Hub: ``allow_patterns`` of ``repo_id``'s
    current commit into ``local_dir``, checked against the checksums the hub publishes (git blob
    sha1, sha256 of LFS files) where huggingface_hub can (>= 1.x: verify_repo_checksums).
    Returns the commit. HF_ENDPOINT is read now, not when huggingface_hub was imported."""
    try:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    except ImportError as exc:
        raise DataError(
            "fetching distilbert needs huggingface_hub: pip install 'relaympi[nlp]'"
        ) from exc
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    api = HfApi(endpoint=endpoint)
    if not progress:
        disable_progress_bars()
    try:
        commit = api.model_info(repo_id, revision="main").sha
        assert commit is not None  # the hub names the commit of every model it serves
        snapshot_download(
            repo_id=repo_id,
            revision=commit,
            local_dir=str(local_dir),
            allow_patterns=allow_patterns,
            endpoint=endpoint,
        )
        verify = getattr(api, "verify_repo_checksums", None)
        if verify is None:
            log.info("this huggingface_hub cannot check the hub's checksums; recording sha256 only")
        else:
            result = verify(repo_id, revision=commit, local_dir=str(local_dir))
            if result.mismatches:
                for mismatch in result.mismatches:
                    (local_dir / mismatch["path"]).unlink(missing_ok=True)
                first = result.mismatches[0]
                raise ChecksumError(
                    f"{repo_id}@{commit}: {first['path']} has {first['algorithm']} "
                    f"{first['actual']}, the hub "
                    f"publishes {first['expected']} ({len(result.mismatches)} file(s) "
                    "differ; deleted)"
                )
            log.info(
                "%s@%s: %d files match the hub's checksums", repo_id, commit, result.checked_count
            )
    except HfHubHTTPError as exc:
        raise DataError(f"the Hugging Face Hub ({endpoint}) refused {repo_id}: {exc}") from None
    except DataError:
        raise
    except Exception as exc:
        if not _is_connection_error(exc):
            raise
        reason = str(exc).splitlines()[0].removeprefix("Got: ") if str(exc) else type(exc).__name__
        raise OfflineError(
            f"cannot reach the Hugging Face Hub ({endpoint}) for {repo_id}: {reason}"
        ) from None
    finally:
        if not progress:
            enable_progress_bars()
    return commit


def _is_connection_error(exc: Exception) -> bool:
    """A network failure, whichever HTTP stack this huggingface_hub uses (httpx or requests)."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if isinstance(exc, (OSError, LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return True
    # httpx2 too
    return type(exc).__module__.startswith(("httpx", "httpcore", "requests", "urllib3"))


class ImageNet(DataSet):
    """ILSVRC2012 (ImageNet-1k) as class folders, laid out by ``prepare-imagenet``: it cannot be
    fetched (its licence needs an account); the manifest records the image counts."""

    name = "imagenet"
    description = "ImageNet-1k (ILSVRC2012), prepared from the official tars"

    def verify(self, directory: Path, recorded: dict, hashes: bool) -> str:
        """Image counts per split against the manifest (a listing of 1.3M files: skipped when
        ``hashes`` is off, the quick check)."""
        from relaympi.data.layouts import count_images

        if not hashes:
            return self.layout_problem(directory)
        for split in ("train", "val"):
            expected = recorded.get("counts", {}).get(split)
            found = count_images(directory / split)
            if expected is not None and found != expected:
                return f"{split}/ holds {found} images, the manifest records {expected}"
        return ""

    def summary(self, recorded: dict) -> str:
        counts = recorded.get("counts", {})
        return (
            f"{counts.get('train', '?')} train / {counts.get('val', '?')} val images in "
            f"{counts.get('classes', '?')} classes ({recorded.get('coverage', '')})"
        )

    def layout_problem(self, directory: Path) -> str:
        missing = [s for s in ("train", "val") if not (directory / s).is_dir()]
        return f"missing {', '.join(s + '/' for s in missing)}" if missing else ""


@contextlib.contextmanager
def _exclusive(lock: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock``: a second fetch of the same set must not clear the
    staging folder the first one is filling."""
    import fcntl

    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataError(
                f"another fetch of {name} is running (it holds {lock}); wait for it"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_members(members: list[tarfile.TarInfo], archive: Path) -> None:
    """Python < 3.12 has no extraction filter: refuse absolute paths and '..' by hand."""
    for member in members:
        if Path(member.name).is_absolute() or ".." in Path(member.name).parts:
            raise DataError(f"{archive}: refusing the unsafe member path {member.name!r}")


DATASETS: dict[str, DataSet] = {s.name: s for s in (Cifar10(), AgNews(), DistilBert(), ImageNet())}
FETCHABLE = tuple(name for name, s in DATASETS.items() if isinstance(s, FetchableSet))


def data_problems(
    needs: list[tuple[str, Path]], hashes: bool = True, allow_unverified: bool = False
) -> list[str]:
    """One line per (set name, folder) that is not verified (or, with ``allow_unverified``, not at
    least complete), naming the command that fixes it; [] when all are fine."""
    problems = []
    for name, directory in dict.fromkeys(needs):
        status = DATASETS[name].status_of(Path(directory), hashes)
        if status.state == VERIFIED or (allow_unverified and status.state == UNVERIFIED):
            continue
        if directory.name == name:  # --root always: the root may come from a settings file
            fix = f"run `{fix_command(name, Path(directory), directory.parent)}`"
        else:
            fix = f"fetch it with `{fetch_command(name)}` and drop the explicit folder"
        problems.append(f"{name} in {directory}: {status.state} ({status.detail}); {fix}")
    return problems
