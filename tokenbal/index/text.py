"""The text of a sample, as the index counts it.

Rules (one place, so that the builder and the tests agree):

* Text members are those whose extension's last dot-component is ``txt`` or ``json``.
* A ``.txt`` member is UTF-8 text, counted as is.
* A ``.json`` member is an object; its text is, first match wins:
  ``conversations`` (LLaVA: ``[{"from", "value"}]``) -> the ``value`` strings;
  ``messages`` (OpenAI style: ``[{"role", "content"}]``, content a string or a list of parts) ->
  the strings and the ``text`` of ``{"type": "text"}`` parts (image/video parts carry no text);
  ``text`` or ``caption`` (a string; null counts as absent) -> that string.
  A JSON with none of these (e.g. img2dataset metadata) contributes no text; if no member of the
  sample gives any text this way, the sample is an error (an unknown schema must not silently
  count as 0 text tokens). A sample with images and no text member at all is fine (0 text tokens).
* The sample's text is the pieces of all its text members in member order, joined with "\\n", with
  the ``<image>`` / ``<video>`` placeholders removed: the vision token count already covers them.
* Chat-template tokens (role headers, turn separators, system prompt) are counted only when the
  index is built with a processor (``tokenbal index build --processor DIR``): then a record's
  ``messages`` (or ``conversations``, as :func:`chat_messages` converts them) are rendered with the
  processor's chat template and tokenized with its tokenizer
  (``tokenbal.estimate.chat.ChatTokenCounter``), so ``lengths`` equal the processor's
  ``apply_chat_template`` counts. Without a processor the joined text above is counted as is.

Audio (one check for every source kind): a JSON sample with a non-empty ``audios`` / ``audio``
field or ``{"type": "audio"}`` / ``"input_audio"`` message parts is an error naming the sample
(``audio_reason``): tokenbal does not count audio tokens, and leaving the clip out would undercount.

Placeholders against images (one check for every source kind: tar samples, JSON / JSONL records,
Parquet rows): a sample's image placeholders are its ``<image>`` strings plus its ``{"type":
"image"}`` message parts (the chat template writes one placeholder for each). When it has any, they
must be exactly one per image, or the processor fails or pairs text and images wrongly: the sample
is an error naming both counts (``placeholder_mismatch``). A sample with no placeholder at all is
fine (the images go first, as most processors do without one).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator

TEXT_EXTS = frozenset({"txt", "json"})
PLACEHOLDERS = ("<image>", "<video>")
IMAGE_PLACEHOLDER = "<image>"


class SampleTextError(ValueError):
    """A text member cannot be read; the message says why."""


# A \uD800-\uDFFF escape: JSON may spell a UTF-16 surrogate alone, which Python parses into a
# string that no UTF-8 writer (the index, a tokenizer) can encode. Searched for first: a pair, as
# an emoji escapes, is fine, and most records have neither.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(data: bytes | str, check_surrogates: bool = True) -> object:
    """``json.loads(data)``, every way it can fail as ``SampleTextError`` with the reason: not JSON,
    a number Python will not convert (an integer of more than ``sys.get_int_max_str_digits()``
    digits), nesting deeper than the recursion limit; and a string holding a lone surrogate
    (``check_surrogates``), which is not Unicode text."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SampleTextError(json_error(e)) from None
    if check_surrogates:
        escapes = _SURROGATE_ESCAPE_TEXT if isinstance(data, str) else _SURROGATE_ESCAPE
        if escapes.search(data):
            where = lone_surrogate(obj)
            if where is not None:
                raise SampleTextError(surrogate_reason(where))
    return obj


def json_error(e: ValueError | RecursionError) -> str:
    """Why ``json.loads`` failed, in words."""
    if isinstance(e, json.JSONDecodeError | UnicodeDecodeError):
        return f"not valid JSON ({e})"
    if isinstance(e, RecursionError):
        return "JSON nested deeper than Python's recursion limit"
    return f"JSON that Python cannot read ({e})"


