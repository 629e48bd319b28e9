"""A task's lines (or rows) to token arrays: JSON parsing (or text lines, whole text files, Parquet/Arrow rows),
sentence splitting, tokenizing (in the worker processes, or parsing in the main process when it has a core to
spare)."""
from __future__ import annotations

import json
import re
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy

from ..indexed_dataset import DType
from ..tokenizers import build_tokenizer
from .formats import TEXT, ParquetRows, Records, RowRange, input_format
from .inputs import PreprocessError, Task, read_error

try:  # several times faster than json at parsing the lines; optional (see Encoder._parse)
    from orjson import loads as _FAST_LOADS
except ImportError:
    _FAST_LOADS = None


# ------------------------------------------------------------------------------- sentences
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str, keep_newlines: bool) -> List[str]:
    """Sentences of ``text`` whose concatenation is ``text`` (whitespace stays with the sentence
    before it). Breaks after . ! ? followed by space and a capital/digit, and at blank lines."""
    pieces: List[str] = []
    for para in re.split(r"(?<=\n\n)", text):
        start = 0
        for m in _SENTENCE_END.finditer(para):
            pieces.append(para[start:m.end()])
            start = m.end()
        if start < len(para):
            pieces.append(para[start:])
    if not keep_newlines:
        pieces = [p.replace("\n", " ") for p in pieces]
    return [p for p in pieces if p]


