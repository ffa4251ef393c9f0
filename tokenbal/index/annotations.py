"""Scan one JSON / JSONL annotation file (the LLaVA / Qwen-VL fine-tuning format) like a shard.

A ``.jsonl`` file holds one record per line (blank lines are skipped); a ``.json`` file holds one
list of records. A record is an object with:

* images: ``images`` (a list of paths) or ``image`` (a path or a list of paths); without either,
  the ``{"type": "image", "image": PATH}`` parts of ``messages`` contents (Qwen-VL style; the path
  may be under ``url`` or ``path`` instead, and OpenAI ``{"type": "image_url", "image_url": {"url":
  PATH}}`` parts count as image parts, as transformers 5.x processors take them). Paths are
  relative to ``image_root`` (default: the annotation file's folder); an absolute path is used as is.
* text: the rules of ``tokenbal.index.text.json_text`` (``conversations``, ``messages``, ``text`` /
  ``caption``), ``<image>`` placeholders removed. A record with images and no text field has 0 text
  tokens; a record with neither is an error.

Every image size comes from the file's header (``read_image_size``), exactly as for tar members.
A sample's key is the record's own ``id`` (a non-empty string, or an integer, as a string: the LLaVA
/ ShareGPT layout), so exports and errors join back to the dataset. Keys stay unique within a file:
a record without a usable ``id``, and every record whose ``id`` occurs more than once in its file,
is keyed by its place instead, ``<file name>:<line>`` (JSONL, 1-based line) or
``<file name>[<index>]`` (JSON). (Across files, as across tar shards, keys may repeat; rows are
told apart by their index position and shard.)
Its members are its image files: offset 0, size the file size, the path kept in the index.

Errors, one per record, naming the file and line (or index): invalid JSON on that line, a record
that is not an object, a malformed image field, a missing or unreadable image file (with its full
path), an image whose header cannot be read, a video that cannot be read (the reason from
``tokenbal.index.video.probe_video``) or has bad clip fields, text fields of the wrong type, a record
whose text has ``<image>`` placeholders but not one per image (the processor would fail or pair text
and images wrongly), a record with empty text and no image or video (a 0-token sample), an image or
video path that is not a regular file (a FIFO would block the build), a record with audio (a
non-empty ``audios`` / ``audio`` field or audio message parts: ``tokenbal.index.text.audio_reason``;
audio is not counted).

* videos: ``videos`` (a list of paths) or ``video`` (a path or a list), else the
  ``{"type": "video", "video": PATH, "fps", "min_frames", "max_frames", "nframes", "video_start",
  "video_end"}`` parts of ``messages`` contents (Qwen-VL style; the file may be named under ``url``
  or ``path`` instead); the part's fields are kept per video and honoured by the family's frame
  sampler (``tokenbal.estimate.video``; with ``--processor``, the processor's own sampling instead).
  A frame-list video (``"video": [images]``) is an error (not supported). Each file's header is
  read once per process (``tokenbal.index.video.probe_file``: by path, size and mtime).

A ``.json`` file that is not a list of records, or not JSON at all, is one file-level error
(status ``corrupt``), like a damaged shard.

The fingerprint (``verify``) covers the annotation file only, not the image files it names.

Progress within a file (``scan_annotations(progress=...)``; ``tokenbal index build`` shows it as a
bar under the shard bar): a JSONL file is streamed line by line and reports the bytes consumed; a
JSON list is streamed too, each record decoded as the file is read (``text.iter_json_list``: the
records and errors ``json.loads`` of the whole file gives, never the whole file in memory), and
reports the bytes read. Reports come every ``PROGRESS_BYTES`` bytes and at the end, so their number
does not depend on the clock.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Iterator

from tokenbal.index.imagesize import PREFIX_BYTES, ImageSizeError, read_image_size
from tokenbal.index.scan import (
    PROGRESS_BYTES,
    Progress,
    ScannedSample,
    ShardScan,
    regular_file_stat,
    shard_fingerprint,
)
from tokenbal.index.text import (
    NotAList,
    SampleTextError,
    audio_reason,
    chat_messages,
    image_parts,
    iter_json_list,
    join_text,
    json_error,
    json_text,
    lone_surrogate,
    parse_json,
    part_file_key,
    placeholder_mismatch,
    surrogate_reason,
    video_slot_mismatch,
)
from tokenbal.index.video import VideoError, probe_file
from tokenbal.index.videoindex import SampleVideo, video_parts

ANNOTATION_SUFFIXES = (".json", ".jsonl")
# An image or video named by a URL (http://, s3://, ...) or a data: URI rather than a file path.
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://|data:)")


def _url_reason(kind: str, j: int, ref: str) -> str:
    shown = ref if len(ref) <= 100 else ref[:100] + "..."
    return (f"{kind} {j} {shown!r} is a URL: annotation records are read with their {kind}s as local "
            f"files (relative to --image-root); URLs are not fetched. Download the {kind}s and name the "
            "files, or pack the samples into webdataset shards (which may themselves be URLs)")


def is_annotation_file(path: str) -> bool:
    return path.lower().endswith(ANNOTATION_SUFFIXES)


class _ReadError(Exception):
    """Reading the annotation file itself failed (not one of the images it names)."""


def scan_annotations(path: str, image_root: str | None = None, prefix: int = PREFIX_BYTES,
                     exif: str = "ignore", progress: Progress | None = None) -> ShardScan:
    """Scan the annotation file at ``path``; never raises for bad data (see the module docstring).
    ``progress(done, total, unit)`` is called as the file is read and scanned (module docstring)."""
    scan = ShardScan(path=path)
    root = os.path.abspath(image_root) if image_root is not None else os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    try:
        st = regular_file_stat(path)
        scan.size, scan.mtime_ns = st.st_size, st.st_mtime_ns
        scan.fingerprint = shard_fingerprint(path, st.st_size)
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the records are streamed from it
    except FileNotFoundError as e:
        return _file_error(scan, "missing", f"annotation file not found: {e}")
    except OSError as e:
        return _file_error(scan, "unreadable", f"cannot read annotation file: {e}")
    report = progress or (lambda done, total, unit: None)
    try:
        with f:
            if path.lower().endswith(".jsonl"):
                encoding = _wide_encoding(f)
                if encoding is not None:
                    # Split at b"\n", each UTF-16 line would start with the NUL of the line end before
                    # it: the first record read and every other one "not valid JSON".
                    wide = encoding.upper()
                    reason = (f"annotation file {path} is {wide} text: JSON Lines files are UTF-8; re-encode "
                              f"it (e.g. iconv -f {wide} -t UTF-8)")
                    return _file_error(scan, "corrupt", reason)
                # Streamed: a multi-GB file is never held whole, and its progress is the bytes consumed.
                records = _jsonl_records(_reported_lines(f, st.st_size, report), path, base, scan)
            else:
                # Streamed too: each record of the list is decoded as the file is read, and its
                # progress is the bytes read.
                records = _json_list_records(f, st.st_size, path, base, scan, report)
            ids: dict[str, str | None] = {}   # place key -> the record's own id
            for key, where, rec in records:   # one pass, records not kept
                scan.n_members += 1
                ids[key] = _record_id(rec)
                sample = _record(rec, key, where, root, scan, prefix, exif)
                if sample is not None:
                    scan.samples.append(sample)
    except _ReadError as e:
        return _file_error(scan, "unreadable", f"cannot read annotation file: {e.__cause__}")
    except _ParseError as e:
        scan.n_members = 0             # the file's verdict, as when it was parsed whole before any record
        return _file_error(scan, "corrupt", str(e))
    _key_by_id(scan, ids)
    if scan.n_members == 0:
        _file_error(scan, "empty", f"annotation file {path} holds no records")
    return scan


def _wide_encoding(f) -> str | None:
    """The UTF-16 / UTF-32 encoding the file's first bytes show (a byte-order mark, or NULs around an
    ASCII character, as ``json.detect_encoding`` reads them), else None."""
    try:
        head = f.peek(4)[:4]
    except OSError as e:
        raise _ReadError from e
    found = json.detect_encoding(head) if len(head) >= 2 else "utf-8"
    return None if found in ("utf-8", "utf-8-sig") else found


def _reported_lines(f, size: int, report: Progress) -> Iterator[bytes]:
    """The file's lines as ``raw.split(b"\\n")`` gives them (no line end), reporting the bytes whose
    records were scanned every ``PROGRESS_BYTES`` and at the end."""
    done = reported = 0
    while True:
        try:
            line = f.readline()
        except OSError as e:
            raise _ReadError from e
        if not line:
            break
        yield line[:-1] if line.endswith(b"\n") else line
        done += len(line)
        if done - reported >= PROGRESS_BYTES:
            report(done, max(size, done), "B")
            reported = done
    if reported != done or not done:
        report(done, max(size, done), "B")


# A .json file that is not a list is parsed whole to say what it is (a dict, where it is not JSON)
# only up to this size; a larger one is named by its first character.
PARSE_WHOLE_BYTES = 64 << 20


class _ParseError(Exception):
    """A JSON file is not valid JSON, or not a list: its reason (a file error, as ``json.loads`` of
    the whole file would have found before any record)."""


def _json_list_records(f, size: int, path: str, base: str, scan: ShardScan, report: Progress):
    """The records of a JSON list file, decoded one at a time as it is read (``iter_json_list``),
    reporting the bytes read every ``PROGRESS_BYTES`` (a read) and at the end; one with a lone
    surrogate (looked for where its text spells a surrogate escape at all) is an error, as a JSONL
    line's would be. Raises ``_ParseError`` for a file that is not a valid JSON list."""
    done = 0

    def read(n: int) -> bytes:
        try:
            return f.read(n)
        except OSError as e:
            raise _ReadError from e

    def on_read(n: int) -> None:
        nonlocal done
        done += n
        report(done, max(size, done), "B")

    decoded = 0      # records decoded so far: the number of the one a decode error is in
    try:
        for i, (rec, escapes) in enumerate(iter_json_list(read, PROGRESS_BYTES, on_read)):
            decoded = i + 1
            key, where = f"{base}[{i}]", f"{path}[{i}]"
            bad = lone_surrogate(rec) if escapes else None
            if bad is not None:
                scan.n_members += 1
                scan.errors.append({"shard": path, "key": key, "reason": f"{where}: {surrogate_reason(bad)}"})
                continue
            yield key, where, rec
    except NotAList as e:
        if size > PARSE_WHOLE_BYTES:
            # Not parsed whole to say what it is: a multi-GB object (COCO's {"images": [...], ...}), or
            # JSON Lines named .json, would be held in memory several times over, for one line.
            what = "a JSON object ('{')" if e.first == "{" else repr(e.first) if e.first else "nothing"
            raise _ParseError(f"annotation file {path} starts with {what}, not '[': a .json file must hold "
                              "a list of records (records one per line are JSON Lines: name the file "
                              ".jsonl)") from None
        # Not a list: parsed whole (what else it is, or where it is not JSON, is its error).
        f.seek(0)
        raw = read(-1)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise _not_json(path, e) from None
        raise _ParseError(f"annotation file {path} holds a {type(data).__name__}, expected a list of "
                          "records") from None
    except (ValueError, RecursionError) as e:
        raise _not_json(path, e, f"record [{decoded}]") from None
    if not done:
        report(0, size, "B")