def surrogate_reason(where: str) -> str:
    return (f"{where} holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF without its pair): not "
            "Unicode text, which no UTF-8 reader or tokenizer takes")


def may_hold_surrogates(data: bytes) -> bool:
    """Whether JSON ``data`` spells a surrogate escape at all (then :func:`lone_surrogate` looks)."""
    return _SURROGATE_ESCAPE.search(data) is not None


def lone_surrogate(obj: object, where: str = "the record") -> str | None:
    """Where in ``obj`` (a parsed JSON value) a string, or an object key, has a lone surrogate."""
    stack = [(obj, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, f"{at}: a key"))
                stack.append((v, f"{at}[{k!r}]" if at != "the record" else f"field {k!r}"))
        elif isinstance(value, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
    return None


def text_pieces(ext: str, data: bytes) -> list[str] | None:
    """Text pieces of one text member (``ext`` lower case). ``None`` for a JSON with no known
    text field; raises ``SampleTextError`` for bytes that are not UTF-8 or not valid JSON."""
    return member_text(ext, data)[0]


def member_text(ext: str, data: bytes) -> tuple[list[str] | None, list[dict] | None, int]:
    """``(text_pieces(ext, data), chat_messages(its JSON), image_parts(its JSON))`` from one parse of
    the member; ``.txt`` has no chat turns and no image parts (the image placeholders that are not
    ``<image>`` strings)."""
    try:
        s = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SampleTextError(f"not valid UTF-8 ({e})") from None
    if ext.rsplit(".", 1)[-1] == "txt":
        return [s], None, 0
    obj = parse_json(s)
    audio = audio_reason(obj)
    if audio:
        raise SampleTextError(audio)
    return json_text(obj), chat_messages(obj), image_parts(obj)


AUDIO_FIELDS = ("audios", "audio")
AUDIO_PART_TYPES = ("audio", "input_audio")


def audio_reason(obj: object, holder: str = "field") -> str | None:
    """Why a parsed JSON sample cannot be counted because it carries audio (a non-empty ``audios`` /
    ``audio`` field, LLaMA-Factory's and ms-swift's layout, or ``{"type": "audio"}`` /
    ``"input_audio"`` message parts), else ``None``. tokenbal counts text, images and videos; an
    audio clip's tokens (Phi-4-multimodal, Qwen2-Audio, ...) are not modelled, so such a sample is an
    error rather than a count short by the whole clip. ``holder`` names what holds the audio values in
    the message (a Parquet row's: ``"column"``)."""
    if not isinstance(obj, dict):
        return None
    for name in AUDIO_FIELDS:
        n = audio_count(obj.get(name))
        if n:
            return (f"has {n} audio(s) in its {name!r} {holder}; tokenbal counts text, images and videos, "
                    "not audio (remove the audio or count those samples yourself)")
    turns = obj.get("messages")
    n = sum(1 for t in (turns if isinstance(turns, list) else [])
            if isinstance(t, dict) and isinstance(t.get("content"), list)
            for part in t["content"] if isinstance(part, dict) and part.get("type") in AUDIO_PART_TYPES)
    if n:
        return (f"has {n} audio part(s) in its messages; tokenbal counts text, images and videos, not "
                "audio (remove the audio or count those samples yourself)")
    return None


def audio_count(value: object) -> int:
    """How many audio clips an audio field or column value holds: none for None, False and empty
    values, a list's length, else one."""
    if value is None or value is False or (isinstance(value, (list, tuple, str, bytes, dict)) and not value):
        return 0
    return len(value) if isinstance(value, (list, tuple)) else 1


IMAGE_PART_TYPES = ("image", "image_url")   # transformers 5.x processors make image_url parts images


def part_file_key(part: dict, kind: str, where: str) -> str | None:
    """Which key of an image or video message part names its file (``kind`` is the part's type): the
    first of ``kind`` / ``url`` / ``path`` set, as a processor's chat template collects it; None for a
    placeholder part. ``SampleTextError`` when it names more than one: a processor takes each as a
    file of its own."""
    named = [k for k in (kind, "url", "path") if part.get(k) is not None]
    if len(named) > 1:
        one = "an image" if kind == "image" else f"a {kind}"
        raise SampleTextError(f"{where} names its {kind} under {' and '.join(named)}; a processor takes "
                              f"each as {one} of its own: name it once")
    return named[0] if named else None


def image_parts(obj: object) -> int:
    """How many ``{"type": "image"}`` (or OpenAI ``image_url``) parts the ``messages`` contents of a
    JSON sample hold (with or without an ``image`` path; what a chat template turns into one image
    placeholder each)."""
    turns = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(turns, list):
        return 0
    return sum(1 for t in turns if isinstance(t, dict) and isinstance(t.get("content"), list)
               for part in t["content"] if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES)


def placeholder_mismatch(pieces: list[str] | None, parts: int, n_images: int, holder: str) -> str | None:
    """The error of a sample whose image placeholders (``<image>`` in ``pieces`` plus ``parts``
    image message parts) are not one per image; ``None`` when they are, or when it has none.
    ``holder`` names what holds the images in the message ("the record", "the sample", "the row")."""
    found = sum(p.count(IMAGE_PLACEHOLDER) for p in pieces or []) + parts
    if not found or found == n_images:
        return None
    what = f"{found} <image> placeholder(s)" if not parts else \
        f"{found} image placeholder(s) ({found - parts} <image>, {parts} image message part(s))"
    return (f"its text has {what} but {holder} {n_images} image(s); the processor would pair text "
            "and images wrongly")


def video_slot_mismatch(chat: list | None, n_videos: int, holder: str) -> str | None:
    """The error of a sample whose conversation (:func:`chat_messages`: ``{"type": "video"}`` parts, a
    LLaVA-Video ``<video>`` each) has video slots but not one per video; ``None`` when it has, or none
    (the videos then go first, as images do). ``holder`` as in :func:`placeholder_mismatch`."""
    found = sum(1 for t in chat or [] if isinstance(t, dict) and isinstance(t.get("content"), list)
                for part in t["content"] if isinstance(part, dict) and part.get("type") == "video")
    if not found or found == n_videos:
        return None
    return (f"its conversation has {found} video placeholder(s) (<video> or video parts) but {holder} "
            f"{n_videos} video(s); the processor would fail or pair text and videos wrongly")


def json_text(obj: object) -> list[str] | None:
    """Text pieces of a parsed JSON sample description (see the module rules); ``None`` if none."""
    if not isinstance(obj, dict):
        return None
    if "conversations" in obj:
        turns = _as_list(obj["conversations"], "conversations")
        return [_field(t, "value", f"conversations[{i}]") for i, t in enumerate(turns)]
    if "messages" in obj:
        turns = _as_list(obj["messages"], "messages")
        pieces: list[str] = []
        for i, t in enumerate(turns):
            where = f"messages[{i}]"
            if not isinstance(t, dict):
                raise SampleTextError(f"{where} is {type(t).__name__}, not an object")
            content = t.get("content")
            if isinstance(content, str):
                pieces.append(content)
            elif isinstance(content, list):
                pieces.extend(_content_parts(content, where))
            elif content is not None:   # an assistant tool-call turn may have content null
                raise SampleTextError(f"{where}.content is {type(content).__name__}, "
                                      "not a string or a list of parts")
        return pieces
    for field in ("text", "caption"):
        # null means "no caption" (img2dataset writes that next to a .txt); skip it, don't fail.
        if obj.get(field) is not None:
            return [_field(obj, field, "")]
    return None


def join_text(pieces: list[str]) -> str:
    """The sample text from its pieces: joined with newlines, image/video placeholders removed."""
    text = "\n".join(pieces)
    for p in PLACEHOLDERS:
        text = text.replace(p, "")
    return text


def _content_parts(parts: list, where: str) -> list[str]:
    out = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict):
            if part.get("type", "text") == "text" and "text" in part:
                out.append(_field(part, "text", f"{where}.content[{j}]"))
        else:
            raise SampleTextError(f"{where}.content[{j}] is {type(part).__name__}, not a part object")
    return out


