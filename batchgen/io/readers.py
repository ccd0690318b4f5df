"""Input readers: stream rows from Parquet, JSONL, a save_to_disk folder or a hub dataset.

Nothing here reads a whole input: Parquet goes record batch by record batch, JSONL line by
line, saved datasets through their memory map. A problem with the input as a whole (missing
path, corrupt Parquet) raises BatchgenError from `open_input`; a bad JSONL line becomes a
RawRow with `values=None` and an `error`, and the job goes on.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import glob
import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError, check_field
from batchgen.io import rank_reads  # one rank's rows; it reads through this module's helpers
from batchgen.io.arrow_values import check_exact, narrowed, python_rows_or_errors
from batchgen.io.fs import (
    InputChanged,
    Pin,
    StoreFailure,
    arrow_file,
    check_pinned,
    common_folder,
    identity,
    is_object,
    open_pinned,
    reads_are_conditional,
    scheme_of,
    sha256_of,
    store_error,
)
from batchgen.io.input_names import (
    SAVED_DATASET_MARKERS,
    check_not_compressed,
    folder_skips,
    glob_skips,
    read_order,
    saved_dataset_on_a_store,
)
from batchgen.io.output_schema import common_type
from batchgen.io.remote_input import find_objects
from batchgen.json_text import parse_json

if TYPE_CHECKING:
    from batchgen.row_share import RankRows

OPENAI_BATCH = "openai-batch"  # request lines, read by batchgen.formats.openai_batch
FORMATS = ("auto", "parquet", "jsonl", "arrow", "hub", OPENAI_BATCH)
DEFAULT_SPLIT = "train"
EXTENSIONS = {".parquet": "parquet", ".pq": "parquet"} | dict.fromkeys(
    (".jsonl", ".json", ".ndjson"), "jsonl"
)
SCHEMA_SAMPLE_LINES = 100  # JSONL columns = union of keys of this many parseable lines
COUNT_CHUNK_BYTES = 1 << 20  # JSONL files are counted (and sniffed) in chunks of this size
PARQUET_BUFFER_BYTES = 1 << 20  # column chunks are read through a buffer of this size
MAX_REASON_CHARS = 300  # an underlying exception's text, cut to keep messages one line

_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # UTF-32 LE starts with the UTF-16 LE mark
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # name or owner/name
# what a compressed file begins with -> its kind (binary: no JSON Lines text begins so)
_COMPRESSED_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"PK\x03\x04", "zip"),
)
_BZIP2_BLOCK = b"\x31\x41\x59\x26\x53\x59"  # after "BZh" and the block size digit
_FILE_SUFFIXES = {*EXTENSIONS, ".txt", ".csv", ".tsv", ".arrow", ".gz", ".zst", ".xz"}
_BLANK_LINE = re.compile(rb"^[ \t\r\x0b\x0c]*\n", re.MULTILINE)  # the bytes.strip() set
_BLANK_AFTER_FIRST = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number"}

Values = dict[str, Any]
Parsed = tuple[Values | None, str | None]  # (values, None) or (None, error)
RowReader = Callable[[list[str] | None], Iterator[Parsed]]  # columns -> rows in input order
# (columns, id column, a rank's rows) -> every row in input order: the rank's whole, the
# others with their id alone (batchgen/io/rank_reads.py)
RankReader = Callable[[list[str] | None, str | None, "RankRows"], Iterator[Parsed]]


@dataclass(frozen=True)
class InputConfig:
    """Where the prompts come from."""

    path: str  # a file, a glob, a folder of files, a save_to_disk folder, or a hub dataset name
    format: str = "auto"  # auto | parquet | jsonl | arrow (save_to_disk) | hub | openai-batch
    # for save_to_disk DatasetDict folders and hub datasets; another name on an input without
    # splits is refused, never ignored
    split: str = DEFAULT_SPLIT
    batch_rows: int = 1024  # rows per record batch

    def __post_init__(self) -> None:
        path_ok = isinstance(self.path, str) and bool(self.path.strip())
        check_field(path_ok, "path", self.path, "a file, folder, glob or hub dataset name")
        check_field(self.format in FORMATS, "format", self.format, f"one of {', '.join(FORMATS)}")
        check_field(bool(self.split), "split", self.split, "a split name such as 'train'")
        batch_ok = isinstance(self.batch_rows, int) and self.batch_rows >= 1
        check_field(batch_ok, "batch_rows", self.batch_rows, "an integer >= 1")


class RawRow(NamedTuple):
    """One input row, before any prompt handling."""

    index: int  # 0-based position in the whole input stream (across files, in sorted order)
    values: Values | None  # the row's columns; None when the row could not be parsed
    error: str | None  # why not, e.g. "data.jsonl line 17: malformed JSON: ..."


Fingerprint = dict[str, Any]  # identifies the input's content; see fingerprint_files


@dataclass(frozen=True)
class InputSource:
    """An opened input: what is known up front, and a way to stream its rows."""

    columns: list[str] | None  # column names known before any model work; None = unknown
    num_rows: int | None  # rows in the input when cheaply known, else None
    description: str  # e.g. "3 parquet files under data/"
    batch_rows: int
    read_rows: RowReader = field(repr=False)
    # the content's identity (computed on demand); None = the source has none up front, so
    # a resume checks each committed row's hash instead
    fingerprint: Callable[[], Fingerprint | None] = field(repr=False, default=lambda: None)
    types: dict[str, pa.DataType] = field(default_factory=dict)  # declared column types
    # declared types some values may not fit: Arrow's promotion of the files' disagreeing types
    promoted: frozenset[str] = frozenset()
    files: tuple[Path, ...] = ()  # local files the input reads
    sampled: bool = False  # columns were read off the first rows (JSONL), not a schema
    # sampled: of the names given, those some row may have as a key (a pass over the files)
    mentions: Callable[[list[str]], set[str]] | None = field(repr=False, default=None)
    read_rank: RankReader | None = field(repr=False, default=None)  # None: read every row
    nanosecond_times: bool = False  # time64[ns] (and similar) columns read as Nanos, else refused

    def batches(self, columns: list[str] | None = None) -> Iterator[list[RawRow]]:
        """Stream lists of up to batch_rows rows in input order.

        columns: give each parsed row exactly these keys (absent ones are None); None = all.
        """
        return self._batched(self.read_rows(columns))

    def rank_batches(
        self, columns: list[str] | None, id_column: str | None, rows: RankRows
    ) -> Iterator[list[RawRow]]:
        """batches(columns), but a row that `rows` does not read whole comes with its id
        alone ({id_column: value}; {} without an id column) where the format allows (Parquet
        row groups, JSONL lines); other formats give every row whole."""
        if self.read_rank is None:
            return self.batches(columns)
        return self._batched(self.read_rank(columns, id_column, rows))

    def _batched(self, parsed: Iterator[Parsed]) -> Iterator[list[RawRow]]:
        batch: list[RawRow] = []
        for index, (values, error) in enumerate(parsed):
            batch.append(RawRow(index, values, error))
            if len(batch) == self.batch_rows:
                yield batch
                batch = []
        if batch:
            yield batch


def open_input(config: InputConfig) -> InputSource:
    """Open the input named by `config`; raises BatchgenError for a job-level problem."""
    local = Path(config.path).expanduser()
    if config.format == "hub":
        return _open_hub(config)
    is_saved = local.is_dir() and any((local / m).is_file() for m in SAVED_DATASET_MARKERS)
    if config.format == "arrow" or (config.format == "auto" and is_saved):
        return _open_saved(config)
    files = find_files(config)
    if files is None:  # not a local path, but shaped like a hub dataset name
        return _open_hub(config)
    check_no_split(config, "its files have")
    fmt = _format_of(files, config.path) if config.format == "auto" else config.format
    return (_open_parquet if fmt == "parquet" else _open_jsonl)(files, config)


def check_no_split(config: InputConfig, what: str) -> None:
    """BatchgenError where the job names a split (input.split other than the default) of an
    input that has none (`what` has no splits): its rows would not be that split's."""
    if config.split != DEFAULT_SPLIT:
        raise BatchgenError(
            f"input.split = {config.split!r}, but {what} no splits (only a datasets."
            "save_to_disk DatasetDict folder or a hub dataset has): remove input.split"
        )