def _not_json(path: str, e: Exception, record: str | None = None) -> _ParseError:
    """The file error for what decoding a JSON file raised: not JSON (a decode error, with its place),
    or JSON Python will not hold (too deep, an integer too long: ``json_error``); ``record``: the
    list record being decoded when it failed (``"record [12]"``), if known."""
    at = f", at {record}" if record is not None else ""
    if isinstance(e, (UnicodeDecodeError, json.JSONDecodeError)):
        return _ParseError(f"annotation file {path} is not valid JSON: {e}{at}")
    return _ParseError(f"annotation file {path}: {json_error(e)}{at}")


def _record_id(rec: object) -> str | None:
    """A record's own ``id`` as a key, or None when it has none usable (absent, empty, not a string
    or integer: a float or a dict would not survive a round trip as the same key)."""
    value = rec.get("id") if isinstance(rec, dict) else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    return value if isinstance(value, str) and value else None


def _id_keys(ids: dict[str, str | None], unparsed: set[str]) -> dict[str, str]:
    """Place key -> the record's id, for the records keyed by their id (``ids``: place key -> id, or
    None): where the id is unique in the file and spelled like no other record's place key (``unparsed``:
    the place keys of lines that are not JSON); every record of a repeated id keeps its place key, so
    which record gets the id never depends on order."""
    seen: dict[str, int] = {}
    for i in ids.values():
        if i is not None:
            seen[i] = seen.get(i, 0) + 1
    chosen = {key: i for key, i in ids.items() if i is not None and seen[i] == 1}
    # An id spelled like another record's place key ("train.jsonl:7", maybe a line that is not
    # JSON, so not in ``ids``) would collide with it.
    places = {key for key in ids if key not in chosen} | unparsed
    return {key: i for key, i in chosen.items() if i not in places}


