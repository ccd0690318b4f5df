"""Where files live: a local path, or an object-store URL (s3://, gs://, az://, hf://, https://).

`as_path(text)` gives a `pathlib.Path` for local text and an `ObjectPath` for a URL. An
ObjectPath answers the part of the Path API the io layer uses (/, name, suffix, parent, open,
read_bytes, glob, unlink, ...) through an fsspec filesystem, so readers, shards, the checkpoint
and the final merge are written once for both. Where the two differ in kind, the difference
lives here:

- writing a whole file: local = temp file + fsync + rename (io/atomic.py); object store = the
  bytes spooled locally, then one PUT (or one multipart upload, completed last): an object is
  either absent or whole, and an upload a kill interrupted is never readable;
- listing: an ObjectPath lists afresh every time (no listing cache): the committed set is
  read from the store itself;
- folders: an object store has none (mkdir, rmdir and fsync of a folder do nothing).

Credentials come from each store library's own chain (for S3: AWS_* variables, ~/.aws/config
and credentials, instance roles; a custom endpoint through AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL); batchgen never takes them in a job spec and never prints them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, NamedTuple

from batchgen.errors import BatchgenError, first_line

# scheme -> the pip package whose fsspec filesystem serves it
SCHEME_PACKAGES = {
    "s3": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "hf": "huggingface_hub",
    "http": "aiohttp",
    "https": "aiohttp",
}
# schemes an output directory may use: a whole-object PUT is atomic, and a conditional PUT
# (If-None-Match) makes the directory's lock (io/object_lock.py)
OUTPUT_SCHEMES = ("s3",)
# schemes whose filesystem takes the whole URL (its query string included), not a key, and
# whose URL names one object (never a glob or a folder: '?' starts a query)
URL_SCHEMES = ("http", "https")
# bytes a store file fetches a request (None: its library's own: s3fs 50 MiB, http(s) 5 MiB)
STORE_BLOCK_BYTES: int | None = None
LINES_BUFFER_BYTES = 1 << 20  # a store file's lines are read through a buffer of this size
LINE_READ_BYTES = 1 << 16  # StoreFile.readline reads this much at a time
SPOOL_BYTES = 64 << 20  # a whole-object write is held in memory up to this size, then on disk
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.+)$", re.IGNORECASE)  # a scheme has no case

AnyPath = Any  # Path | ObjectPath (duck-typed: the Path methods below)


def scheme_of(text: str) -> str | None:
    """The scheme of a URL batchgen reads through a filesystem library; None for a local path
    (file:// included)."""
    match = _URL.match(text)
    if match is None or match.group(1).lower() == "file":
        return None
    return match.group(1).lower()


def as_path(text: str | Path) -> AnyPath:
    """A Path for local text (file:// taken off, ~ expanded: the one place a local path is
    normalised, so every use of it names the same folder), an ObjectPath for a URL.
    BatchgenError (one line) for a scheme batchgen does not know or whose library is missing."""
    if isinstance(text, ObjectPath):
        return text
    if isinstance(text, Path):
        return text.expanduser()
    scheme = scheme_of(text)
    if scheme is None:
        return local_path(text)
    if scheme not in SCHEME_PACKAGES:
        known = ", ".join(f"{s}://" for s in SCHEME_PACKAGES)
        raise BatchgenError(f"{text!r}: unknown scheme {scheme}:// (batchgen reads {known})")
    return ObjectPath(_filesystem(scheme, text), scheme, _URL.match(text).group(2).rstrip("/"))


def check_output_url(text: str) -> None:
    """BatchgenError (one line) for an output directory on a store batchgen cannot write
    safely: only OUTPUT_SCHEMES have the conditional PUT its lock needs."""
    scheme = scheme_of(text)
    if scheme is not None and scheme not in OUTPUT_SCHEMES:
        allowed = ", ".join(f"{s}://" for s in OUTPUT_SCHEMES)
        raise BatchgenError(
            f"output directory {text!r}: batchgen writes output to a local folder or {allowed} "
            f"only, not {scheme}://: write locally and copy the results there"
        )


def local_path(text: str) -> Path:
    """A local path as written (file:// taken off, ~ expanded)."""
    if text[:7].lower() == "file://":
        text = text[7:]
    return Path(text).expanduser()


def is_object(path: AnyPath) -> bool:
    return isinstance(path, ObjectPath)


def _filesystem(scheme: str, text: str) -> Any:
    package = SCHEME_PACKAGES[scheme]
    try:
        import fsspec

        # a fresh instance, no listing cache: the committed set is read from the store
        return fsspec.filesystem(scheme, skip_instance_cache=True, use_listings_cache=False)
    except ImportError as exc:
        raise BatchgenError(
            f"{text!r} needs the '{package}' package, which is not installed: pip install {package}"
        ) from exc


class Stat(NamedTuple):
    st_size: int


# what tells that a file changed without reading it: (what, value) pairs, "size" first
Identity = tuple[tuple[str, Any], ...]
# the keys of a store's info (its HEAD) that name an object's version, by library: http
# (fsspec), s3fs, gcsfs, adlfs, huggingface_hub
_VERSION_KEYS = {
    "ETag": "ETag",
    "etag": "ETag",
    "VersionId": "version",
    "version_id": "version",
    "generation": "version",
    "blob_id": "version",
    "Last-Modified": "modified time",
    "LastModified": "modified time",
    "last_modified": "modified time",
    "updated": "modified time",
}


class InputChanged(BatchgenError):
    """An input file is not the one its scan read: rows read now would be another content's."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(
            f"input {name!r} changed while the job read it ({what} from when it was scanned; "
            "no row of the changed content was used): run the same command again once it no "
            "longer changes (with the content the job began with it resumes; a changed input "
            "is another job's, which that run names)"
        )


def identity(path: AnyPath) -> Identity:
    """What says `path` changed, without reading it: a local file's size and modification
    time (ns; not its inode, which an atomic replace by the same bytes changes, and some
    network mounts renumber); an object's size and what its store tells of its version (ETag,
    Last-Modified, version id; one HEAD request)."""
    if not is_object(path):
        stat = os.stat(path)
        return (("size", stat.st_size), ("modified time", stat.st_mtime_ns))
    info = _store_call(path.info)
    versions = [(label, info[key]) for key, label in _VERSION_KEYS.items() if info.get(key)]
    return (("size", info.get("size")), *versions)


def check_unchanged(path: AnyPath, name: str, expected: Identity) -> Identity:
    """InputChanged unless `path` still is the file `expected` was taken of -> its identity
    now (an object's holds its size: an open need not ask again). "It is gone" only where the
    disk or the store says so (404, 410); a store that cannot be reached is a StoreFailure."""
    try:
        now = identity(path)
    except FileNotFoundError as exc:
        if (line := status_line(http_status(exc))) is not None:
            raise BatchgenError(f"input {name!r}: {line}") from exc
        raise InputChanged(name, "it is gone") from exc
    if now != expected:
        seen = dict(now)
        differ = dict.fromkeys(label for label, value in expected if seen.get(label) != value)
        raise InputChanged(name, f"its {'/'.join(differ) or 'version'} differs")
    return now


@dataclass
class Pin:
    """An input file as the job first saw it: its name in messages, its identity then, and
    the SHA-256 of its bytes once hashed (by the input's fingerprint) while that identity held."""

    name: str
    identity: Identity
    sha256: str | None = None


def check_pinned(path: AnyPath, pin: Pin, stores: bool = False) -> Identity:
    """check_unchanged against the pin -> the file's identity now. A local file (with stores,
    an object too: one more download) whose identity differs but whose size does not (touched,
    replaced by the same bytes; one URL served by backends that give the same bytes other
    ETags) is hashed again where its digest is known: the same bytes are the same file (its
    identity now is pinned), other bytes are InputChanged."""
    try:
        return check_unchanged(path, pin.name, pin.identity)
    except InputChanged:
        if pin.sha256 is None or (is_object(path) and not stores):
            raise
        if (now := _same_bytes(path, pin)) is None:
            raise
    pin.identity = now
    return now


def _same_bytes(path: AnyPath, pin: Pin) -> Identity | None:
    """The identity of `path` now where its bytes hash as the pin's, else None."""
    try:
        now = identity(path)
        if dict(now).get("size") != dict(pin.identity).get("size"):
            return None
        with path.open("rb") as f:
            digest = sha256_of(f)
        # a local file is the one hashed only if it did not change meanwhile; an object's
        # bytes as read are what the store serves (its version may read differently each time)
        same = digest == pin.sha256 and (is_object(path) or identity(path) == now)
    except FileNotFoundError:
        return None
    return now if same else None


def sha256_of(f: IO[bytes], chunk: int = 1 << 20) -> str:
    """The SHA-256 of what an open file holds from where it is on."""
    h = hashlib.sha256()
    while data := f.read(chunk):
        h.update(data)
    return h.hexdigest()


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a store library's failure (aiohttp's, which fsspec chains under its
    own), or None."""
    seen: BaseException | None = exc
    while seen is not None:
        status = getattr(seen, "status", None)
        if isinstance(status, int):
            return status
        seen = seen.__cause__ or seen.__context__
    return None


def unreached(exc: BaseException) -> BaseException | None:
    """What failed under a 'not found' no server said (fsspec's http turns any failed HEAD or
    GET into FileNotFoundError: a refused connection, a name that does not resolve, a timeout)
    -> that error; None for a file the disk or a store says is not there (a 404, s3fs's
    missing key or bucket)."""
    if not isinstance(exc, FileNotFoundError) or http_status(exc) is not None:
        return None
    cause = exc.__cause__ or exc.__context__
    transport = isinstance(cause, (OSError, TimeoutError)) or _library(cause) == "aiohttp"
    return cause if transport else None


def status_line(status: int | None) -> str | None:
    """What an HTTP status that refuses a read means, and what to do; None for none, and for
    a file not found (404, 410: the caller says so in its own words)."""
    if status in (401, 403):
        return (
            f"the server refused access (HTTP {status}): the URL may have expired or need "
            "credentials: get a fresh one"
        )
    if status == 429 or (status is not None and status >= 500):
        return f"server error (HTTP {status}): run again later"
    return None


def reads_are_conditional(path: AnyPath, expected: Identity) -> bool:
    """Whether every read of the object `path` is refused once it is no longer `expected`:
    an http(s) object's range requests, where it has an ETag or Last-Modified (ObjectPath.open
    with a pin). Another store's object is read as it is when each block is fetched."""
    return is_object(path) and path.scheme in URL_SCHEMES and bool(_conditions(expected))


