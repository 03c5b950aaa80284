"""Settings declared once: a pydantic dataclass whose fields carry their type, default, constraints (`Field`) and
help (the attribute's docstring); the command-line flags, their help and their checks are generated from it,
and a value that fails its check is a UserError naming the flag (`--block-size: ...`), from the CLI and from
Python alike."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, cast, dataclass_transform

from pydantic import BeforeValidator, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from pagedllm.errors import UserError

T = TypeVar("T")
_SAME = object()  # Flag.cli_default: the field's own default


def _byte_size(value: Any) -> Any:
    """'2GiB', '512MB', '1000' -> bytes (pydantic's ByteSize); ints pass as they are."""
    if not isinstance(value, str):
        return value
    try:
        return int(_BYTE_SIZE.validate_python(value))
    except ValidationError as e:
        raise ValueError(e.errors()[0]["msg"]) from None


_BYTE_SIZE = TypeAdapter(ByteSize)
Bytes = Annotated[int, BeforeValidator(_byte_size)]  # a memory size: an int of bytes, or text such as 2GiB


@dataclasses.dataclass(frozen=True)
class Flag:
    """What a field's flag has besides its type, default and help: `Annotated[int, Flag(short="-q")]`."""

    short: str | None = None  # an alias such as -q
    metavar: str | None = None
    cli_default: Any = _SAME  # the commands' default where it differs from the Python API's


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def user_error(error: ValidationError) -> UserError:
    """The first failed check as one line naming its flag; a UserError raised by the class itself as it is."""
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UserError):
        return cause
    where = flag_name(str(first["loc"][0])) if first["loc"] else "settings"
    message = first["msg"].removeprefix("Value error, ")
    return UserError(f"{where}: {message[:1].lower()}{message[1:]}, got {first['input']!r}")


@dataclass_transform(field_specifiers=(Field,))
def settings(cls: type[T]) -> type[T]:
    """A pydantic dataclass (attribute docstrings become the fields' descriptions) that raises UserError."""
    validated = pydantic_dataclass(cls, config=ConfigDict(use_attribute_docstrings=True, extra="forbid"))
    init = validated.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as e:
            raise user_error(e) from None

    setattr(validated, "__init__", __init__)  # noqa: B010 - mypy refuses assigning a method; errors name the flag
    return cast(type[T], validated)


def _flag(metadata: list[Any]) -> Flag:
    return next((m for m in metadata if isinstance(m, Flag)), Flag())


def _argparse_kind(annotation: Any) -> dict[str, Any]:
    """type / choices / action for argparse from a field's type (pydantic checks the value again)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _argparse_kind(args[0])
    if typing.get_origin(annotation) is typing.Annotated:
        parsed = any(isinstance(m, BeforeValidator) for m in annotation.__metadata__)
        return {} if parsed else _argparse_kind(args[0])  # text pydantic reads (Bytes: 2GiB) stays text
    if typing.get_origin(annotation) is Literal:
        return {"choices": list(args)}
    if typing.get_origin(annotation) is list:
        return {"nargs": "+", **_argparse_kind(args[0])}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float):
        return {"type": annotation}
    return {}  # str, and anything pydantic parses from text


def cli_default(info: Any) -> Any:
    """A field's flag default: its `Flag.cli_default` where it has one, else the field's default."""
    flag = _flag(info.metadata)
    return info.default if flag.cli_default is _SAME else flag.cli_default


def add_flags(group: Any, cls: type, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> None:
    """One flag per field of the settings class `cls` (those in `only`, if given, but not in `skip`): --field-name,
    its help the field's docstring."""
    for name, info in cls.__pydantic_fields__.items():  # type: ignore[attr-defined]
        if name in skip or (only is not None and name not in only):
            continue
        flag = _flag(info.metadata)
        default = cli_default(info)
        names = [flag_name(name)] + ([flag.short] if flag.short else [])
        parsed = any(isinstance(m, BeforeValidator) for m in info.metadata)  # text pydantic reads: stays text
        group.add_argument(
            *names,
            default=default,
            help=info.description,
            metavar=flag.metavar,
            **({} if parsed else _argparse_kind(info.annotation)),
        )


def from_args(cls: Callable[..., T], args: argparse.Namespace) -> T:
    """The settings from parsed flags (those a command has; the others keep their defaults). A flag left at a
    `Flag(cli_default=None)` takes the class's default: None there only says it was not given."""
    fields = cls.__pydantic_fields__  # type: ignore[attr-defined]
    given = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    return cls(**{n: v for n, v in given.items() if v is not None or _flag(fields[n].metadata).cli_default is _SAME})


__all__ = ["Bytes", "Field", "Flag", "add_flags", "cli_default", "flag_name", "from_args", "settings", "user_error"]
