"""The base of every config section: unknown keys are errors, and numbers are never booleans."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class NumbersNotBool(BaseModel):
    """pydantic reads `true` as 1 where a number is expected; a config says `epochs: true` by mistake,
    so a field that takes numbers but not booleans rejects them (also inside lists)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        kinds = leaf_types(field.annotation)
        if bool in kinds:
            return value
        if isinstance(value, bool) and (int in kinds or float in kinds):
            raise ValueError("expected a number, not a boolean")
        if isinstance(value, list) and any(isinstance(v, bool) for v in value):
            lists = [k for k in kinds if typing.get_origin(k) is list]
            items = {t for k in lists for t in leaf_types(typing.get_args(k)[0])}
            if bool not in items and (int in items or float in items):
                raise ValueError("expected a list of numbers, not booleans")
        return value


class Strict(NumbersNotBool):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def leaf_types(annotation: Any) -> list[Any]:
    """The members of a type: `int | list[int] | None` -> [int, list[int], NoneType]; Annotated and
    unions are looked through, Literal[...] and generics such as list[int] are kept whole."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return leaf_types(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [leaf for arg in typing.get_args(annotation) for leaf in leaf_types(arg)]
    return [annotation]


def literal_values(annotation: Any) -> list[Any]:
    """The allowed values of the Literal members of a type (empty when it has none)."""
    return [v for k in leaf_types(annotation) if typing.get_origin(k) is Literal for v in typing.get_args(k)]