def _key_by_id(scan: ShardScan, ids: dict[str, str | None]) -> None:
    """Re-key the scanned samples and errors of a file by their records' ids (:func:`_id_keys`)."""
    chosen = _id_keys(ids, {e["key"] for e in scan.errors if e["key"] not in ids})
    for s in scan.samples:
        s.key = chosen.get(s.key, s.key)
    for e in scan.errors:
        e["key"] = chosen.get(e["key"], e["key"])


def annotation_records(path: str) -> dict[str, object]:
    """Every record of the annotation file at ``path`` by its key in the index (``<file>:<line>``,
    ``<file>[<i>]``, or the record's ``id`` where the scan keyed it so), parsed as the scan parses it
    (bytes, so a UTF-8 BOM is no error): what a reader takes a sample's text from."""
    with open(path, "rb") as f:
        raw = f.read()
    base = os.path.basename(path)
    scan = ShardScan(path=path)                      # collects the lines that are not JSON
    if path.lower().endswith(".jsonl"):
        records = _jsonl_records(raw.split(b"\n"), path, base, scan)
    else:
        records = ((f"{base}[{i}]", "", rec) for i, rec in enumerate(json.loads(raw)))
    by_place = {key: rec for key, _, rec in records}
    unparsed = {e["key"] for e in scan.errors}
    rename = _id_keys({key: _record_id(rec) for key, rec in by_place.items()}, unparsed)
    return {rename.get(key, key): rec for key, rec in by_place.items()}