def dataset_source(ds: Any, batch_rows: int, description: str) -> InputSource:
    """An InputSource over an in-process datasets Dataset or IterableDataset."""
    num_rows = len(ds) if hasattr(ds, "__len__") else None
    reader = partial(_dataset_rows, ds, batch_rows, description)
    return InputSource(
        ds.column_names,
        num_rows,
        description,
        batch_rows,
        reader,
        fingerprint=partial(_dataset_fingerprint, ds),
        types=_dataset_types(ds),
    )


def _dataset_fingerprint(ds: Any) -> Fingerprint | None:
    """A Dataset's own fingerprint (its data and every transform); an IterableDataset has
    none (None: rows are checked one by one on resume)."""
    value = getattr(ds, "_fingerprint", None)
    return {"kind": "dataset", "fingerprint": value} if value else None


def _dataset_types(ds: Any) -> dict[str, pa.DataType]:
    features = getattr(ds, "features", None)
    if features is None:
        return {}
    schema = features.arrow_schema
    return {name: schema.field(name).type for name in schema.names}


def fingerprint_files(
    files: list[tuple[Path, str]],
    digests: list[str] | None = None,
    pins: list[Pin] | None = None,
) -> Fingerprint:
    """Name (relative to the files' common folder), size and SHA-256 of every file, in read
    order. digests: already computed SHA-256 values, in the same order; else each file is
    hashed here, and must still be the file its pin was taken of when opened (its pin then
    holds the digest)."""
    paths = [path.resolve() for path, _ in files]
    root = common_folder(paths)
    entries = []
    for i, path in enumerate(paths):
        pinned = None if pins is None else pins[i]
        digest = digests[i] if digests is not None else _sha256(path, pinned)
        size = path.stat().st_size
        entries.append({"name": path.relative_to(root).as_posix(), "size": size, "sha256": digest})
    return {"kind": "files", "files": entries}


