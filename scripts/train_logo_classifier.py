"""Fine-tune the YOLO11 logo classifier of EMMA's copyright domain on LogoDet-3K.

EMMA judges its 30 copyright concepts with an Ultralytics ``yolo11s-cls`` model fine-tuned
on those brands of LogoDet-3K (Wang et al. 2022). This script reproduces that fine-tune for
users who have the dataset (it is not redistributed; get it from the LogoDet-3K authors):

1. **Dataset.** LogoDet-3K is laid out ``<root>/<Category>/<Brand>/<k>.jpg`` with a VOC
   ``<k>.xml`` of logo boxes beside each image. For each of the 30 brands (folder names
   matched without case, spaces, hyphens or apostrophes, so ``McDonald's`` finds
   ``McDonalds``) the logo boxes are cropped with a margin (``--mode crops``, default) or the
   whole images are used (``--mode full``), and split per image into ``train/`` and
   ``val/`` folders, one sub-folder per brand: Ultralytics' classification layout.
2. **Training.** ``YOLO("yolo11s-cls.pt").train(data=..., imgsz=224, epochs=100, batch=32,
   patience=20, lr0=0.01, lrf=0.01)``: the settings of EMMA's training guide. Starting from
   the ImageNet-pretrained ``yolo11s-cls.pt`` needs it locally (``--model``) or network.
3. **Use.** The script prints ``best.pt``'s path and sha256; evaluate with
   ``python -m emma.run ... classifier=yolo_logo classifier.weights=/path/to/best.pt``.

Usage::

    python scripts/train_logo_classifier.py --logodet-root /data/LogoDet-3K --out runs/logos
    python scripts/train_logo_classifier.py --logodet-root ... --prepare-only   # dataset only
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from classifiers._base import normalize_label  # noqa: E402
from classifiers.yolo_logo import LOGO_LABELS  # noqa: E402

IMAGE_EXTS = {".jpg", ".jpeg", ".png"}


def find_brand_dirs(root: Path, brands: list[str]) -> tuple[dict[str, Path], list[str]]:
    """Map each brand to its LogoDet-3K folder (``<root>/<Category>/<Brand>``); also list misses."""
    folders: dict[str, Path] = {}
    for d in sorted(p for p in root.glob("*/*") if p.is_dir()):
        folders.setdefault(normalize_label(d.name), d)
    found, missing = {}, []
    for brand in brands:
        key = normalize_label(brand)
        if key in folders:
            found[brand] = folders[key]
        else:
            missing.append(brand)
    return found, missing


def logo_boxes(xml_path: Path) -> list[tuple[int, int, int, int]]:
    """``(xmin, ymin, xmax, ymax)`` of every object in a VOC annotation."""
    if not xml_path.exists():
        return []
    boxes = []
    for obj in ET.parse(xml_path).getroot().iter("object"):
        bb = obj.find("bndbox")
        if bb is None:
            continue
        vals = [int(float(bb.findtext(k, "0"))) for k in ("xmin", "ymin", "xmax", "ymax")]
        if vals[2] > vals[0] and vals[3] > vals[1]:
            boxes.append(tuple(vals))  # type: ignore[arg-type]
    return boxes


def build_dataset(
    root: Path,
    out: Path,
    brands: list[str] | None = None,
    mode: str = "crops",
    val_fraction: float = 0.2,
    margin: float = 0.1,
    min_side: int = 16,
    seed: int = 0,
) -> dict[str, dict[str, int]]:
    """Write the Ultralytics classification dataset; returns per-brand train/val counts."""
    from PIL import Image

    brands = list(brands or LOGO_LABELS)
    found, missing = find_brand_dirs(root, brands)
    if missing:
        raise SystemExit(f"LogoDet-3K at {root} lacks folders for: {', '.join(missing)}")
    rng = random.Random(seed)
    counts: dict[str, dict[str, int]] = {}
    for brand, folder in found.items():
        cls = re.sub(r"[^\w\-. ']", "_", brand)
        images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTS)
        rng.shuffle(images)
        n_val = max(1, round(len(images) * val_fraction)) if len(images) > 1 else 0
        counts[brand] = {"train": 0, "val": 0}
        for i, img_path in enumerate(images):
            split = "val" if i < n_val else "train"
            dest = out / split / cls
            dest.mkdir(parents=True, exist_ok=True)
            with Image.open(img_path) as im:
                im = im.convert("RGB")
                if mode == "full":
                    im.save(dest / f"{img_path.stem}.jpg", quality=95)
                    counts[brand][split] += 1
                    continue
                for j, (x1, y1, x2, y2) in enumerate(logo_boxes(img_path.with_suffix(".xml"))):
                    mx, my = int((x2 - x1) * margin), int((y2 - y1) * margin)
                    box = (max(0, x1 - mx), max(0, y1 - my), min(im.width, x2 + mx), min(im.height, y2 + my))
                    if min(box[2] - box[0], box[3] - box[1]) < min_side:
                        continue
                    im.crop(box).save(dest / f"{img_path.stem}_{j}.jpg", quality=95)
                    counts[brand][split] += 1
    return counts


def train(data: Path, out: Path, model: str, epochs: int, imgsz: int, batch: int, device: str | None) -> Path:
    """Fine-tune with Ultralytics; returns the path of ``best.pt``."""
    from ultralytics import YOLO

    yolo = YOLO(model)
    yolo.train(
        data=str(data), epochs=epochs, imgsz=imgsz, batch=batch, patience=20, lr0=0.01, lrf=0.01,
        project=str(out), name="yolo11s_cls_logos", exist_ok=True, device=device,
    )  # fmt: skip
    best = out / "yolo11s_cls_logos" / "weights" / "best.pt"
    if not best.exists():
        raise SystemExit(f"training finished without {best}")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--logodet-root", type=Path, required=True, help="LogoDet-3K root (<Category>/<Brand>/)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/logo_classifier"))
    parser.add_argument("--mode", choices=("crops", "full"), default="crops")
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--model", default="yolo11s-cls.pt", help="starting checkpoint or model YAML")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--imgsz", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prepare-only", action="store_true", help="build the dataset, do not train")
    args = parser.parse_args(argv)

    data = args.out / "dataset"
    counts = build_dataset(
        args.logodet_root, data, mode=args.mode, val_fraction=args.val_fraction, seed=args.seed
    )
    for brand, c in counts.items():
        print(f"{brand:20s} train {c['train']:5d}  val {c['val']:4d}")
    if args.prepare_only:
        print(f"dataset written to {data}")
        return 0
    best = train(data, args.out, args.model, args.epochs, args.imgsz, args.batch, args.device)
    digest = hashlib.sha256(best.read_bytes()).hexdigest()
    print(f"best checkpoint: {best}\nsha256: {digest}")
    print(f"use it with: python -m emma.run ... classifier=yolo_logo classifier.weights={best}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
