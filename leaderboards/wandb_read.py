"""Read a local W&B run back: config, history, summary and the media they reference.

Since wandb 0.2x the SDK writes a run's config, history and summary only into the binary
``run-<id>.wandb`` transaction log (``files/`` holds just media, tables and requirements).
This module decodes that log so an offline run can be checked before ``wandb sync``:

    python -m leaderboards.wandb_read <out>/wandb/offline-run-*     # prints JSON

The log is LevelDB's log format (a 7-byte file header ``:W&B``, magic ``0xBEE1``, version 0;
32 KiB blocks of chunks, each with a CRC-32 of its type byte and data, a length and a type:
full / first / middle / last). Each reassembled record is a ``wandb.proto.wandb_internal_pb2.Record``
and is parsed with wandb's own protobuf classes; values arrive as JSON strings (``value_json``)
or typed fields and are decoded here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

from emma import exit_codes
from emma.errors import EmmaError

FILE_HEADER = struct.Struct("<4sHB")
FILE_IDENT, FILE_MAGIC, FILE_VERSION = b":W&B", 0xBEE1, 0
CHUNK_HEADER = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbReadError(EmmaError):
    """A run folder or .wandb file that cannot be read back."""


@dataclasses.dataclass
class WandbRun:
    """What a run recorded: ``config`` and ``summary`` as nested dicts, ``history`` one dict
    per logged step (media values are wandb's JSON descriptors: ``{"_type": "image-file",
    "path": "media/images/...png", ...}``, paths relative to ``files_dir``)."""

    run_id: str
    project: str
    job_type: str
    display_name: str
    config: dict[str, Any]
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    files_dir: Path
    record_types: dict[str, int]
    # artifact name -> {"type": ..., "entries": {path in the artifact: staged local file}}
    artifacts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def media_path(self, value: dict[str, Any]) -> Path:
        """The local file behind a media value (image, table, ...)."""
        return self.files_dir / value["path"]

    def table(self, key: str) -> dict[str, Any]:
        """The table logged under ``key``: ``{"columns": [...], "data": [[...], ...]}``.

        Read from the run's table artifact when it is staged (there media cells are wandb's
        descriptors, each with ``local_path`` added: the staged file); otherwise from the copy
        in ``files/``, where wandb 0.31 writes media cells as placeholders (``"Image"``)."""
        value = next((step[key] for step in self.history if key in step), None)
        if value is None:
            raise KeyError(f"no table logged under {key!r}; logged keys: {sorted(self.keys())}")
        for art in self.artifacts.values():
            entries = art["entries"]
            local = entries.get(f"{key}.table.json")
            if art["type"] == "run_table" and local is not None and Path(local).is_file():
                table = json.loads(Path(local).read_text())
                for row in table["data"]:
                    for cell in row:
                        if isinstance(cell, dict) and cell.get("path") in entries:
                            cell["local_path"] = str(entries[cell["path"]])
                return table
        return json.loads(self.media_path(value).read_text())

    def keys(self) -> set[str]:
        return {k for step in self.history for k in step}


def read_records(path: Path) -> list[bytes]:
    """The raw records of a ``.wandb`` transaction log, checksums verified."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size:
        raise WandbReadError(f"{path}: {len(data)} bytes is too short for a .wandb file")
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (FILE_IDENT, FILE_MAGIC, FILE_VERSION):
        raise WandbReadError(f"{path}: not a .wandb log (header {ident!r}, magic {magic:#x}, version {version}; "
                             f"expected {FILE_IDENT!r}, {FILE_MAGIC:#x}, {FILE_VERSION})")
    records: list[bytes] = []
    pending: list[bytes] | None = None
    pos = FILE_HEADER.size
    while pos + CHUNK_HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER.size:  # block trailer: zero padding
            pos += left
            continue
        checksum, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if (checksum, length, kind) == (0, 0, 0):  # zero fill at the end of a block or file
            pos += left
            continue
        start = pos + CHUNK_HEADER.size
        chunk = data[start:start + length]
        if len(chunk) < length:
            break  # a record still being written (an unfinished run): stop before it
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            raise WandbReadError(f"{path}: checksum mismatch in the chunk at byte {pos}")
        pos = start + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = [chunk]
        elif kind in (MIDDLE, LAST) and pending is not None:
            pending.append(chunk)
            if kind == LAST:
                records.append(b"".join(pending))
                pending = None
        else:
            raise WandbReadError(f"{path}: chunk type {kind} at byte {pos - length - CHUNK_HEADER.size} "
                                 "is out of sequence")
    return records


def _set(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def _item_keys(item: Any) -> list[str]:
    return list(item.nested_key) if item.nested_key else [item.key]


def _history_value(item: Any) -> Any:
    which = item.WhichOneof("value")
    if which is None:
        return json.loads(item.value_json) if item.value_json else None
    if which == "none":
        return None
    if which == "json":
        return json.loads(item.json)
    return getattr(item, which)


def _unwrap_config(value: Any) -> Any:
    # config items are stored as {"value": ..., "desc": ...}
    return value.get("value") if isinstance(value, dict) and "value" in value else value


def read_run(run_dir: str | Path) -> WandbRun:
    """Decode the run in ``run_dir`` (a folder holding one ``run-*.wandb``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(run_dir)
    logs = sorted(run_dir.glob("run-*.wandb"))
    if len(logs) != 1:
        raise WandbReadError(f"{run_dir}: expected one run-*.wandb file, found {len(logs)}")
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    artifacts: dict[str, dict[str, Any]] = {}
    run_id = project = job_type = display_name = ""
    for raw in read_records(logs[0]):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type") or "none"
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "run":
            r = rec.run
            run_id, project, job_type, display_name = r.run_id, r.project, r.job_type, r.display_name
            for item in r.config.update:
                _set(config, _item_keys(item), _unwrap_config(json.loads(item.value_json)))
            for item in r.summary.update:
                _set(summary, _item_keys(item), json.loads(item.value_json))
        elif kind == "config":
            for item in rec.config.update:
                _set(config, _item_keys(item), _unwrap_config(json.loads(item.value_json)))
        elif kind == "history":
            step: dict[str, Any] = {}
            for item in rec.history.item:
                _set(step, _item_keys(item), _history_value(item))
            history.append(step)
        elif kind == "summary":
            for item in rec.summary.update:
                _set(summary, _item_keys(item), json.loads(item.value_json))
        elif kind == "artifact":
            a = rec.artifact
            artifacts[a.name] = {"type": a.type, "digest": a.digest,
                                 "entries": {e.path: e.local_path for e in a.manifest.contents}}
    config.pop("_wandb", None)
    return WandbRun(run_id=run_id, project=project, job_type=job_type, display_name=display_name,
                    config=config, history=history, summary=summary, files_dir=run_dir / "files",
                    record_types=counts, artifacts=artifacts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leaderboards.wandb_read", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a W&B run folder (offline-run-* or run-*)")
    args = ap.parse_args(argv)
    try:
        run = read_run(args.run_dir)
    except (WandbReadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return exit_codes.USER_ERROR
    out = dataclasses.asdict(run)
    out["files_dir"] = str(run.files_dir)
    print(json.dumps(out, indent=1, default=str))
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