def jsonl_record_spans(path: str) -> dict[str, tuple[int, int]]:
    """Every record of the JSONL file at ``path`` as ``(byte offset, length)`` of its line, by the key
    :func:`annotation_records` gives it: one streamed pass that keeps no record, so a reader holds a
    few numbers per record instead of every parsed record, and reads a sample's line when asked."""
    base = os.path.basename(path)
    scan = ShardScan(path=path)
    places: list[tuple[int, int]] = []

    def lines() -> Iterator[bytes]:
        offset = 0
        with open(path, "rb") as f:
            for line in f:                      # split at b"\n", as annotation_records splits
                places.append((offset, len(line)))
                offset += len(line)
                yield line

    ids = {key: _record_id(rec) for key, _, rec in _jsonl_records(lines(), path, base, scan)}
    rename = _id_keys(ids, {e["key"] for e in scan.errors})
    return {rename.get(key, key): places[int(key.rsplit(":", 1)[1]) - 1] for key in ids}


def _file_error(scan: ShardScan, status: str, reason: str) -> ShardScan:
    scan.status, scan.reason = status, reason
    scan.samples = []
    scan.errors = [{"shard": scan.path, "key": None, "reason": reason}]
    return scan


def _jsonl_records(lines: Iterable[bytes], path: str, base: str, scan: ShardScan):
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key, where = f"{base}:{lineno}", f"{path}:{lineno}"
        try:
            rec = parse_json(line)
        except SampleTextError as e:
            scan.n_members += 1
            scan.errors.append({"shard": path, "key": key, "reason": f"{where}: {e}"})
            continue
        yield key, where, rec