def _sha256(path: Path, pinned: Pin | None = None) -> str:
    """The file's SHA-256; pinned: the file as first seen, which must still be the one hashed
    (its pin then holds the digest: a later look that finds its identity alone changed
    compares the bytes with it)."""
    try:
        with open_pinned(path, pinned) as f:
            digest = sha256_of(f, COUNT_CHUNK_BYTES)
        if pinned is not None:
            check_pinned(path, pinned)  # the hash is of the file the rows are read from
            pinned.sha256 = digest
    except OSError as exc:
        raise unreadable(exc, path, str(path)) from exc
    return digest


def find_files(config: InputConfig) -> list[tuple[Path, str]] | None:
    """[(path, name used in messages)] in read order; None = try the hub instead."""
    raw = config.path
    path = Path(raw).expanduser()
    if scheme_of(raw):
        fmt = "jsonl" if config.format == OPENAI_BATCH else config.format
        return find_objects(raw, {ext for ext, kind in EXTENSIONS.items() if fmt in ("auto", kind)})
    if glob.has_magic(raw):
        pattern = str(path)
        matches = sorted(
            m
            for m in glob.glob(pattern, recursive=True, include_hidden=True)
            if not glob_skips(pattern, m) and Path(m).is_file()
        )
        if not matches:
            raise BatchgenError(f"no files match {raw!r}: check the pattern")
        return [(Path(m), m) for m in matches]
    if path.is_file():
        return [(path, raw)]
    if path.is_dir():
        fmt = "jsonl" if config.format == OPENAI_BATCH else config.format
        wanted = {ext for ext, kind in EXTENSIONS.items() if fmt in ("auto", kind)}
        found = [p for p in path.rglob("*") if not folder_skips(p.relative_to(path))]
        for p in found:
            check_not_compressed(p.relative_to(path).as_posix(), wanted)
        files = sorted(
            (p for p in found if p.suffix.lower() in wanted and p.is_file()),
            key=lambda p: read_order(p.relative_to(path)),
        )
        if not files:
            raise BatchgenError(
                f"folder {raw!r} holds no {'/'.join(sorted(wanted))} files: give a data file, "
                "a folder of them, a glob, or a datasets.save_to_disk folder"
            )
        return [(p, p.relative_to(path).as_posix()) for p in files]
    suffix = path.suffix.lower()
    looks_hub = (
        bool(_HUB_NAME.match(raw)) and suffix not in _FILE_SUFFIXES and ("/" in raw or not suffix)
    )
    if config.format == "auto" and looks_hub:
        return None
    raise BatchgenError(f"input {raw!r} does not exist: check the path")


