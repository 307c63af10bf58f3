"""Walkers over the section models' schema: component sections in raw data and in a validated recipe."""

from __future__ import annotations

import typing
from typing import Annotated, Any

from pydantic import BaseModel

from rlcli.config.spec import ComponentSpec, Kind


def _dotted(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _unwrap(ann: Any) -> tuple[Any, bool]:
    """Return (inner annotation, is_list) for X, X | None, list[X], Annotated[...]."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _unwrap(typing.get_args(ann)[0])
    if origin in (list, tuple) and typing.get_args(ann):
        inner, _ = _unwrap(typing.get_args(ann)[0])
        return inner, True
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return ann, False


def _kind_of(finfo: Any) -> str | None:
    for meta in finfo.metadata:
        if isinstance(meta, Kind):
            return meta.kind
    ann = finfo.annotation
    if typing.get_origin(ann) in (list,):
        (inner,) = typing.get_args(ann)
        if typing.get_origin(inner) is Annotated:
            for meta in typing.get_args(inner)[1:]:
                if isinstance(meta, Kind):
                    return meta.kind
    return None


def _model_class_at(model_cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class that owns the last element of ``loc`` (for did-you-mean hints)."""
    cls: Any = model_cls
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        inner, _ = _unwrap(cls.model_fields[part].annotation)
        cls = inner
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _paths_of_field(model_cls: type[BaseModel], name: str, path: tuple = ()) -> list[str]:
    """Dotted paths of every field called ``name`` in ``model_cls``'s schema (not inside lists), for
    the hint on a key written in the wrong section (``trainer.lr`` -> ``train_worker.optimizer.lr``)."""
    out = []
    for fname, finfo in model_cls.model_fields.items():
        if fname == name:
            out.append(_dotted(path + (fname,)))
        inner, is_list = _unwrap(finfo.annotation)
        if not is_list and isinstance(inner, type) and issubclass(inner, BaseModel):
            out += _paths_of_field(inner, name, path + (fname,))
    return out


def _walk_raw(model_cls: type[BaseModel], raw: Any, path: tuple, out: list) -> None:
    """Find component sections in raw (unvalidated) data by following the schema."""
    if not isinstance(raw, dict):
        return
    for fname, finfo in model_cls.model_fields.items():
        if fname not in raw or raw[fname] is None:
            continue
        val = raw[fname]
        kind = _kind_of(finfo)
        inner, is_list = _unwrap(finfo.annotation)
        if kind is not None:
            if is_list:
                for i, v in enumerate(val if isinstance(val, list) else []):
                    out.append((path + (fname, i), kind, v))
            else:
                out.append((path + (fname,), kind, val))
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            if is_list:
                for i, v in enumerate(val if isinstance(val, list) else []):
                    _walk_raw(inner, v, path + (fname, i), out)
            else:
                _walk_raw(inner, val, path + (fname,), out)


def _collect_specs(obj: Any, path: tuple, out: list) -> None:
    if isinstance(obj, ComponentSpec):
        return
    if isinstance(obj, BaseModel):
        for fname, finfo in type(obj).model_fields.items():
            val = getattr(obj, fname)
            kind = _kind_of(finfo)
            if kind is not None:
                if isinstance(val, list):
                    for i, v in enumerate(val):
                        out.append((_dotted(path + (fname, i)), kind, v))
                elif val is not None:
                    out.append((_dotted(path + (fname,)), kind, val))
            else:
                _collect_specs(val, path + (fname,), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _collect_specs(v, path + (i,), out)


def component_fields(model_cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """Every field of ``model_cls``, and of the models below it, that holds component sections,
    as ``(path, kind)``; ``[]`` marks the items of a list (``tasks[].sampler``)."""
    out: list[tuple[str, str]] = []
    for fname, finfo in model_cls.model_fields.items():
        inner, is_list = _unwrap(finfo.annotation)
        path = prefix + fname + ("[]" if is_list else "")
        kind = _kind_of(finfo)
        if kind is not None:
            out.append((path, kind))
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            out += component_fields(inner, path + ".")
    return out