def _conditions(expected: Identity) -> dict[str, str]:
    """The request headers that make a server refuse (412) an object other than `expected`:
    If-Match on a strong ETag (a weak one never matches), else If-Unmodified-Since."""
    known = dict(expected)
    etag = known.get("ETag")
    if isinstance(etag, str) and not etag.startswith("W/"):
        return {"If-Match": etag}
    modified = known.get("modified time")
    return {"If-Unmodified-Since": modified} if isinstance(modified, str) else {}


class StoreFailure(OSError):
    """A store that failed to serve a file (a broken transfer, a refusal, a server that cannot
    give byte ranges), as one line that says what to do: no fault of the file's content."""


def _store_call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """method(*args), a store library's failure (aiohttp's payload, connection and timeout
    errors, an HTTP status, fsspec's ValueError on a file it cannot seek or whose server
    ignores range requests) raised as a StoreFailure: an OSError, what every reader of a file
    already reports as one line."""
    try:
        return method(*args, **kwargs)
    except ValueError as exc:
        text = str(exc).lower()
        if "seek" in text:
            why = "gives no length for it or sends it compressed (Content-Encoding)"
        elif "range requests" in text:
            why = "answers a range request with the whole file (no Range, or compressed)"
        else:
            raise
        raise StoreFailure(
            f"its server {why}, so it cannot be read by byte ranges: download it and give the "
            "local file"
        ) from exc
    except Exception as exc:  # the library's own (network) errors
        if (line := status_line(http_status(exc))) is not None:
            raise StoreFailure(line) from exc  # fsspec's FileNotFoundError for a refused HEAD
        if (cause := unreached(exc)) is not None:  # no server said "not found"
            raise StoreFailure(f"{first_line(cause)}; the transfer failed: run again") from exc
        if isinstance(exc, StoreFailure) or not _from_store_library(exc):
            raise
        raise StoreFailure(f"{first_line(exc)}; the transfer failed: run again") from exc