def _format_of(files: list[tuple[Path, str]], raw: str) -> str:
    unknown = [name for path, name in files if path.suffix.lower() not in EXTENSIONS]
    for name in unknown:
        check_not_compressed(name, EXTENSIONS)
    if unknown:
        raise BatchgenError(
            f"cannot tell the format of {unknown[0]!r} from its extension: rename it to "
            f"{'/'.join(EXTENSIONS)}, or set the input format to parquet or jsonl"
        )
    kinds = {EXTENSIONS[path.suffix.lower()] for path, _ in files}
    if len(kinds) > 1:
        raise BatchgenError(f"{raw!r} mixes parquet and jsonl files: point at one kind only")
    return kinds.pop()


def describe_files(files: list[tuple[Path, str]], kind: str, raw: str) -> str:
    if len(files) == 1 and files[0][1] == raw:
        return f"{kind} file {raw}"
    where = "matching" if glob.has_magic(raw) else "under"
    return f"{len(files)} {kind} file{'s' if len(files) > 1 else ''} {where} {raw}"


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text[:MAX_REASON_CHARS]


def project(values: Values, columns: list[str] | None) -> Values:
    return values if columns is None else {c: values.get(c) for c in columns}


def _open_parquet(files: list[tuple[Path, str]], config: InputConfig) -> InputSource:
    columns: dict[str, None] = {}  # ordered union of the files' column names
    types: dict[str, set[pa.DataType]] = {}  # each column's types across the files
    num_rows = 0
    pins = []  # every later open checks that the file is still this one
    for path, name in files:
        try:  # reads only the footer: catches non-parquet and truncated files up front
            pins.append(Pin(name, identity(path)))
            with arrow_file(path, pins[-1]) as f:
                meta = pq.read_metadata(f)
        except (pa.ArrowException, OSError) as exc:
            damaged = f"cannot read parquet file {name!r} ({_reason(exc)}): replace or remove it"
            raise parquet_failure(exc, name, damaged) from exc
        num_rows += meta.num_rows
        try:
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as exc:
            raise BatchgenError(
                f"cannot read the schema of parquet file {name!r} ({_reason(exc)}): "
                "flatten or replace it"
            ) from exc
        twice = next((n for i, n in enumerate(schema.names) if n in schema.names[:i]), None)
        if twice is not None:  # a reader by name would take one of them silently
            raise BatchgenError(
                f"parquet file {name!r} has two columns named {twice!r}: rename one of them"
            )
        columns.update(dict.fromkeys(schema.names))
        for f in schema:
            types.setdefault(f.name, set()).add(f.type)
    description = describe_files(files, "parquet", config.path)
    reader = partial(_parquet_rows, files, pins, config.batch_rows)
    return InputSource(
        list(columns),
        num_rows,
        description,
        config.batch_rows,
        reader,
        fingerprint=functools.cache(partial(fingerprint_files, files, None, pins)),
        types=(declared := _declared_types(types)),
        promoted=frozenset(name for name in declared if len(types[name]) > 1),
        files=tuple(path for path, _ in files),
        read_rank=partial(rank_reads.parquet_rank_rows, files, pins, config.batch_rows),
        nanosecond_times=True,
    )


def _declared_types(types: dict[str, set[pa.DataType]]) -> dict[str, pa.DataType]:
    """Each column's type across files: its one type, or the type Arrow promotes the files'
    types to (int32 and int64: int64); a column whose types have none is left undeclared
    (its values' types are inferred). The writer stores a value in a promoted type only where
    it reads back unchanged."""
    declared = {}
    for name, kinds in types.items():
        if (common := common_type(name, kinds)) is not None:
            declared[name] = common
    return declared


