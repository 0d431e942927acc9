"""Field selection and renaming: to_tuple, rename, rename_keys, extract_keys, xdecode.

webdataset 1.0.2 semantics: a field spec ``"jpg;png"`` means the first of those present.
Resumption: exact (no buffered state).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from fnmatch import fnmatch
from typing import Any

from cloudshards.handlers import reraise_exception
from cloudshards.stages.base import per_sample, pipelinefilter
from cloudshards.types import ExceptionHandler, Sample

__all__ = [
    "_extract_keys",
    "_rename",
    "_rename_keys",
    "_to_tuple",
    "_xdecode",
    "default_decoders",
    "extract_keys",
    "find_decoder",
    "getfirst",
    "parse_field_spec",
    "rename",
    "rename_keys",
    "to_tuple",
    "transform_with",
    "xdecode",
]


def getfirst(
    a: Sample, keys: str | Sequence[str], default: Any = None, missing_is_error: bool = True
) -> Any:
    """Return the value of the first of ``keys`` (``"a;b"`` or a list) present in ``a``."""
    if isinstance(keys, str):
        if " " in keys:
            raise ValueError(f"field spec {keys!r} must not contain spaces (use ';' between names)")
        keys = keys.split(";")
    for k in keys:
        if k in a:
            return a[k]
    if missing_is_error:
        raise ValueError(f"didn't find {list(keys)} in {list(a.keys())}")
    return default


def parse_field_spec(fields: str | Sequence[str]) -> list[list[str]]:
    """Split ``"jpg;png cls"`` into ``[["jpg", "png"], ["cls"]]``."""
    if isinstance(fields, str):
        fields = fields.split()
    return [f.split(";") for f in fields]


def transform_with(sample: Sequence[Any], transformers: Sequence[Any] | None) -> Any:
    """Apply ``transformers[i]`` to ``sample[i]`` (None entries leave values unchanged)."""
    if not transformers:
        return sample
    if len(transformers) > len(sample):
        raise ValueError("more transformers than sample elements")
    result = list(sample)
    for i, f in enumerate(transformers):
        if f is not None:
            result[i] = f(sample[i])
    return result


@per_sample
def _to_tuple(
    data: Iterable[Sample],
    *args: str,
    handler: ExceptionHandler = reraise_exception,
    missing_is_error: bool = True,
    none_is_error: bool | None = None,
) -> Iterator[tuple[Any, ...]]:
    """Turn dict samples into tuples of the given fields (``"jpg;png"`` picks the first)."""
    if none_is_error is None:
        none_is_error = missing_is_error
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = tuple(args[0].split())
    # Plain field names (the usual case) are looked up directly; anything else, and a sample
    # lacking one of them, goes through getfirst, which gives the same values and errors.
    plain = all(isinstance(f, str) and ";" not in f and " " not in f for f in args)
    for sample in data:
        try:
            result: tuple[Any, ...] | None = None
            if plain and type(sample) is dict:  # a subclass (defaultdict) may answer [] itself
                try:
                    result = tuple([sample[f] for f in args])
                except KeyError:  # getfirst below raises or fills in as the options say
                    result = None
            if result is None:
                result = tuple(getfirst(sample, f, missing_is_error=missing_is_error) for f in args)
            if none_is_error:
                for value in result:  # a loop, not any(genexpr): ~1 us a sample less
                    if value is None:
                        raise ValueError(f"to_tuple {args} got {list(sample.keys())}")
            yield result
        except Exception as exn:
            if handler(exn):
                continue
            break


to_tuple = pipelinefilter(_to_tuple)


@per_sample
def _rename(
    data: Iterable[Sample],
    handler: ExceptionHandler = reraise_exception,
    keep: bool = True,
    **kw: str,
) -> Iterator[Sample]:
    """Rename fields: ``rename(image="jpg;png")`` sets ``image`` from the first present."""
    for sample in data:
        try:
            if not keep:
                yield {k: getfirst(sample, v, missing_is_error=True) for k, v in kw.items()}
                continue
            replaced = {x for v in kw.values() for x in (v.split(";") if isinstance(v, str) else v)}
            result = {k: v for k, v in sample.items() if k not in replaced}
            result.update({k: getfirst(sample, v, missing_is_error=True) for k, v in kw.items()})
            yield result
        except Exception as exn:
            if handler(exn):
                continue
            break


rename = pipelinefilter(_rename)


@per_sample
def _rename_keys(
    source: Iterable[Sample],
    *args: tuple[str, str],
    keep_unselected: bool = False,
    must_match: bool = True,
    duplicate_is_error: bool = True,
    **kw: str,
) -> Iterator[Sample]:
    """Rename fields by glob patterns on their basename: ``rename_keys(image="*.jpg")``."""
    renamings = [(pattern, output) for output, pattern in args]
    renamings += [(pattern, output) for output, pattern in kw.items()]
    for sample in source:
        new_sample: Sample = {}
        matched = {k: False for k, _ in renamings}
        for path, value in sample.items():
            fname = re.sub(".*/", "", path)
            new_name = None
            for pattern, name in renamings[::-1]:
                if fnmatch(fname.lower(), pattern):
                    matched[pattern] = True
                    new_name = name
                    break
            if new_name is None:
                if keep_unselected:
                    new_sample[path] = value
                continue
            if new_name in new_sample:
                if duplicate_is_error:
                    raise ValueError(
                        f"Duplicate value in sample {list(sample.keys())} after rename."
                    )
                continue
            new_sample[new_name] = value
        if must_match and not all(matched.values()):
            raise ValueError(
                f"Not all patterns ({matched}) matched sample keys ({list(sample.keys())})."
            )
        yield new_sample


rename_keys = pipelinefilter(_rename_keys)


@per_sample
def _extract_keys(
    source: Iterable[Sample],
    *patterns: str | Sequence[str],
    duplicate_is_error: bool = True,
    ignore_missing: bool = False,
) -> Iterator[tuple[Any, ...]]:
    """Turn samples into tuples of the fields matching each glob pattern (``"*.jpg;*.png"``)."""
    for sample in source:
        result = []
        for pattern in patterns:
            alternatives = pattern.split(";") if isinstance(pattern, str) else pattern
            matches = [
                x for x in sample if any(fnmatch("." + x, p) or fnmatch(x, p) for p in alternatives)
            ]
            if not matches:
                if ignore_missing:
                    continue
                raise ValueError(
                    f"Cannot find {alternatives} in sample keys {list(sample.keys())}."
                )
            if len(matches) > 1 and duplicate_is_error:
                raise ValueError(
                    f"Multiple sample keys {list(sample.keys())} match {alternatives}."
                )
            result.append(sample[matches[0]])
        yield tuple(result)


extract_keys = pipelinefilter(_extract_keys)


def _decode_bin(stream: io.BytesIO) -> bytes:
    return stream.read()


def _decode_text(stream: io.BytesIO) -> str:
    return stream.read().decode("utf-8")


# Unlike webdataset, no "*.pyd" unpickler here: unpickling is opt-in (cloudshards.decoders).
default_decoders: list[tuple[str, Callable[[Any], Any]]] = [
    ("*.bin", _decode_bin),
    ("*.txt", _decode_text),
]


def find_decoder(
    decoders: Sequence[tuple[str, Callable[[Any], Any]]], path: str
) -> Callable[[Any], Any] | None:
    """Return the last decoder whose pattern matches ``path``'s basename, or None."""
    fname = re.sub(".*/", "", path)
    if fname.startswith("__"):
        return identity_decoder
    for pattern, fun in decoders[::-1]:
        if fnmatch(fname.lower(), pattern) or fnmatch("." + fname.lower(), pattern):
            return fun
    return None


def identity_decoder(x: Any) -> Any:
    """Return the value unchanged (meta fields)."""
    return x


@per_sample
def _xdecode(
    source: Iterable[Sample],
    *args: tuple[str, Callable[[Any], Any]],
    must_decode: bool = True,
    defaults: Sequence[tuple[str, Callable[[Any], Any]]] = tuple(default_decoders),
    **kw: Callable[[Any], Any],
) -> Iterator[Sample]:
    """Decode fields by glob patterns; decoders receive a binary stream, as in webdataset."""
    decoders = list(defaults) + list(args)
    decoders += [("*." + k, v) for k, v in kw.items()]
    for sample in source:
        new_sample: Sample = {}
        for path, data in sample.items():
            if path.startswith("__"):
                new_sample[path] = data
                continue
            decoder = find_decoder(decoders, path)
            if decoder is None:
                if must_decode:
                    raise ValueError(f"No decoder found for {path}.")
                new_sample[path] = data
                continue
            value = io.BytesIO(data) if isinstance(data, bytes) else data
            new_sample[path] = decoder(value)
        yield new_sample


xdecode = pipelinefilter(_xdecode)