def _from_store_library(exc: BaseException) -> bool:
    """Whether a store library raised `exc` as its own type (aiohttp's connection errors are
    OSErrors too; a plain FileNotFoundError is no transfer's failure)."""
    return _library(exc) in _STORE_LIBRARIES


def _library(exc: BaseException | None) -> str:
    """The top-level module an error's type is defined in."""
    return type(exc).__module__.split(".")[0]


_STORE_LIBRARIES = {"aiohttp", "asyncio", "fsspec", "s3fs", "gcsfs", "adlfs", "botocore"}


class StoreFile:
    """An object's file as its store library opened it, whose failures are OSErrors
    (_store_call): pyarrow and the readers take it as a local file."""

    def __init__(self, f: Any, name: str) -> None:
        self._f, self.name = f, name

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        """_store_call; a request the server refused because the object is no longer the
        one opened (412 to If-Match / If-Unmodified-Since) is InputChanged."""
        try:
            return _store_call(method, *args)
        except OSError as exc:
            if http_status(exc) == 412:
                raise InputChanged(self.name, "its ETag or modified time differs") from exc
            raise

    def read(self, size: int = -1) -> bytes:
        """`size` bytes, fewer only at the object's end: a server may answer a range request
        with fewer bytes than asked (a correct 206), and a reader (pyarrow) takes a short read
        for the end of the file."""
        data = self._call(self._f.read, size)
        if size is None or size < 0 or len(data) in (0, size):
            return data
        parts = [data]
        missing = size - len(data)
        while missing > 0 and (more := self._call(self._f.read, missing)):
            parts.append(more)
            missing -= len(more)
        return b"".join(parts)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer)[: len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        """One line (a read of up to LINE_READ_BYTES at a time: fsspec's own readline reads a
        whole block, megabytes, for each line)."""
        return self._call(self._f.readuntil, b"\n", LINE_READ_BYTES)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._call(self._f.seek, offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def __getattr__(self, name: str) -> Any:  # closed, seekable, size, ...
        return getattr(self._f, name)

    def __iter__(self) -> Iterator[bytes]:
        """Its lines from where it is on, through a buffer of LINES_BUFFER_BYTES (each line's
        cost is the same however long the file); the file's position is then past them."""
        yield from io.BufferedReader(_RawStoreFile(self), LINES_BUFFER_BYTES)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> StoreFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RawStoreFile(io.RawIOBase):
    """A StoreFile as the raw file under an io.BufferedReader (its close leaves it open)."""

    def __init__(self, f: StoreFile) -> None:
        super().__init__()
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._f.readinto(buffer)


class ObjectPath:
    """A key (or prefix) on an object store; `key` = "bucket/folder/name", no scheme (for
    http(s): "host/path?query")."""

    def __init__(self, fs: Any, scheme: str, key: str) -> None:
        self.fs, self.scheme, self.key = fs, scheme, key

    @property
    def fs_path(self) -> str:
        """What the filesystem library is given: the key, or the whole URL for http(s)."""
        return str(self) if self.scheme in URL_SCHEMES else self.key

    @property
    def _pure(self) -> PurePosixPath:
        """The key as a path: an http(s) URL's without its query string and fragment (a
        presigned URL's signature is no part of its name)."""
        if self.scheme in URL_SCHEMES:
            return PurePosixPath(self.key.split("#", 1)[0].split("?", 1)[0])
        return PurePosixPath(self.key)

    def _listed(self, path: str) -> ObjectPath:
        """A path the filesystem listed (a whole URL for http(s)) as an ObjectPath."""
        match = _URL.match(path) if self.scheme in URL_SCHEMES else None
        return ObjectPath(self.fs, self.scheme, (match.group(2) if match else path).rstrip("/"))

    # -- pure path ---------------------------------------------------------------------------

    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: ObjectPath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.fs, self.scheme, f"{self.key}/{name}")

    @property
    def name(self) -> str:
        return self._pure.name

    @property
    def suffix(self) -> str:
        return self._pure.suffix

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.fs, self.scheme, str(self._pure.parent))

    @property
    def bucket(self) -> str:
        return self.key.split("/", 1)[0]

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def relative_to(self, other: ObjectPath) -> PurePosixPath:
        return self._pure.relative_to(other._pure)

    def resolve(self) -> ObjectPath:
        return self

    def expanduser(self) -> ObjectPath:
        return self

    def as_posix(self) -> str:
        return str(self)

    # -- the store ---------------------------------------------------------------------------

    def open(self, mode: str = "rb", pinned: Pin | None = None) -> IO[bytes]:
        """pinned: the object as first seen: InputChanged when it is another now; over
        http(s), every range request is conditional on its ETag (or Last-Modified), so a change
        while it is read is refused too."""
        if mode != "rb":
            raise ValueError(f"ObjectPath.open({mode!r}): objects are written whole (write_whole)")
        # http(s): fsspec's default cache takes a range answered short (a correct 206 of fewer
        # bytes than asked) for the whole block; its read-ahead cache keeps what came
        options: dict[str, Any] = {"cache_type": "readahead"} if self.scheme in URL_SCHEMES else {}
        if STORE_BLOCK_BYTES is not None:
            options["block_size"] = STORE_BLOCK_BYTES
        if pinned is None:
            return StoreFile(_store_call(self.fs.open, self.fs_path, "rb", **options), str(self))
        size = dict(check_pinned(self, pinned))["size"]
        if size == 0:  # nothing to read (fsspec's http opens a stream that cannot seek)
            return StoreFile(io.BytesIO(), pinned.name)
        if size is not None:
            options["size"] = size
        if self.scheme in URL_SCHEMES and (headers := _conditions(pinned.identity)):
            options["headers"] = headers
        return StoreFile(_store_call(self.fs.open, self.fs_path, "rb", **options), pinned.name)

    def read_bytes(self) -> bytes:
        return _store_call(self.fs.cat_file, self.fs_path)

    def check_ranges(self) -> None:
        """OSError (one line) unless the store serves this object by byte ranges: one byte
        read by a range request of its own (the second byte: a server that ignores Range
        answers with the whole file, refused before its body is read)."""
        opened = _store_call(self.fs.open, self.fs_path, "rb", block_size=2, cache_type="none")
        with StoreFile(opened, str(self)) as f:
            f.seek(1)
            f.read(1)

    def exists(self) -> bool:
        return self.fs.exists(self.fs_path)

    def is_file(self) -> bool:
        return self.fs.isfile(self.fs_path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.fs_path)

    def stat(self) -> Stat:
        return Stat(self.fs.size(self.fs_path))

    def info(self) -> dict[str, Any]:
        return self.fs.info(self.fs_path)

    def iterdir(self) -> Iterator[ObjectPath]:
        """What the prefix holds one level down (objects and sub-prefixes)."""
        for key in self._ls():
            yield self._listed(key)

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """Objects directly under this prefix whose name matches (no '/' in `pattern`)."""
        for child in self.iterdir():
            if fnmatch.fnmatchcase(child.name, pattern):
                yield child

    def rglob(self, pattern: str) -> Iterator[ObjectPath]:
        """Every object below this prefix whose name matches."""
        for found in sorted(self.fs.find(self.fs_path)):
            path = self._listed(found)
            if fnmatch.fnmatchcase(path.name, pattern):
                yield path

    def _ls(self) -> list[str]:
        """The keys one level down, without the prefix's own folder marker (the empty
        `name/` object a store's console makes for a folder: the folder, not a file in it)."""
        try:
            listed = self.fs.ls(self.fs_path, detail=False)
        except FileNotFoundError:
            return []
        own = self.fs_path.rstrip("/")
        return [key for key in listed if key.rstrip("/") != own]

    def unlink(self, missing_ok: bool = False) -> None:
        if not missing_ok and not self.fs.exists(self.fs_path):
            raise FileNotFoundError(str(self))
        self.fs.rm_file(self.fs_path)

    def rename(self, target: ObjectPath) -> ObjectPath:
        """Copy, then delete (a store has no rename): a kill between leaves both."""
        self.fs.mv(self.fs_path, target.fs_path)
        return target

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: a prefix exists once an object is under it."""

    def rmdir(self) -> None:
        """Nothing to do: a prefix with no object under it is gone."""

    def write_whole(self, write: Callable[[IO[bytes]], Any], **conditions: str) -> Any:
        """write(f) into a local spool, then one upload -> write's result. The object becomes
        visible whole (one PUT, or a multipart upload completed last) or not at all.
        conditions: S3 preconditions of the PUT (IfNoneMatch="*", IfMatch=etag)."""
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
            result = write(spool)
            size = spool.tell()
            spool.seek(0)
            if size <= SPOOL_BYTES:
                self.fs.pipe_file(self.fs_path, spool.read(), **conditions)
                return result
            with tempfile.NamedTemporaryFile(prefix=".batchgen-upload-") as local:
                shutil.copyfileobj(spool, local)
                local.flush()
                self.fs.put_file(local.name, self.fs_path, **conditions)
        return result

    def abort_uploads(self) -> int:
        """Abort multipart uploads under this prefix a killed writer never completed (they
        are invisible, but hold storage) -> how many."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return 0
        folder = self.key.partition("/")[2]  # "" at the bucket's root: every upload in it
        prefix = f"{folder}/" if folder else ""
        try:
            uploads = self.fs.list_multipart_uploads(self.bucket)
        except PermissionError:  # credentials without s3:ListBucketMultipartUploads: such
            return 0  # uploads (never readable, never results) stay to the bucket's lifecycle
        mine = [u for u in uploads if u["Key"].startswith(prefix)]
        for upload in mine:
            self.fs.abort_mpu(self.bucket, upload["Key"], upload["UploadId"])
        return len(mine)