def _parquet_rows(
    files: list[tuple[Path, str]],
    pins: list[Pin],
    batch_rows: int,
    columns: list[str] | None,
) -> Iterator[Parsed]:
    for (path, name), pin in zip(files, pins, strict=True):
        try:
            # pre_buffer (on by default) would read a whole row group's column chunks at once
            with (
                arrow_file(path, pin) as f,
                pq.ParquetFile(f, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False) as pf,
            ):
                names = pf.schema_arrow.names
                # read one column even when no wanted one is present, so rows still count
                read = None if columns is None else [c for c in columns if c in names] or names[:1]
                batches = pf.iter_batches(batch_rows, columns=read, use_threads=False)
                for batch in batches:
                    still_scanned(path, pin)
                    for values, error in python_rows_or_errors(batch):
                        yield (None if values is None else project(values, columns)), error
        except (pa.ArrowException, OSError) as exc:
            damaged = f"parquet file {name!r} is damaged ({_reason(exc)}): replace it and run again"
            raise parquet_failure(exc, name, damaged, path, pin) from exc


def unreadable(exc: OSError, path: Path, name: str) -> BatchgenError:
    """A file that cannot be read, as one line: a store's refusal names the object and the
    credentials to check; anything else the file."""
    if isinstance(exc, PermissionError) and is_object(path):
        return store_error(exc, path, "reading")
    return BatchgenError(f"cannot read {name!r} ({_reason(exc)}): check the file")


def parquet_failure(
    exc: BaseException, name: str, damaged: str, path: Path | None = None, pin: Pin | None = None
) -> BatchgenError:
    """A Parquet read's failure as one line: its store's (a broken transfer, a refusal: the
    store's own line, what to do), the file's change since it was scanned (path and pin: a
    file rewritten in place fails to parse mid-read), or else its content (`damaged`)."""
    if isinstance(exc, StoreFailure):
        return BatchgenError(f"reading {name!r} failed: {exc}")
    if path is not None and pin is not None:
        try:
            still_scanned(path, pin)
        except InputChanged as changed:
            return changed
        except Exception:  # cannot tell: the read's own failure says it
            pass
    return BatchgenError(damaged)


def still_scanned(path: Path, pin: Pin) -> None:
    """InputChanged when a file read through an open file is no longer the one scanned
    (rewritten while read), called once a batch is read and before its rows are given: a local
    file's is one stat (unless only its identity changed: check_pinned), an object's one HEAD,
    except where the store refuses every read of another version (http(s) range requests
    conditional on its ETag or Last-Modified)."""
    if not reads_are_conditional(path, pin.identity):
        check_pinned(path, pin)


def _open_jsonl(files: list[tuple[Path, str]], config: InputConfig) -> InputSource:
    scans = [scan_jsonl(path, name) for path, name in files]
    columns = _sample_columns(files[0][0])
    description = describe_files(files, "jsonl", config.path)
    reader = partial(_jsonl_rows, files, scans)
    source = jsonl_source(files, scans, columns, description, config, reader)
    read_rank = partial(rank_reads.jsonl_rank_rows, files, scans)
    mentions = partial(jsonl_mentions, [path for path, _ in files])
    return dataclasses.replace(source, read_rank=read_rank, mentions=mentions)


def jsonl_mentions(paths: list[Path], names: list[str]) -> set[str]:
    """The names whose JSON string appears somewhere in the files' bytes: a name not among
    them is no line's key. Each name is looked for as JSON writers spell it (UTF-8 or \\u
    escapes in either case, / or \\/); only a key that escapes plain ASCII letters would be
    missed, and no JSON writer writes that."""
    spellings = {name: _json_spellings(name) for name in names}
    longest = max((len(s) for forms in spellings.values() for s in forms), default=0)
    found: set[str] = set()
    for path in paths:
        try:
            with path.open("rb") as f:
                tail = b""
                while len(found) < len(names) and (chunk := f.read(COUNT_CHUNK_BYTES)):
                    window = tail + chunk
                    for name, forms in spellings.items():
                        if name not in found and any(form in window for form in forms):
                            found.add(name)
                    tail = window[-longest:]
        except OSError as exc:
            raise unreadable(exc, path, str(path)) from exc
    return found


def _json_spellings(name: str) -> set[bytes]:
    forms = {json.dumps(name, ensure_ascii=False), json.dumps(name)}
    forms |= {re.sub(r"\\u[0-9a-f]{4}", lambda m: "\\u" + m.group()[2:].upper(), f) for f in forms}
    forms |= {f.replace("/", "\\/") for f in forms}
    return {f.encode("utf-8") for f in forms}


