"""The error type and the pydantic base every gputopo wire model shares."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, ValidationError


class AnnotationError(ValueError):
    """A gputopo annotation or label whose value cannot be used; the message names both."""

    def __init__(self, key: str, value: str, why: str) -> None:
        self.key = key
        self.value = value
        self.why = why
        super().__init__(f"invalid annotation {key}={short_value(value)}: {why}")


def short_value(value: str, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 4] + '…"'


class Wire(BaseModel):
    """Base for wire models: camelCase aliases, both spellings accepted, unknown keys rejected."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)


class LabelError(AnnotationError):
    """A gputopo node label whose value cannot be used; the message names the label and the value."""

    def __init__(self, key: str, value: str, why: str) -> None:
        super().__init__(key, value, why)
        self.args = (f"invalid label {key}={short_value(value)}: {why}",)

    def __str__(self) -> str:
        return str(self.args[0])


def format_validation_error(err: ValidationError) -> str:
    """pydantic's errors as one line for an AnnotationError: the first three, each with its location."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts[:3]) + (f" (and {len(parts) - 3} more)" if len(parts) > 3 else "")