# --------------------------------------------------------------------------------- encoding
class Encoder:
    """Turns a task (a chunk of whole lines) into token arrays per key (runs in the worker processes)."""

    tokenizer = None

    def __init__(self, args, on_read: Optional[Callable[[str, int, int, int], None]] = None) -> None:
        """``on_read``: passed to the process's :class:`formats.ParquetRows` (a test hook)."""
        self.args = args
        self.rows = ParquetRows(on_read)  # each forked worker reads its own Parquet ranges with its copy

    def initializer(self) -> None:
        # forked workers inherit the tokenizer built by the parent; build it only where missing
        if Encoder.tokenizer is None or getattr(Encoder, "_built_for", None) is not self.args:
            Encoder.tokenizer = make_tokenizer(self.args)
            Encoder._built_for = self.args
        Encoder.dtype = DType.optimal_dtype(Encoder.tokenizer.vocab_size)

    @staticmethod
    def read(task: Task) -> bytes:
        if task.data is not None:
            return task.data
        try:
            with open(task.path, "rb") as f:
                f.seek(task.start)
                data = f.read(task.stop - task.start)
        except OSError as err:
            raise read_error(task.path, err) from None
        if len(data) != task.stop - task.start:
            raise PreprocessError(f"--input file '{task.path}' changed while it was read")
        return data

    def encode_task(self, task: Task) -> dict:
        """{"lines", "bytes", "docs", "skipped": [(line index in the task, message)], "keys": {key: (tokens,
        sequence lengths, sequences per document)}} or, for a bad line without --skip-bad-lines,
        {"lines", "bytes", "error": (line index, message)}."""
        return self.tokenize_task(*self.parse_columns(task))

    def parse_columns(self, task: Task) -> Tuple[dict, Dict[str, List[List[str]]]]:
        """:meth:`parse_task` with the documents as one column per key: {key: [each document's sentences]}."""
        out, docs = self.parse_task(task)
        return out, {key: [doc[key] for doc in docs] for key in self.args.json_keys}

    def tokenize_task(self, out: dict, columns: Dict[str, List[List[str]]]) -> dict:
        """The second half of :meth:`encode_task`: the parsed documents' token arrays added to ``out``."""
        if "error" not in out:
            out["keys"] = {key: self._tokenize(columns[key]) for key in self.args.json_keys}
        return out

    def parse_task(self, task: Task) -> Tuple[dict, List[Dict[str, List[str]]]]:
        """The first half of :meth:`encode_task`: its dict without "keys", and the parsed documents."""
        if isinstance(task.data, RowRange):
            return self._parse_records(self.rows.read(task.path, task.data, self.args.json_keys))
        if isinstance(task.data, Records):
            return self._parse_records(task.data)
        if input_format(task.path) == TEXT:
            return self._parse_text(self.read(task))
        args = self.args
        data = self.read(task)
        lines = data.split(b"\n")  # each line parsed from its bytes: no decode of the whole task to str first
        if not lines[-1]:
            lines.pop()  # the text after the last newline (empty unless the file ends without one)
        bad: List[Tuple[int, str]] = []
        docs: List[Dict[str, List[str]]] = []
        for i, line in enumerate(lines):
            msg = self._parse(line, docs)
            if msg is None:
                continue
            if msg.startswith("invalid JSON"):  # the message as for the line's bytes with their newline (positions)
                raw = line if isinstance(line, bytes) else line.encode("utf-8")
                msg = self._parse(raw + b"\n" if i < len(lines) - 1 or data.endswith(b"\n") else raw, [])
            if not args.skip_bad_lines:
                return {"lines": len(lines), "bytes": len(data), "error": (i, msg)}, []
            bad.append((i, msg))
        return {"lines": len(lines), "bytes": len(data), "docs": len(docs), "skipped": bad}, docs

    def _collect(self, units: List, add, nbytes: int) -> Tuple[dict, List[Dict[str, List[str]]]]:
        """:meth:`parse_task`'s result for ``units`` (text lines, rows) that ``add(unit, docs)`` appends to the
        documents, returning what is wrong with a unit instead, if anything (``add`` may skip a unit: no document)."""
        bad: List[Tuple[int, str]] = []
        docs: List[Dict[str, List[str]]] = []
        for i, unit in enumerate(units):
            msg = add(unit, docs)
            if msg is None:
                continue
            if not self.args.skip_bad_lines:
                return {"lines": len(units), "bytes": nbytes, "error": (i, msg)}, []
            bad.append((i, msg))
        return {"lines": len(units), "bytes": nbytes, "docs": len(docs), "skipped": bad}, docs

    def _parse_records(self, records: Records) -> Tuple[dict, List[Dict[str, List[str]]]]:
        """Rows of a Parquet or Arrow file: each row's ``--json-keys`` values, checked as a JSON line's are."""
        keys = self.args.json_keys
        columns = [records.columns[k] for k in keys]
        rows = [dict(zip(keys, values)) for values in zip(*columns)]
        return self._collect(rows, self._add, records.nbytes)

    def _parse_text(self, data: bytes) -> Tuple[dict, List[Dict[str, List[str]]]]:
        """A text task: each line a document (its line end removed; empty lines skipped), or, with
        ``--text-document-per file``, the whole text one document. Text must be UTF-8."""
        key = self.args.json_keys[0]
        if self.args.text_document_per == "file":
            units = [data]
        else:
            units = data.split(b"\n")
            if not units[-1]:
                units.pop()  # the text after the last newline (empty unless the file ends without one)

        def add(unit: bytes, docs: List[Dict[str, List[str]]]) -> Optional[str]:
            if self.args.text_document_per == "line":
                unit = unit[:-1] if unit.endswith(b"\r") else unit
                if not unit:
                    return None
            try:
                text = unit.decode("utf-8")
            except UnicodeDecodeError as err:
                return f"not UTF-8 text ({err})"
            return self._add({key: text}, docs)

        return self._collect(units, add, len(data))

    def _parse(self, line: Union[str, bytes], docs: List[Dict[str, List[str]]]) -> Optional[str]:
        """Appends the line's document to ``docs``; returns what is wrong with the line instead, if anything.

        Lines are parsed by ``orjson`` where it is installed; a line it refuses (it is stricter: NaN, lone
        surrogates, a BOM) or whose document is not what we need is parsed again by ``json``, so what is accepted,
        what is stored and every message are ``json``'s."""
        if _FAST_LOADS is not None:
            try:
                data = _FAST_LOADS(line)
            except Exception:
                data = None
            if isinstance(data, dict) and self._add(data, docs) is None:
                return None
        if not (line.strip(" \t\n\r\x0b\x0c") if isinstance(line, str) else line.strip()):  # ASCII space only
            return "empty line (expected a JSON object)"
        if isinstance(line, str) and (line[:1] == "\ufeff" or "\x00" in line[:4]):
            line = line.encode("utf-8")  # json's own encoding detection (a BOM, UTF-16/32) works on the bytes
        try:
            data = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: nested too deeply
            return f"invalid JSON ({err})"
        return self._add(data, docs)

    def _add(self, data, docs: List[Dict[str, List[str]]]) -> Optional[str]:
        """Appends the parsed line's document to ``docs``, or returns what is wrong with it."""
        args = self.args
        if not isinstance(data, dict):
            return f"expected a JSON object, got {type(data).__name__}"
        missing = [k for k in args.json_keys if k not in data]
        if missing:
            return f"missing key(s) {missing} (--json-keys {' '.join(args.json_keys)})"
        doc: Dict[str, List[str]] = {}
        for key in args.json_keys:
            value = data[key]
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                doc[key] = value
            elif isinstance(value, str):
                doc[key] = split_sentences(value, args.keep_newlines) if args.split_sentences else [value]
            else:
                return f"key '{key}' holds {type(value).__name__}, expected text"
        docs.append(doc)
        return None

    def _tokenize(self, doc_sentences: List[List[str]]):
        """(tokens in the output dtype, sequence lengths, sequences per document) for the documents' sentences:
        empty sentences dropped, eod appended to each non-empty document with --append-eod."""
        per_doc = numpy.fromiter(map(len, doc_sentences), dtype=numpy.int64, count=len(doc_sentences))
        sentences = [s for doc in doc_sentences for s in doc]
        if sentences:
            flat, lengths = Encoder.tokenizer.tokenize_batch_flat(sentences)
        else:
            flat, lengths = numpy.zeros(0, numpy.int64), numpy.zeros(0, numpy.int64)
        kept = lengths > 0
        doc_of = numpy.repeat(numpy.arange(len(doc_sentences)), per_doc)
        doc_counts = numpy.bincount(doc_of[kept], minlength=len(doc_sentences)).astype(numpy.int64)
        lengths = lengths[kept]
        if self.args.append_eod and lengths.size:
            last = numpy.cumsum(doc_counts)[doc_counts > 0] - 1  # each document's last sequence
            flat = numpy.insert(flat, numpy.cumsum(lengths)[last], Encoder.tokenizer.eod)
            lengths[last] += 1
        return flat.astype(Encoder.dtype), lengths, doc_counts


def make_tokenizer(args):
    return build_tokenizer(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        vocab_extra_ids=args.vocab_extra_ids,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
    )
