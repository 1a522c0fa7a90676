"""What a request may send, checked field by field: a body that is not UTF-8 or not JSON, a field
of the wrong type, empty or over-long text, or a value out of the server's limits each becomes a
RequestError with the HTTP status to answer and a message naming the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from .config import ServeLimits


class RequestError(Exception):
    """A request the server refuses: `status` (4xx), `kind` (a metrics label) and the message."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class TranslateRequest:
    texts: list[str]
    beam_size: Optional[int] = None
    n_best: Optional[int] = None
    length_penalty: Optional[float] = None
    scores: bool = False
    target_lang: Optional[str] = None  # a many-to-many model's target language


@dataclass
class AlignRequest:
    text: str
    translation: Optional[str] = None
    layer: int = -1
    target_lang: Optional[str] = None


def read_json(body: bytes, limits: ServeLimits) -> dict:
    """The JSON object of a request body."""
    if len(body) > limits.max_body_bytes:
        raise RequestError(413, "too_large", f"the request body has {len(body)} bytes; at most {limits.max_body_bytes}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, "not_utf8", f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(
            400, "malformed_json", f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(obj, dict):
        raise RequestError(
            422, "wrong_type", f'the body must be a JSON object such as {{"text": "..."}}, not {kind(obj)}'
        )
    return obj


def translate_request(obj: dict, limits: ServeLimits) -> TranslateRequest:
    check_fields(obj, ("text", "beam_size", "n_best", "length_penalty", "scores", "target_lang"))
    texts = sentences(obj, limits)
    beam_size = integer(obj, "beam_size", 1, limits.max_beam_size)
    n_best = integer(obj, "n_best", 1, beam_size or limits.max_beam_size)
    penalty = obj.get("length_penalty")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, (int, float))):
        raise RequestError(422, "wrong_type", f"length_penalty must be a number, not {kind(penalty)}")
    if penalty is not None and not 0 <= penalty <= limits.max_length_penalty:
        raise RequestError(422, "out_of_range", f"length_penalty={penalty} is not in [0, {limits.max_length_penalty}]")
    scores = obj.get("scores", False)
    if not isinstance(scores, bool):
        raise RequestError(422, "wrong_type", f"scores must be true or false, not {kind(scores)}")
    penalty = None if penalty is None else float(penalty)
    return TranslateRequest(texts, beam_size, n_best, penalty, scores, language(obj, "target_lang"))


def align_request(obj: dict, limits: ServeLimits) -> AlignRequest:
    check_fields(obj, ("text", "translation", "layer", "target_lang"))
    text = sentences(obj, limits)
    if len(text) != 1:
        raise RequestError(422, "wrong_type", "text must be one sentence (a string) to align")
    translation = obj.get("translation")
    if translation is not None:
        line(translation, "translation", limits)
    layer = obj.get("layer", -1)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise RequestError(422, "wrong_type", f"layer must be an integer, not {kind(layer)}")
    return AlignRequest(text[0], translation, layer, language(obj, "target_lang"))


def language(obj: dict, key: str) -> str | None:
    """A language code field (whether the model translates into it is the service's to check)."""
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise RequestError(422, "wrong_type", f'{key} must be a language code such as "en", not {kind(value)}')
    return None if value is None else value.strip()


def check_fields(obj: dict, known: tuple[str, ...]) -> None:
    unknown = [key for key in obj if key not in known]
    if unknown:
        raise RequestError(422, "unknown_field", f"unknown field {unknown[0]!r}; the fields are {', '.join(known)}")


def sentences(obj: dict, limits: ServeLimits) -> list[str]:
    """`text`: one sentence (a string) or a list of them; empty strings in a list translate to empty strings."""
    if "text" not in obj:
        raise RequestError(422, "missing_field", 'missing field "text": a sentence or a list of sentences')
    text = obj["text"]
    if isinstance(text, str):
        if not text.strip():
            raise RequestError(422, "empty", "text is empty")
        return [line(text, "text", limits)]
    if not isinstance(text, list):
        raise RequestError(422, "wrong_type", f"text must be a string or a list of strings, not {kind(text)}")
    if not text:
        raise RequestError(422, "empty", "text is an empty list")
    if len(text) > limits.max_lines:
        raise RequestError(413, "too_many_lines", f"text has {len(text)} lines; at most {limits.max_lines} per request")
    return [line(item, f"text[{i}]", limits) for i, item in enumerate(text)]


def line(value, name: str, limits: ServeLimits) -> str:
    if not isinstance(value, str):
        raise RequestError(422, "wrong_type", f"{name} must be a string, not {kind(value)}")
    if len(value) > limits.max_chars:
        raise RequestError(413, "line_too_long", f"{name} has {len(value)} characters; at most {limits.max_chars}")
    if "\n" in value or "\r" in value:
        raise RequestError(422, "line_break", f"{name} holds a line break: send one sentence per list item")
    return value.strip()


def integer(obj: dict, key: str, low: int, high: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(422, "wrong_type", f"{key} must be an integer, not {kind(value)}")
    if not low <= value <= high:
        raise RequestError(422, "out_of_range", f"{key}={value} is not in [{low}, {high}]")
    return value


def kind(value) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "infinite" if isinstance(value, float) and not math.isfinite(value) else "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