def jsonl_source(
    files: list[tuple[Path, str]],
    scans: list[JsonlScan],
    columns: list[str],
    description: str,
    config: InputConfig,
    reader: RowReader,
) -> InputSource:
    fingerprint = fingerprint_files(files, [scan.sha256 for scan in scans])
    return InputSource(
        columns,
        sum(scan.rows for scan in scans),
        description,
        config.batch_rows,
        reader,
        fingerprint=lambda: fingerprint,
        files=tuple(path for path, _ in files),
        sampled=True,
    )


def _sample_columns(path: Path) -> list[str]:
    """Ordered union of the keys of the first SCHEMA_SAMPLE_LINES parseable lines."""
    columns: dict[str, None] = {}
    sampled = 0
    for _, raw in jsonl_lines(path):
        values, _ = parse_json_line(raw, "")
        if values is not None:
            columns.update(dict.fromkeys(values))
            sampled += 1
            if sampled == SCHEMA_SAMPLE_LINES:
                break
    return list(columns)


class JsonlScan(NamedTuple):
    """What one pass over a JSONL file learns: its rows, its digest, and line marks: (rows
    before, lines before, byte offset) of a line start at each chunk, so a reader can seek
    near a row and still number its lines; and the SHA-256 of the bytes from each mark to the
    next (the last: to the end), so a reader gives no row of bytes the scan did not read
    (these digests, not the file's size, time or ETag, say whether it changed)."""

    rows: int
    sha256: str
    marks: list[tuple[int, int, int]]
    spans: list[str]


