"""Python values of Arrow data where Python's own would change them: a float32 keeps its own
shortest text (0.1, not the double's 0.10000000149011612), a time of day (and, without pandas,
a timestamp or duration) its nanoseconds.
Input rows are read from Arrow data through `python_rows`; a column whose values a reader
cannot give exactly is refused before its first row (`check_exact`)."""

from __future__ import annotations

import datetime
import functools
import importlib.util
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy
import pyarrow as pa

from batchgen.errors import BatchgenError

TIME_NS = pa.time64("ns")  # pyarrow cuts it to the microsecond, pandas installed or not
_TYPED_SPEC = tuple("eEfFgGn%")  # the last character of a format spec that names a presentation


class _Narrow(float):
    """A float read from a narrower Arrow type: its value is exact, its text the shortest that
    reads back as the same value of that type (as Arrow, pandas and numpy show it, in Python's
    form), never the double's digits, in a template or an id."""

    __slots__ = ()
    _numpy: ClassVar[type]

    def __repr__(self) -> str:
        if not math.isfinite(self):
            return float.__repr__(self)
        return float.__repr__(float(str(self._numpy(self))))  # numpy's digits, Python's form

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        """A spec that names a presentation (.2f, e) formats the exact value; any other
        (>10, or none) the shortest text."""
        return float.__format__(self if spec.endswith(_TYPED_SPEC) else float(repr(self)), spec)


class Float32(_Narrow):
    __slots__ = ()
    _numpy = numpy.float32


class Float16(_Narrow):
    __slots__ = ()
    _numpy = numpy.float16


NARROW_FLOATS: Mapping[pa.DataType, type[_Narrow]] = {
    pa.float32(): Float32,
    pa.float16(): Float16,
}