@contextlib.contextmanager
def arrow_file(path: AnyPath, pinned: Pin | None = None) -> Iterator[Any]:
    """What pyarrow reads `path` from: a local file opened here (Arrow's own file: a path
    string would be read as a URI where its first part holds a ':', "S3:" or "rel-10:30"), an
    object through its store's file (random access by range requests). pinned: the file as
    first seen: InputChanged when it is another now (check_pinned)."""
    if is_object(path):
        with path.open("rb", pinned) as f:
            yield f
    else:
        import pyarrow as pa  # here: the spec loader imports this module, and needs no Arrow

        if pinned is not None:
            check_pinned(path, pinned)
        with pa.OSFile(os.fspath(path), "rb") as f:
            yield f


@contextlib.contextmanager
def open_pinned(path: AnyPath, pinned: Pin | None) -> Iterator[IO[bytes]]:
    """path.open("rb"), InputChanged first when pinned (the file as first seen) and the file
    is another now (check_pinned)."""
    if is_object(path):
        with path.open("rb", pinned) as f:
            yield f
        return
    if pinned is not None:
        check_pinned(path, pinned)
    with path.open("rb") as f:
        yield f


def abort_uploads(folder: AnyPath) -> int:
    """Incomplete uploads under an output folder removed -> how many (none on a local disk:
    its temp files are the layout's, removed by name)."""
    return folder.abort_uploads() if is_object(folder) else 0


