"""Generate the label lists that ship in ``classifiers/data/`` from the checkpoints' own files.

The lists are small metadata that the classifiers need even without their weights (random-init
tests, label lookup, "which concepts can this judge never detect"). Each comes from the file
that accompanies the checkpoint upstream:

- ``gcd_labels.txt``: GIPHY Celebrity Detector ``resources/face_recognition/labels.csv``
  (``Labels,Index`` rows). GIPHY's ``Labels`` class sorts the rows by label and numbers them
  in that order, which is the order of the network's 2,306 outputs; one raw label per line.
- ``style_vit_config.json``: the UnlearnDiffAtk ``checkpoint-2800/config.json`` without the
  redundant ``label2id`` (architecture + ``id2label`` for the 129 classes).
- ``ml_decoder_coco_labels.txt``: ``idx_to_class`` of the ML-Decoder COCO checkpoint when
  given (``--ml-decoder-checkpoint``), else the MS-COCO 2017 category names in category-id
  order, which is how the ML-Decoder COCO loader numbers them.
- ``yolo_logo_labels.txt``: the class names of a fine-tuned YOLO logo checkpoint when given
  (``--yolo-checkpoint``), else the 30 LogoDet-3K brands of EMMA's copyright domain, spelled
  as in EMMA's evaluation (``LOGO_DISPLAY_NAMES``).

Usage::

    python scripts/make_label_files.py [--meta-dir DIR] [--ml-decoder-checkpoint PTH]
                                       [--yolo-checkpoint PT] [--check]

``--meta-dir`` defaults to ``$EMMA_SHARED_DATA/emma/classifier-meta`` (or ``../shared/data``
beside the repository). ``--check`` compares instead of writing and exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "classifiers" / "data"

COCO_2017_CATEGORIES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange",
    "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant",
    "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors",
    "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip

# EMMA classifier/YOLO/src/batch_predict_logos.py: LOGOS with LOGO_DISPLAY_NAMES applied
EMMA_LOGOS = (
    "Heineken", "Nestle", "GUINNESS", "McDonald's", "Asics", "Gap", "Converse", "Lacoste",
    "Colgate", "Nivea", "Gillette", "Pantene", "Neutrogena", "Apple", "Canon", "ASUS", "HTC",
    "BMW", "Lexus", "Lamborghini", "Chevrolet", "Michelin", "Marvel", "Barbie", "Hot Wheels",
    "play-doh", "Spalding", "Oakley", "under armour", "Adidas SB",
)  # fmt: skip


def default_meta_dir() -> Path:
    env = os.environ.get("EMMA_SHARED_DATA")
    base = Path(env) if env else REPO.parent / "shared" / "data"
    return base / "emma" / "classifier-meta"


def gcd_labels(csv_path: Path) -> str:
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    if rows and rows[0][:1] == ["Labels"]:
        rows = rows[1:]
    labels = sorted(r[0] for r in rows if r)  # GIPHY's Labels: sorted by name = model order
    if len(set(labels)) != len(labels):
        raise SystemExit(f"{csv_path}: duplicate labels")
    return "\n".join(labels) + "\n"


def style_vit_config(config_path: Path) -> str:
    cfg = json.loads(config_path.read_text())
    cfg.pop("label2id", None)
    cfg["id2label"] = {str(k): cfg["id2label"][str(k)] for k in sorted(map(int, cfg["id2label"]))}
    cfg = {k: cfg[k] for k in sorted(cfg)}
    return json.dumps(cfg, indent=2) + "\n"


def ml_decoder_labels(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "\n".join(COCO_2017_CATEGORIES) + "\n"
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    idx_to_class = state["idx_to_class"]
    return "\n".join(str(idx_to_class[k]) for k in sorted(idx_to_class, key=int)) + "\n"


def yolo_labels(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "\n".join(EMMA_LOGOS) + "\n"
    from ultralytics import YOLO

    names = YOLO(str(checkpoint)).names
    return "\n".join(names[i] for i in sorted(names)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meta-dir", type=Path, default=default_meta_dir())
    parser.add_argument("--ml-decoder-checkpoint", type=Path, default=None)
    parser.add_argument("--yolo-checkpoint", type=Path, default=None)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)

    outputs = {
        "gcd_labels.txt": gcd_labels(args.meta_dir / "gcd_labels.csv"),
        "style_vit_config.json": style_vit_config(args.meta_dir / "style_vit_config.json"),
        "ml_decoder_coco_labels.txt": ml_decoder_labels(args.ml_decoder_checkpoint),
        "yolo_logo_labels.txt": yolo_labels(args.yolo_checkpoint),
    }
    differ = []
    for name, text in outputs.items():
        path = args.out_dir / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                differ.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if differ:
        print(f"out of date: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