@dataclass(frozen=True)
class Nanos:
    """A time of day, timestamp or duration to the nanosecond, which Python's datetime types
    (to the microsecond) cannot hold: Arrow's time64[ns] always, a timestamp[ns] or duration[ns]
    where pandas (whose Timestamp and Timedelta hold them) is not installed."""

    value: int  # nanoseconds: since midnight, since the epoch (UTC), or in all
    type: pa.DataType

    def isoformat(self, sep: str = "T") -> str:
        """ISO 8601, as datetime and pandas write theirs: nine fraction digits where it has
        nanoseconds, six where microseconds hold it, none for whole seconds."""
        if pa.types.is_duration(self.type):
            return iso_duration(self)
        whole = self._micros().replace(microsecond=0)
        if isinstance(whole, datetime.time):
            return whole.isoformat() + _fraction(self.value % 10**9)
        seconds = len(whole.replace(tzinfo=None).isoformat(sep))  # the fraction goes after them
        text = whole.isoformat(sep)
        return text[:seconds] + _fraction(self.value % 10**9) + text[seconds:]

    def __str__(self) -> str:
        return self.isoformat(" ")  # str() of a datetime and of a pandas Timestamp: a space

    def __format__(self, spec: str) -> str:
        """A format spec as datetime takes it (strftime), where it shows no fraction (%f
        would show microseconds alone)."""
        if not spec:
            return str(self)
        if pa.types.is_duration(self.type) or "%f" in spec:
            raise ValueError(
                f"{self} is to the nanosecond: the format spec {spec!r} cannot show it (remove it)"
            )
        return format(self._micros(), spec)

    def _micros(self) -> datetime.datetime | datetime.time:
        """The value to the microsecond below it, as pyarrow gives a microsecond one."""
        unit = pa.time64("us") if pa.types.is_time(self.type) else pa.timestamp("us", self.type.tz)
        return pa.scalar(self.value // 1000, unit).as_py()


def iso_duration(value: datetime.timedelta | Nanos) -> str:
    """A duration in ISO 8601, exact to the nanosecond where it has them (a pandas Timedelta,
    Nanos), in pandas' form (P1DT2H3M4.000005S) with a negative one's sign in front
    (-P0DT0H0M1S)."""
    if isinstance(value, Nanos):
        total = value.value
    else:
        micros = (value.days * 86400 + value.seconds) * 10**6 + value.microseconds
        total = micros * 1000 + getattr(value, "nanoseconds", 0)  # a Timedelta's below a us
    seconds, fraction = divmod(abs(total), 10**9)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    digits = f".{fraction:09}".rstrip("0") if fraction else ""
    return f"{'-' * (total < 0)}P{days}DT{hours}H{minutes}M{seconds}{digits}S"


def _fraction(nanoseconds: int) -> str:
    if nanoseconds % 1000:
        return f".{nanoseconds:09}"
    return f".{nanoseconds // 1000:06}" if nanoseconds else ""


@functools.cache
def _have_pandas() -> bool:
    """Whether pyarrow gives a timestamp[ns] or duration[ns] as pandas' exact values."""
    return importlib.util.find_spec("pandas") is not None


def _inexact(kind: pa.DataType) -> bool:
    """Whether pyarrow's Python value of `kind` would be cut to the microsecond."""
    if kind == TIME_NS:
        return True
    temporal = pa.types.is_timestamp(kind) or pa.types.is_duration(kind)
    return temporal and kind.unit == "ns" and not _have_pandas()


def python_values(array: pa.Array | pa.ChunkedArray) -> list[Any]:
    """array.to_pylist(), but a float32 or float16 as Float32 or Float16, and as Nanos a value
    to_pylist would cut to the microsecond (or refuse to give: see Nanos)."""
    kind = array.type
    if _inexact(kind):
        return [None if v is None else Nanos(v, kind) for v in array.cast(pa.int64()).to_pylist()]
    narrow = NARROW_FLOATS.get(kind)
    if narrow is not None:
        return [None if v is None else narrow(v) for v in array.to_pylist()]
    return array.to_pylist()


def python_rows(batch: pa.RecordBatch | pa.Table) -> list[dict[str, Any]]:
    """batch.to_pylist(), each column's values as `python_values` gives them."""
    if not any(_inexact(kind) or kind in NARROW_FLOATS for kind in batch.schema.types):
        return batch.to_pylist()
    columns = [python_values(column) for column in batch.columns]
    return [dict(zip(batch.schema.names, row, strict=True)) for row in zip(*columns, strict=True)]


def python_rows_or_errors(
    batch: pa.RecordBatch | pa.Table,
) -> list[tuple[dict[str, Any] | None, str | None]]:
    """python_rows as (values, None), but a row holding a string whose bytes are not valid
    UTF-8 (pyarrow reads them from files whose writer did not check, and fails only as they
    become Python) as (None, why), naming its column, as a JSONL line's bad bytes are."""
    try:
        return [(values, None) for values in python_rows(batch)]
    except UnicodeDecodeError:
        pass
    out: list[tuple[dict[str, Any] | None, str | None]] = []
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        try:
            out.append((python_rows(row)[0], None))
        except UnicodeDecodeError:
            out.append((None, _not_utf8(row)))
    return out


def _not_utf8(row: pa.RecordBatch | pa.Table) -> str:
    for name, column in zip(row.schema.names, row.columns, strict=True):
        try:
            python_values(column)
        except UnicodeDecodeError as exc:
            byte = exc.object[exc.start]
            return f"column {name!r} is not valid UTF-8 (byte 0x{byte:02x} at {exc.start + 1})"
    raise AssertionError("a row that failed to decode decodes")  # pragma: no cover


def narrowed(values: dict[str, Any], kinds: Mapping[str, pa.DataType]) -> dict[str, Any]:
    """A row read as plain Python values (a datasets row), a float32 or float16 column's
    value made Float32 or Float16 as `python_values` makes it."""
    for name, kind in kinds.items():
        narrow = NARROW_FLOATS.get(kind)
        if narrow is not None and isinstance(values.get(name), float):
            values[name] = narrow(values[name])
    return values


def arrow_inputs(values: list[Any], kind: pa.DataType) -> list[Any]:
    """values as pa.array takes them into `kind`: a Nanos of that type as its nanoseconds."""
    if getattr(kind, "unit", None) != "ns":
        return values
    return [v.value if isinstance(v, Nanos) and v.type == kind else v for v in values]


def check_exact(
    kinds: Mapping[str, pa.DataType], columns: Iterable[str], nanosecond_times: bool
) -> None:
    """BatchgenError naming the first of `columns` whose values would reach the job cut to the
    microsecond: one inside a list or struct, or a column of an input whose reader gives no
    Nanos (nanosecond_times: it does)."""
    for name in columns:
        kind = kinds.get(name)
        for part, top in [] if kind is None else _parts(kind, top=True):
            if not _inexact(part) or (top and nanosecond_times):
                continue
            if top:
                raise BatchgenError(
                    f"column {name!r} is {part}, whose nanoseconds this input would cut to the "
                    "microsecond: cast it to a microsecond type or to text, or give the input "
                    "as Parquet"
                )
            fix = "" if part == TIME_NS else ", or install pandas"
            raise BatchgenError(
                f"column {name!r} holds {part} inside a list or struct, whose nanoseconds "
                f"would be cut to the microsecond: cast it to a microsecond type or to text{fix}"
            )


def holds_nanoseconds(kind: pa.DataType) -> bool:
    """Whether kind is, or holds at any depth, timestamps or durations in nanoseconds."""
    return any(
        (pa.types.is_timestamp(part) or pa.types.is_duration(part)) and part.unit == "ns"
        for part, _ in _parts(kind, top=True)
    )


def _parts(kind: pa.DataType, top: bool) -> Iterable[tuple[pa.DataType, bool]]:
    """The type and every type inside it, each with whether it is the column's own."""
    yield kind, top
    if isinstance(kind, pa.DictionaryType):
        inner = [kind.value_type]
    elif isinstance(kind, pa.BaseExtensionType):
        inner = [kind.storage_type]
    else:
        inner = [kind.field(i).type for i in range(kind.num_fields)]
    for part in inner:
        yield from _parts(part, top=False)