def common_folder(paths: list[AnyPath]) -> AnyPath:
    """The deepest folder holding every path (all local, or all on one store)."""
    if is_object(paths[0]):
        key = os.path.commonpath([p.parent.key for p in paths])
        return ObjectPath(paths[0].fs, paths[0].scheme, key)
    return Path(os.path.commonpath([p.parent for p in paths]))


def store_error(exc: BaseException, path: AnyPath, doing: str) -> BatchgenError:
    """A store library's failure as one line: what failed, and what to do. `doing`: e.g.
    "reading", "writing". The library's text carries no credentials (never the secret)."""
    kind = type(exc).__name__
    lines = str(exc).strip().splitlines()
    reason = (lines[0] if lines else kind)[:200]
    s3 = is_object(path) and path.scheme == "s3"
    creds = (
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials"
        if s3
        else "the store's usual credentials"
    )
    if isinstance(exc, FileNotFoundError) and "bucket" in reason.lower():
        bucket = path.bucket if is_object(path) else "?"
        error = f"bucket '{bucket}' does not exist ({path}): create it, or fix the URL"
    elif isinstance(exc, PermissionError) or "Credentials" in kind:
        error = f"{doing} {path} was refused ({reason}): check the credentials ({creds})"
    elif isinstance(exc, FileNotFoundError):
        error = f"{path} does not exist: check the path"
    elif "Connect" in kind or isinstance(exc, ConnectionError):
        endpoint = " (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)" if s3 else ""
        error = f"cannot reach the store of {path} ({reason}): check the endpoint{endpoint}"
    else:
        error = f"{doing} {path} failed ({kind}: {reason})"
    out = BatchgenError(error)
    out.__cause__ = exc
    return out