def _wide_text(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-16 or UTF-32 text without a BOM: NUL bytes, which
    UTF-8 JSON never holds (a string escapes them), between every character or more (a
    single stray NUL in a line is that line's error, not the file's)."""
    sample = head[:4096]
    return len(sample) >= 8 and sample.count(0) * 4 >= len(sample)


def scan_jsonl(path: Path, name: str) -> JsonlScan:
    """-> rows (non-blank lines), SHA-256 and line marks, over binary chunks; reject a JSON
    document (array, pretty object)."""
    rows = 0
    offset = lines = 0  # of the chunk in the file; lines ended before it
    marks = [(0, 0, 0)]
    digest = hashlib.sha256()
    spans: list[str] = []  # SHA-256 of the bytes between marks
    partial_blank = True  # the unterminated line read so far is whitespace only
    try:
        known = identity(path)
        with path.open("rb") as f:
            head = f.read(COUNT_CHUNK_BYTES)
            packed = _compression_of(head)
            if packed is not None:
                raise BatchgenError(
                    f"{name!r} is {packed}-compressed, not JSON Lines text: batchgen reads jsonl "
                    "files uncompressed: decompress it first"
                )
            if head.startswith(_UTF16_BOMS) or _wide_text(head):
                raise BatchgenError(
                    f"{name!r} is UTF-16 or UTF-32 text, not UTF-8: convert it, e.g. "
                    f"iconv -f UTF-16 -t UTF-8 {name} > data.jsonl"
                )
            if _is_json_document(head):
                raise BatchgenError(
                    f"{name!r} is one JSON document, not JSON Lines (one object per line): "
                    f"convert it, e.g. jq -c '.[]' {name} > data.jsonl"
                )
            f.seek(0)
            bom = f.read(len(_UTF8_BOM)) == _UTF8_BOM  # in no line: jsonl_lines drops it
            offset = f.seek(len(_UTF8_BOM) if bom else 0)
            digest.update(_UTF8_BOM if bom else b"")
            span = hashlib.sha256(_UTF8_BOM if bom else b"")
            while chunk := f.read(COUNT_CHUNK_BYTES):
                digest.update(chunk)
                base, offset = offset, offset + len(chunk)
                first, last = chunk.find(b"\n"), chunk.rfind(b"\n")
                if first < 0:
                    span.update(chunk)
                    partial_blank = partial_blank and not _is_row_line(chunk)
                    continue
                rows += not (partial_blank and not _is_row_line(chunk[:first]))
                body = chunk[first + 1 : last + 1]  # whole lines, each ending in b"\n"
                rows += body.count(b"\n")
                if _BLANK_LINE.match(body) or _BLANK_AFTER_FIRST.search(body):  # rare
                    rows -= len(_BLANK_LINE.findall(body))
                partial_blank = not _is_row_line(chunk[last + 1 :])
                lines += chunk.count(b"\n")
                marks.append((rows, lines, base + last + 1))  # what ended before that byte
                span.update(chunk[: last + 1])
                spans.append(span.hexdigest())
                span = hashlib.sha256(chunk[last + 1 :])
            spans.append(span.hexdigest())
        # the counts and digests are of one content: the file's identity is the same as before
        # the scan, or its bytes hash as the scan's did
        check_pinned(path, Pin(name, known, digest.hexdigest()), stores=True)
    except OSError as exc:
        raise unreadable(exc, path, name) from exc
    return JsonlScan(rows + (not partial_blank), digest.hexdigest(), marks, spans)


def _compression_of(head: bytes) -> str | None:
    """The compression a file beginning with `head` is in, or None."""
    if head.startswith(b"BZh") and head[4:10] == _BZIP2_BLOCK:
        return "bzip2"
    return next((kind for magic, kind in _COMPRESSED_MAGIC if head.startswith(magic)), None)


def _is_json_document(head: bytes) -> bool:
    """Whether a file starting with `head` is one JSON document (a pretty object, an array)
    rather than JSON Lines. A first line that is a whole array with more lines after it is
    JSON Lines with a bad first line (an error row, as any other)."""
    head = head.removeprefix(_UTF8_BOM).lstrip()
    first, _, rest = head.partition(b"\n")
    if first.strip() == b"{":
        return True
    if not head.startswith(b"["):
        return False
    try:
        json.loads(first)
    except ValueError:  # an array over several lines (or not JSON at all: a document anyway)
        return True
    except RecursionError:  # a whole line nested too deeply to parse: a bad line of JSON Lines
        pass
    return not rest.strip()  # an array alone on its line is the whole file


def jsonl_lines(
    path: Path, start: int = 0, lines: int = 0, scan: tuple[str, JsonlScan] | None = None
) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of every non-blank line, from byte `start` on (a line
    start, with `lines` lines before it). scan: (name in messages, the file's scan; start is
    one of its marks): InputChanged rather than any line of bytes the scan did not read (its
    span digests are the check: the file's size, time or ETag are not asked, nor are an
    object's reads conditional on them). BatchgenError (one line) when reading fails midway
    (an object store's transfer)."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            raws = f if scan is None else _as_scanned(f, start, *scan)
            for lineno, raw in enumerate(raws, start=lines + 1):
                line = _line_text(raw, lineno == 1)
                if _is_row_line(line):
                    yield lineno, line
    except StoreFailure as exc:  # its own line says what to do
        raise BatchgenError(f"reading {str(path)!r} failed: {exc}") from exc
    except OSError as exc:
        raise BatchgenError(
            f"reading {str(path)!r} failed ({_reason(exc)}): run again; committed rows are kept"
        ) from exc


def _as_scanned(f: Any, start: int, name: str, scan: JsonlScan) -> Iterator[bytes]:
    """f's lines from byte `start` (a mark's) on; the lines between two marks (the last: to
    the end) are given once their bytes hash as the scan's did, so none of another content is
    ever given (InputChanged instead)."""
    ends = [mark[2] for mark in scan.marks[1:]]
    k = bisect.bisect_left(ends, start + 1)  # the span that starts at `start`
    held: list[bytes] = []
    span, offset = hashlib.sha256(), start
    for raw in f:
        held.append(raw)
        span.update(raw)
        offset += len(raw)
        if k < len(ends) and offset >= ends[k]:
            if offset != ends[k] or span.hexdigest() != scan.spans[k]:
                raise InputChanged(name, "its content differs")
            yield from held
            held, span, k = [], hashlib.sha256(), k + 1
    if k < len(ends) or span.hexdigest() != scan.spans[k]:
        raise InputChanged(name, "its content differs")
    yield from held


def _line_text(raw: bytes, first: bool) -> bytes:
    """A line's bytes as read: the file's first line without its UTF-8 BOM."""
    return raw.removeprefix(_UTF8_BOM) if first else raw


def _is_row_line(text: bytes) -> bool:
    """Whether a line (as _line_text gives it) is a row: anything but whitespace. The scan
    (row counts, line marks) and every reader decide with this one rule."""
    return bool(text.strip())


def _jsonl_rows(
    files: list[tuple[Path, str]], scans: list[JsonlScan], columns: list[str] | None
) -> Iterator[Parsed]:
    for (path, name), scan in zip(files, scans, strict=True):
        for lineno, raw in jsonl_lines(path, scan=(name, scan)):
            values, error = parse_json_line(raw, f"{name} line {lineno}")
            yield (None if values is None else project(values, columns)), error


def parse_json_line(raw: bytes, where: str) -> Parsed:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = raw[exc.start]
        return None, f"{where}: not valid UTF-8 (byte 0x{byte:02x} at column {exc.start + 1})"
    try:  # without its line ending: a column past the line's end would be counted from it
        obj = parse_json(text.rstrip("\r\n"))
    except ValueError as exc:
        return None, f"{where}: malformed JSON: {exc}"
    if not isinstance(obj, dict):
        kind = _JSON_KINDS.get(type(obj)) or json.dumps(obj)  # true, false, null
        return None, f"{where}: expected a JSON object, got {kind}"
    return obj, None


def _import_datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise BatchgenError(
            f"reading {what} needs the 'datasets' package, which is not installed: "
            "pip install datasets, or convert the input to parquet or jsonl"
        ) from exc
    return datasets


def _open_saved(config: InputConfig) -> InputSource:
    raw = config.path
    if scheme_of(raw):
        raise saved_dataset_on_a_store(raw)
    datasets = _import_datasets("a datasets.save_to_disk folder")
    try:
        ds = datasets.load_from_disk(str(Path(raw).expanduser()))  # memory-mapped, not loaded
    except Exception as exc:  # datasets raises many types for a bad folder
        raise BatchgenError(
            f"cannot load {raw!r} as a datasets.save_to_disk folder ({_reason(exc)}): "
            "check the path"
        ) from exc
    note = ""
    if isinstance(ds, datasets.DatasetDict):
        if config.split not in ds:
            raise BatchgenError(
                f"split {config.split!r} is not in {raw!r}: use one of {', '.join(ds)}"
            )
        ds, note = ds[config.split], f" (split {config.split})"
    else:
        check_no_split(config, f"{raw!r} holds one dataset, with")
    if ds.format["type"] is not None:  # saved with set_format: rows would be tensors, arrays
        ds = ds.with_format(None)  # plain Python values, as Parquet and JSONL give
    source = dataset_source(ds, config.batch_rows, f"saved dataset {raw!r}")
    return dataclasses.replace(source, description=f"saved dataset {raw}{note}")


def _open_hub(config: InputConfig) -> InputSource:
    datasets = _import_datasets(f"hub dataset {config.path!r} (or it is a missing local path)")
    name, split = config.path, config.split
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
        columns = ds.column_names or list(next(iter(ds), {}))
    except Exception as exc:  # offline, unknown name, bad split, auth: all end the job here
        raise BatchgenError(
            f"could not load hub dataset {name!r} (is the machine offline? for local data give "
            f"an existing file, folder or glob): {_reason(exc)}"
        ) from exc
    splits = ds.info.splits
    num_rows = splits[split].num_examples if splits and split in splits else None
    reader = partial(_dataset_rows, ds, config.batch_rows, f"hub dataset {name!r}")
    description = f"hub dataset {name} (split {split}, streamed)"
    return InputSource(list(columns), num_rows, description, config.batch_rows, reader)


def _dataset_rows(
    ds: Any, batch_rows: int, what: str, columns: list[str] | None
) -> Iterator[Parsed]:
    """ds: a datasets Dataset (memory-mapped) or IterableDataset (streamed); a hub dataset's
    types, unknown when it was opened, are checked here, before its first row."""
    names = ds.column_names or []
    if columns is not None and names:
        ds = ds.select_columns([c for c in columns if c in names] or names[:1])
    kinds = _dataset_types(ds)
    check_exact(kinds, kinds, nanosecond_times=False)
    try:
        for batch in ds.iter(batch_size=batch_rows):  # batch: {column: [values]}
            keys = list(batch)
            for values in zip(*(batch[k] for k in keys), strict=True):
                row = narrowed(dict(zip(keys, values, strict=True)), kinds)
                yield project(row, columns), None
    except Exception as exc:  # a network drop or a damaged arrow file, mid-stream
        raise BatchgenError(
            f"reading {what} failed ({_reason(exc)}): run again; committed rows are kept"
        ) from exc
