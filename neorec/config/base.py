"""The base of every config section: unknown keys are errors, numbers are never booleans, and every
number fits the tensor it ends up in (int64, finite float32)."""

from __future__ import annotations

import math
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


    @field_validator("*", mode="after")
    @classmethod
    def _numbers_fit(cls, value: Any) -> Any:
        """Every number fits the tensors it ends up in: integers int64, floats finite and float32
        (`lr: 1e300` would be inf there), in lists and mappings too."""
        check_number(value)
        return value


def check_number(value: Any) -> None:
    """ValueError for an integer outside int64 or a float that is not finite or outside float32."""
    from neorec.config.limits import MAX_FLOAT, MAX_INT

    if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_FLOAT):
        raise ValueError(f"expected a finite number within +-{MAX_FLOAT:.3g} (float32)")
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT - 1 <= value <= MAX_INT:
        raise ValueError("expected a whole number within int64 (below 2^63 in magnitude)")
    if isinstance(value, list | tuple):
        for v in value:
            check_number(v)
    elif isinstance(value, dict):
        for v in value.values():
            check_number(v)


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