def _as_list(value: object, name: str) -> list:
    if not isinstance(value, list):
        raise SampleTextError(f"'{name}' is {type(value).__name__}, not a list")
    return value


def _field(obj: object, name: str, where: str) -> str:
    if not isinstance(obj, dict):
        raise SampleTextError(f"{where} is {type(obj).__name__}, not an object")
    value = obj.get(name)
    if not isinstance(value, str):
        label = f"{where}.{name}" if where else f"'{name}'"
        raise SampleTextError(f"{label} is {type(value).__name__}, not a string")
    return value


# LLaVA ``from`` names -> chat roles (the mapping LLaMA-Factory / trl conversions use)
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


_PLACEHOLDER_SPLIT = re.compile("(" + "|".join(map(re.escape, PLACEHOLDERS)) + ")")


def chat_messages(obj: object) -> list[dict] | None:
    """The conversation a chat template renders for a parsed JSON record: its ``messages`` as they
    are, or its LLaVA ``conversations`` as ``{"role", "content"}`` turns, each ``<image>`` in a
    value becoming an ``{"type": "image"}`` part in place and each ``<video>`` a ``{"type":
    "video"}`` part (LLaVA-Video / OneVision records: the record's ``video`` field names the file;
    the text around them kept verbatim).
    ``None`` for a record with neither (its text is counted plain). Raises ``SampleTextError`` for
    malformed turns."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("messages"), list):
        return obj["messages"]
    if "conversations" not in obj:
        return None
    out = []
    for i, turn in enumerate(_as_list(obj["conversations"], "conversations")):
        value = _field(turn, "value", f"conversations[{i}]")
        role = _ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise SampleTextError(f"conversations[{i}].from is {turn.get('from')!r}; known: {sorted(_ROLES)}")
        parts: list[dict] = []
        pieces = _PLACEHOLDER_SPLIT.split(value)   # text, placeholder, text, placeholder, ..., text
        for k, piece in enumerate(pieces):
            if k % 2:
                parts.append({"type": "image" if piece == IMAGE_PLACEHOLDER else "video"})
            elif piece or len(pieces) == 1:   # a turn without placeholders keeps its (even empty) text
                parts.append({"type": "text", "text": piece})   # verbatim, newlines kept
        out.append({"role": role, "content": parts})
    return out


# --- a JSON list, item by item ----------------------------------------------------------------

_JSON_WS = re.compile(r"[ \t\n\r]*")
# How far before the end of what was read a decode error (or the end of a value) may be and still
# come from the cut rather than the text: the longest token a cut leaves undecidable is 8 characters
# ("-Infinit", found by decoding every prefix of many documents); an error further back is damage,
# and more text cannot change it. An unterminated string is the one error reported at its start.
_CUT_REACH = 16


class NotAList(Exception):
    """The document does not start with ``[``; ``first`` is the character it starts with (``""`` for
    an empty document), so the caller can say what it is without parsing it whole."""

    def __init__(self, first: str) -> None:
        super().__init__(first)
        self.first = first


def iter_json_list(read: Callable[[int], bytes], chunk: int,
                   on_read: Callable[[int], None] | None = None) -> Iterator[tuple[object, bool]]:
    """Each item of the JSON array that ``read(n)`` (bytes) holds, with whether its text spells a
    surrogate escape, decoded as the file is read ``chunk`` bytes at a time (more while one item
    is longer), so a multi-GB list is never held whole: the values ``json.loads`` of the whole file
    gives (its encoding found the same way, ``json.detect_encoding``), and a ``JSONDecodeError``
    where it raises one, with the same message (line, column and char counted from the file's start).
    ``on_read(nbytes)`` after each read. ``NotAList`` when the document does not start with ``[``."""
    scan = json.JSONDecoder().raw_decode
    head = b""
    while len(head) < 4:   # json.detect_encoding looks at the first 4 bytes
        data = read(chunk)
        if on_read is not None and data:
            on_read(len(data))
        if not data:
            break
        head += data
    text = codecs.getincrementaldecoder(json.detect_encoding(head) if head else "utf-8")("strict")
    buf = text.decode(head, final=not head)
    pos = 0
    eof = not head
    gone_chars = gone_lines = gone_col = 0     # what was dropped from the front of buf

    def more() -> bool:
        """Drop what is before ``pos``, then read on; False at the end of the file."""
        nonlocal buf, pos, eof, gone_chars, gone_lines, gone_col
        if eof:
            return False
        part = buf[:pos]
        nl = part.count("\n")
        gone_lines += nl
        gone_col = len(part) - part.rfind("\n") - 1 if nl else gone_col + len(part)
        gone_chars += pos
        data = read(max(chunk, len(buf) - pos))   # doubling while one item is longer: linear, not quadratic
        if on_read is not None and data:
            on_read(len(data))
        eof = not data
        buf = buf[pos:] + text.decode(data, final=eof)
        pos = 0
        return True

    def error(msg: str, at: int, lineno: int, colno: int) -> json.JSONDecodeError:
        e = json.JSONDecodeError(msg, " ", 0)   # the message as json.loads of the whole file words it
        e.pos, e.lineno = gone_chars + at, gone_lines + lineno
        e.colno = colno + (gone_col if lineno == 1 else 0)
        e.args = (f"{msg}: line {e.lineno} column {e.colno} (char {e.pos})",)
        return e

    def here(msg: str) -> json.JSONDecodeError:
        lineno = buf.count("\n", 0, pos) + 1
        return error(msg, pos, lineno, pos - buf.rfind("\n", 0, pos))

    def skip_ws() -> None:
        nonlocal pos
        while True:
            pos = _JSON_WS.match(buf, pos).end()
            if pos < len(buf) or not more():
                return

    skip_ws()
    if pos >= len(buf) or buf[pos] != "[":
        raise NotAList(buf[pos:pos + 1])
    pos += 1
    skip_ws()
    if pos < len(buf) and buf[pos] == "]":
        pos += 1
    else:
        while True:
            while True:
                try:
                    value, end = scan(buf, pos)
                except json.JSONDecodeError as e:
                    # Read on only where the cut may be the cause: damage further back raises here,
                    # at the damaged record, without reading the rest of the file.
                    cut = e.msg.startswith("Unterminated string") or e.pos >= len(buf) - _CUT_REACH
                    if cut and more():
                        continue
                    raise error(e.msg, e.pos, e.lineno, e.colno) from None
                # Taken once the delimiter after it is read: a number cut by the end of what was read
                # ("-2.5" of "-2.5e3") decodes too. Something else well before the end is no delimiter
                # and never becomes one: the "Expecting ',' delimiter" below, without reading on.
                after = _JSON_WS.match(buf, end).end()
                if (after < len(buf) and buf[after] in ",]") or after < len(buf) - _CUT_REACH or not more():
                    break
            yield value, _SURROGATE_ESCAPE_TEXT.search(buf, pos, end) is not None
            pos = end
            skip_ws()
            if pos < len(buf) and buf[pos] == ",":
                pos += 1
                skip_ws()
                continue
            if pos < len(buf) and buf[pos] == "]":
                pos += 1
                break
            raise here("Expecting ',' delimiter")
    skip_ws()
    if pos < len(buf):
        raise here("Extra data")