def _record(rec: object, key: str, where: str, root: str, scan: ShardScan,
            prefix: int, exif: str = "ignore") -> ScannedSample | None:
    def fail(reason: str) -> None:
        scan.errors.append({"shard": scan.path, "key": key, "reason": f"{where}: {reason}"})

    def fail_on_file(full: str, reason: str, st: os.stat_result | None = None) -> None:
        # The file that made the record an error, as it was (missing: -1): a later build rescans
        # this annotation file once it appears or changes (build._row_files_changed), so a fixed
        # image or video is counted without --rebuild.
        stamp = [st.st_size, st.st_mtime_ns] if st is not None else [-1, -1]
        scan.extra.setdefault("error_files", []).append([full, *stamp])
        return fail(reason)

    if not isinstance(rec, dict):
        return fail(f"record is {type(rec).__name__}, not an object")
    audio = audio_reason(rec)
    if audio:
        return fail(audio)
    try:
        images = _image_paths(rec)
        pieces = json_text(rec)
        chat = chat_messages(rec)
        video_refs = video_parts(rec)
    except (SampleTextError, ValueError) as e:
        return fail(str(e))
    if pieces is None and not images and not video_refs:
        return fail("has neither images nor text nor a video (none of image / images / video / videos / "
                    "conversations / messages / text / caption)")
    members, paths, sizes, stamps = [], [], [], []
    for j, rel in enumerate(images):
        if _URL.match(rel):
            return fail(_url_reason("image", j, rel))
        if "\0" in rel:     # os.open raises ValueError, not OSError, on it
            return fail(f"image {j} {rel!r}: a path with a NUL character names no file")
        full = os.path.normpath(os.path.join(root, rel))
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; the fstat below rejects it.
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return fail_on_file(full, f"image {j} {rel!r} not found at {full}")
        except OSError as e:
            scan.n_read_failures += 1   # an I/O error, not the file's bytes: a rebuild retries it
            return fail(f"image {j} {rel!r} cannot be read at {full}: {e}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return fail_on_file(full, f"image {j} {rel!r} at {full} is not a regular file", st)
            size = st.st_size
            wh, full_read = read_image_size(fd, 0, size, prefix, exif)
        except ImageSizeError as e:
            return fail_on_file(full, f"image {j} {rel!r} at {full} is not a readable image: {e}", st)
        except OSError as e:
            scan.n_read_failures += 1
            return fail(f"image {j} {rel!r} cannot be read at {full}: {e}")
        finally:
            os.close(fd)
        scan.n_full_reads += full_read
        name = os.path.basename(rel)
        ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
        members.append((ext, 0, size))
        paths.append(f"{rel}\0{full}")
        sizes.append(wh)
        stamps.append((-1, st.st_mtime_ns))     # a file has no tar header; its mtime is the stamp
    videos = []
    for j, (rel, params) in enumerate(video_refs):
        if _URL.match(rel):
            return fail(_url_reason("video", j, rel))
        if "\0" in rel:
            return fail(f"video {j} {rel!r}: a path with a NUL character names no file")
        full = os.path.normpath(os.path.join(root, rel))
        try:
            # Checked before PyAV opens it: a FIFO would block the build.
            vst = os.stat(full)
        except OSError as e:   # worded as probe_video words it
            return fail_on_file(full, f"video {j} {rel!r} at {full}: cannot read the video: {e}")
        if not stat.S_ISREG(vst.st_mode):
            return fail_on_file(full, f"video {j} {rel!r} at {full}: cannot read the video: not a regular "
                                      "file", vst)
        try:
            info = probe_file(full, vst)   # records often share a clip: its header is read once
        except VideoError as e:
            return fail_on_file(full, f"video {j} {rel!r} at {full}: {e}", vst)
        name = os.path.basename(rel)
        videos.append(SampleVideo(member=len(members), info=info, params=params))
        members.append((name.rsplit(".", 1)[-1].lower() if "." in name else "", 0, vst.st_size))
        paths.append(f"{rel}\0{full}")
        stamps.append((-1, vst.st_mtime_ns))
    # Text against media last: a record whose image or video file is bad says that first.
    mismatch = (placeholder_mismatch(pieces, image_parts(rec), len(images), "the record names")
                or video_slot_mismatch(chat, len(videos), "the record names"))
    if mismatch:
        return fail(mismatch)
    if not images and not video_refs and not join_text(pieces or []).strip():
        return fail("its text is empty and it has no image or video: it would be a 0-token sample")
    return ScannedSample(key=key, members=members, image_sizes=sizes, text=join_text(pieces or []),
                         paths=paths, videos=videos or None, stamps=stamps, chat=chat)


def _image_paths(rec: dict) -> list[str]:
    if "images" in rec and rec["images"] is not None:
        value, field = rec["images"], "images"
    elif "image" in rec and rec["image"] is not None:
        value, field = rec["image"], "image"
    else:
        return _part_image_paths(rec)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(p, str) and p for p in items):
        raise SampleTextError(f"'{field}' must be a path or a list of paths, got {json.dumps(value)[:80]}")
    return items


def _part_image_paths(rec: dict) -> list[str]:
    """The images a record names inside its message contents, as transformers 5.x processors collect
    them: an image part's ``image`` / ``url`` / ``path`` (Qwen-VL style), an OpenAI ``image_url``
    part's ``url`` (processors turn it into an image part)."""
    out = []
    for i, msg in enumerate(rec.get("messages") or []):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict):
                continue
            where = f"messages[{i}].content[{j}]"
            if part.get("type") == "image_url" and part.get("image_url") is not None:
                info = part["image_url"]
                value, where = (info.get("url") if isinstance(info, dict) else info), f"{where}.image_url.url"
            elif part.get("type") == "image":
                key = part_file_key(part, "image", where)
                if key is None:
                    continue   # a placeholder part: the images come from an images field
                value, where = part[key], f"{where}.{key}"
            else:
                continue
            if not isinstance(value, str) or not value:
                raise SampleTextError(f"{where} is {type(value).__name__}, not a path string")
            out.append(value)
    return out
