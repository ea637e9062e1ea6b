"""GIPHY Celebrity Detector (GCD): EMMA's judge of the celebrity domain.

Pipeline of ``Giphy/celeb-detection-oss`` (as EMMA runs it on single images):

1. **Face detection** with MTCNN (Zhang et al. 2016; the TensorFlow port of facenet, weights
   ``det1/2/3.npy``): image pyramid (min face 20 px, factor 0.709), P-Net proposals, R-Net
   and O-Net refinement (thresholds 0.6 / 0.7 / 0.7), bounding-box regression and NMS.
   :class:`MTCNN` re-implements the three networks in PyTorch with the facenet layer names,
   so the ``.npy`` files load directly (:func:`mtcnn_state_dict_from_npy`).
2. **Crop** each face with a 20% margin and resize it to 224x224 (bilinear), scaled to
   [0, 1] without normalisation (``ToTensor``).
3. **Identify** with a ResNet-50 whose pooled features go through a 256-d bottleneck
   (``fc1``, the centre-loss embedding) and a 2,306-way classifier (``fc2``); softmax.
   The checkpoint ``best_model_states.pkl`` holds ``{"model_state": ...}`` of GIPHY's
   ``ResNetCenterLoss`` wrapper, whose key names :class:`GCDRecognizer` reproduces.
4. **Aggregate** the faces of an image: faces are grouped by identity, the largest group
   wins, and its probability vectors are multiplied and renormalised (GIPHY clusters the
   face embeddings with a Gaussian mixture initialised at the identities' centre-loss
   centres; grouping by the top-1 identity is the same partition whenever each face sits
   nearest its own identity's centre, and needs no scikit-learn).

``predict`` returns that vector per image (all zeros when no face is found). EMMA counts the
celebrity as present when it is the top-1 identity. The label list (2,306 GIPHY labels such
as ``Brad_Pitt_[m.0c6qh]``, in the model's output order) ships as
``classifiers/data/gcd_labels.txt``; concepts are matched on the name without the Freebase
id, spelling-insensitively (``brad-pitt``). :meth:`GCDClassifier.undetectable` lists the
concepts GCD has no label for (EMMA's Chadwick Boseman, Ellen DeGeneres and Jon Voight).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from classifiers._base import (
    DATA_DIR,
    PretrainedClassifier,
    check_images,
    load_numpy_pickle,
    load_torch_checkpoint,
    to_uint8_hwc,
)
from emma.errors import ConfigError

#: raw GIPHY labels (``Name_[freebase id]``) in the network's output order
GCD_RAW_LABELS: tuple[str, ...] = tuple(
    line.rstrip("\n") for line in (DATA_DIR / "gcd_labels.txt").read_text().splitlines() if line.strip()
)


def display_name(raw_label: str) -> str:
    """``Brad_Pitt_[m.0c6qh]`` -> ``Brad Pitt`` (EMMA's comparison form)."""
    return raw_label.split("_[", 1)[0].replace("_", " ")


GCD_LABELS: tuple[str, ...] = tuple(display_name(lab) for lab in GCD_RAW_LABELS)


# ---------------------------------------------------------------------------------------------
# MTCNN (P-Net, R-Net, O-Net) with facenet's layer names


def _max_pool_same(x: torch.Tensor, k: int, s: int) -> torch.Tensor:
    """TensorFlow ``SAME`` max-pooling (pads the end more than the start, with -inf)."""
    pads = []
    for n in (x.shape[-1], x.shape[-2]):
        out = math.ceil(n / s)
        total = max((out - 1) * s + k - n, 0)
        pads += [total // 2, total - total // 2]
    return F.max_pool2d(F.pad(x, pads, value=float("-inf")), k, s)


class _TFDense(nn.Linear):
    """Dense layer over a TF-ordered (NHWC) flattening of a NCHW map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x.ndim == 4:
            x = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)
        return super().forward(x)


class PNet(nn.Module):
    """Proposal network: fully convolutional, 12x12 receptive field, stride 2."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.PReLU1 = nn.Conv2d(3, 10, 3), nn.PReLU(10)
        self.conv2, self.PReLU2 = nn.Conv2d(10, 16, 3), nn.PReLU(16)
        self.conv3, self.PReLU3 = nn.Conv2d(16, 32, 3), nn.PReLU(32)
        self.conv4_1 = nn.Conv2d(32, 2, 1)
        self.conv4_2 = nn.Conv2d(32, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = _max_pool_same(self.PReLU1(self.conv1(x)), 2, 2)
        x = self.PReLU3(self.conv3(self.PReLU2(self.conv2(x))))
        return self.conv4_2(x), self.conv4_1(x).softmax(dim=1)


class RNet(nn.Module):
    """Refinement network on 24x24 crops."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 28, 3), nn.PReLU(28)
        self.conv2, self.prelu2 = nn.Conv2d(28, 48, 3), nn.PReLU(48)
        self.conv3, self.prelu3 = nn.Conv2d(48, 64, 2), nn.PReLU(64)
        self.conv4, self.prelu4 = _TFDense(576, 128), nn.PReLU(128)
        self.conv5_1 = nn.Linear(128, 2)
        self.conv5_2 = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = _max_pool_same(self.prelu1(self.conv1(x)), 3, 2)
        x = F.max_pool2d(self.prelu2(self.conv2(x)), 3, 2)
        x = self.prelu4(self.conv4(self.prelu3(self.conv3(x))))
        return self.conv5_2(x), self.conv5_1(x).softmax(dim=1)


class ONet(nn.Module):
    """Output network on 48x48 crops (box, 5 landmarks, face probability)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
        self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
        self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
        self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
        self.conv5, self.prelu5 = _TFDense(1152, 256), nn.PReLU(256)
        self.conv6_1 = nn.Linear(256, 2)
        self.conv6_2 = nn.Linear(256, 4)
        self.conv6_3 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = _max_pool_same(self.prelu1(self.conv1(x)), 3, 2)
        x = F.max_pool2d(self.prelu2(self.conv2(x)), 3, 2)
        x = _max_pool_same(self.prelu3(self.conv3(x)), 2, 2)
        x = self.prelu5(self.conv5(self.prelu4(self.conv4(x))))
        return self.conv6_2(x), self.conv6_3(x), self.conv6_1(x).softmax(dim=1)


def mtcnn_state_dict_from_npy(
    data: dict[str, dict[str, np.ndarray]], net: nn.Module
) -> dict[str, torch.Tensor]:
    """facenet ``det*.npy`` content (``{layer: {weights|biases|alpha: array}}``) -> state dict.

    TF convolution kernels are ``(kh, kw, in, out)``; dense kernels ``(in, out)`` over an NHWC
    flattening, which :class:`_TFDense` reproduces; PReLU slopes are ``alpha``.
    """
    own = net.state_dict()
    out: dict[str, torch.Tensor] = {}
    for layer, params in data.items():
        name = layer.replace("-", "_")
        for pname, value in params.items():
            arr = torch.from_numpy(np.asarray(value, dtype=np.float32))
            if pname == "weights":
                key = f"{name}.weight"
                arr = arr.permute(3, 2, 0, 1) if arr.ndim == 4 else arr.T
            elif pname == "biases":
                key = f"{name}.bias"
            elif pname == "alpha":
                key = f"{name}.weight"
            else:
                raise KeyError(f"unexpected MTCNN parameter {layer}/{pname}")
            if key not in own or own[key].shape != arr.shape:
                raise KeyError(
                    f"MTCNN parameter {layer}/{pname} {tuple(arr.shape)} does not fit {type(net).__name__}"
                )
            out[key] = arr.contiguous()
    missing = set(own) - set(out)
    if missing:
        raise KeyError(f"MTCNN weights lack {sorted(missing)} for {type(net).__name__}")
    return out


def _nms(boxes: np.ndarray, threshold: float, method: str = "union") -> np.ndarray:
    """Greedy NMS on ``[x1, y1, x2, y2, score]`` rows with MTCNN's +1 pixel areas."""
    if boxes.size == 0:
        return np.empty(0, dtype=np.int64)
    x1, y1, x2, y2, s = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3], boxes[:, 4]
    area = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = np.argsort(s)
    keep = []
    while order.size > 0:
        i = order[-1]
        keep.append(i)
        rest = order[:-1]
        w = np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]) + 1)
        h = np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]) + 1)
        inter = w * h
        if method == "min":
            overlap = inter / np.minimum(area[i], area[rest])
        else:
            overlap = inter / (area[i] + area[rest] - inter)
        order = rest[overlap <= threshold]
    return np.asarray(keep, dtype=np.int64)


def _square(boxes: np.ndarray) -> np.ndarray:
    """Grow boxes into squares around their centres."""
    boxes = boxes.copy()
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    side = np.maximum(w, h)
    boxes[:, 0] += w * 0.5 - side * 0.5
    boxes[:, 1] += h * 0.5 - side * 0.5
    boxes[:, 2] = boxes[:, 0] + side
    boxes[:, 3] = boxes[:, 1] + side
    return boxes


def _regress(boxes: np.ndarray, reg: np.ndarray, plus_one: bool = True) -> np.ndarray:
    boxes = boxes.copy()
    w = boxes[:, 2] - boxes[:, 0] + (1 if plus_one else 0)
    h = boxes[:, 3] - boxes[:, 1] + (1 if plus_one else 0)
    boxes[:, 0] += reg[:, 0] * w
    boxes[:, 1] += reg[:, 1] * h
    boxes[:, 2] += reg[:, 2] * w
    boxes[:, 3] += reg[:, 3] * h
    return boxes


def _resample(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Area resampling to ``(h, w)``, as facenet's ``cv2.resize(..., INTER_AREA)``."""
    try:
        import cv2

        return cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_AREA)
    except ImportError:
        t = torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32)).permute(2, 0, 1)[None]
        return F.interpolate(t, size=size, mode="area")[0].permute(1, 2, 0).numpy()


def _crops(img: np.ndarray, boxes: np.ndarray, size: int) -> np.ndarray:
    """Zero-padded crops of integer boxes, resized to ``size``; facenet's 1-based indexing
    (a box ``[x1, y1, x2, y2]`` covers 0-based columns ``x1-1 .. x2-1``)."""
    h, w = img.shape[:2]
    out = np.zeros((len(boxes), size, size, 3), dtype=np.float32)
    for k, (x1, y1, x2, y2) in enumerate(boxes[:, :4].astype(np.int64)):
        bw, bh = int(x2 - x1 + 1), int(y2 - y1 + 1)
        if bw <= 0 or bh <= 0:
            continue
        tmp = np.zeros((bh, bw, 3), dtype=np.float32)
        sx0, sy0 = max(x1 - 1, 0), max(y1 - 1, 0)
        sx1, sy1 = min(x2, w), min(y2, h)
        if sx1 > sx0 and sy1 > sy0:
            tmp[sy0 - (y1 - 1) : sy1 - (y1 - 1), sx0 - (x1 - 1) : sx1 - (x1 - 1)] = img[sy0:sy1, sx0:sx1]
        out[k] = _resample(tmp, (size, size))
    return out


class MTCNN(nn.Module):
    """The MTCNN face detector with facenet's settings.

    Args:
        min_size: smallest face (pixels) the pyramid looks for.
        thresholds: face-probability thresholds of P-, R- and O-Net.
        factor: pyramid scale step.
    """

    def __init__(
        self, min_size: int = 20, thresholds: Sequence[float] = (0.6, 0.7, 0.7), factor: float = 0.709
    ) -> None:
        super().__init__()
        self.pnet, self.rnet, self.onet = PNet(), RNet(), ONet()
        self.min_size, self.thresholds, self.factor = min_size, tuple(thresholds), factor

    def load_npy(
        self, det1: str | os.PathLike[str], det2: str | os.PathLike[str], det3: str | os.PathLike[str]
    ) -> None:
        """Load facenet's ``det1.npy`` (P-Net), ``det2.npy`` (R-Net), ``det3.npy`` (O-Net)."""
        for net, path in ((self.pnet, det1), (self.rnet, det2), (self.onet, det3)):
            net.load_state_dict(mtcnn_state_dict_from_npy(load_numpy_pickle(path), net), strict=True)

    def _run(self, net: nn.Module, batch: np.ndarray) -> tuple[np.ndarray, ...]:
        # facenet feeds images transposed (x <-> y): the Caffe MTCNN was trained that way
        x = torch.from_numpy((batch - 127.5) * 0.0078125).permute(0, 3, 2, 1).float()
        p = next(net.parameters())
        with torch.no_grad():
            outs = net(x.to(p.device, p.dtype))
        return tuple(o.float().cpu().numpy() for o in outs)

    @torch.no_grad()
    def detect(self, img: np.ndarray) -> np.ndarray:
        """Face boxes ``(K, 5)`` = ``[x1, y1, x2, y2, score]`` in pixels of a uint8 RGB image."""
        raw = np.ascontiguousarray(np.asarray(img)[:, :, :3])
        img = raw.astype(np.float32)
        h, w = img.shape[:2]
        m = 12.0 / self.min_size
        scales, side = [], min(h, w) * m
        while side >= 12:
            scales.append(m * self.factor ** len(scales))
            side *= self.factor

        # stage 1: P-Net over the pyramid
        found = []
        for scale in scales:
            hs, ws = int(math.ceil(h * scale)), int(math.ceil(w * scale))
            # the pyramid is resampled from the uint8 image (rounded, as cv2 does), crops below
            # from the float image, exactly as facenet does
            reg, prob = self._run(self.pnet, _resample(raw, (hs, ws)).astype(np.float32)[None])
            # outputs are (1, C, W', H') (transposed input); index them as [row=y, col=x]
            score = prob[0, 1].T
            reg = reg[0].transpose(0, 2, 1)
            ys, xs = np.where(score >= self.thresholds[0])
            if len(ys) == 0:
                continue
            boxes = np.stack(
                [
                    np.fix((2 * xs + 1) / scale),
                    np.fix((2 * ys + 1) / scale),
                    np.fix((2 * xs + 12) / scale),
                    np.fix((2 * ys + 12) / scale),
                    score[ys, xs],
                    *(reg[c, ys, xs] for c in range(4)),
                ],
                axis=1,
            )
            found.append(boxes[_nms(boxes, 0.5, "union")])
        if not found:
            return np.zeros((0, 5), dtype=np.float32)
        boxes = np.concatenate(found)
        boxes = boxes[_nms(boxes, 0.7, "union")]
        boxes = np.concatenate([_regress(boxes[:, :4], boxes[:, 5:9], plus_one=False), boxes[:, 4:5]], axis=1)
        boxes = _square(boxes)
        boxes[:, :4] = np.fix(boxes[:, :4])

        # stage 2: R-Net
        reg, prob = self._run(self.rnet, _crops(img, boxes, 24))
        keep = prob[:, 1] > self.thresholds[1]
        boxes = np.concatenate([boxes[keep, :4], prob[keep, 1:2]], axis=1)
        reg = reg[keep]
        if len(boxes) == 0:
            return np.zeros((0, 5), dtype=np.float32)
        pick = _nms(boxes, 0.7, "union")
        boxes = _square(np.concatenate([_regress(boxes[pick, :4], reg[pick]), boxes[pick, 4:5]], axis=1))

        # stage 3: O-Net
        boxes = np.fix(boxes)
        reg, _landmarks, prob = self._run(self.onet, _crops(img, boxes, 48))
        keep = prob[:, 1] > self.thresholds[2]
        boxes = np.concatenate([boxes[keep, :4], prob[keep, 1:2]], axis=1)
        if len(boxes) == 0:
            return np.zeros((0, 5), dtype=np.float32)
        boxes = np.concatenate([_regress(boxes[:, :4], reg[keep]), boxes[:, 4:5]], axis=1)
        return boxes[_nms(boxes, 0.7, "min")].astype(np.float32)


# ---------------------------------------------------------------------------------------------
# identity classifier


class _ResNetBottleneck(nn.Module):
    """GIPHY's ``AdaptResNetBottleneck``: ResNet-50 trunk, 256-d ``fc1`` embedding, ``fc2`` logits."""

    def __init__(self, num_classes: int, embedding_size: int = 256) -> None:
        super().__init__()
        from torchvision.models import resnet50

        trunk = resnet50(weights=None)
        self.stem = nn.Sequential(*list(trunk.children())[:-1])
        self.fc1 = nn.Linear(trunk.fc.in_features, embedding_size)
        self.fc2 = nn.Linear(embedding_size, num_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedding = self.fc1(self.stem(x).flatten(1))
        return self.fc2(embedding), embedding


class _CentreLoss(nn.Module):
    def __init__(self, num_classes: int, embedding_size: int) -> None:
        super().__init__()
        self.centers = nn.Parameter(torch.randn(num_classes, embedding_size))


class GCDRecognizer(nn.Module):
    """GIPHY's ``ResNetCenterLoss`` (state-dict compatible): ``model`` + ``center_loss_criterion``."""

    def __init__(self, num_classes: int = len(GCD_RAW_LABELS), embedding_size: int = 256) -> None:
        super().__init__()
        self.model = _ResNetBottleneck(num_classes, embedding_size)
        self.center_loss_criterion = _CentreLoss(num_classes, embedding_size)

    def forward(self, faces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax ``(N, C)`` and embeddings ``(N, 256)`` of face crops in [0, 1]."""
        logits, embedding = self.model(faces)
        return logits.softmax(dim=1), embedding


class GCDNet(nn.Module):
    """Face detector + identity classifier."""

    def __init__(self, detector: MTCNN, recognizer: GCDRecognizer) -> None:
        super().__init__()
        self.detector = detector
        self.recognizer = recognizer


def aggregate_faces(face_probs: torch.Tensor) -> torch.Tensor:
    """One probability vector for an image from its faces' softmax vectors ``(F, C)``.

    Faces are grouped by top-1 identity (groups ordered by first appearance); the largest
    group wins; its vectors are multiplied and renormalised (GIPHY's cluster rule). No face
    gives all zeros.
    """
    if len(face_probs) == 0:
        return torch.zeros(face_probs.shape[1] if face_probs.ndim == 2 else len(GCD_RAW_LABELS))
    top = face_probs.argmax(dim=1).tolist()
    groups: OrderedDict[int, list[int]] = OrderedDict()
    for i, c in enumerate(top):
        groups.setdefault(c, []).append(i)
    best = max(groups.values(), key=len)  # max keeps the first of equal-size groups
    # product in log space: hundreds of tiny probabilities would underflow
    log = torch.log(face_probs[best].double().clamp_min(1e-300)).sum(dim=0)
    prod = torch.exp(log - log.max())
    return (prod / prod.sum()).float()


FaceDetector = Callable[[np.ndarray], np.ndarray]


class GCDClassifier(PretrainedClassifier):
    """GIPHY Celebrity Detector.

    Args:
        weights: ``"gcd_celebrity"`` (folder with ``face_recognition/best_model_states.pkl``
            and ``face_detection/det{1,2,3}.npy``), a local folder of that layout, or
            ``None`` (random MTCNN and recognizer).
        threshold: minimum probability of the top-1 identity (0 = top-1 only, as EMMA).
        margin: relative margin added around each face box (GIPHY: 0.2).
        face_size: face crop size fed to the recognizer (224).
        face_detector: optional replacement for MTCNN: a callable from a uint8 ``(H, W, 3)``
            RGB image to boxes ``(K, >=4)`` ``[x1, y1, x2, y2, ...]``.
        max_faces: at most this many faces per image (largest-score first).
        no_face: an image without a detected face: ``"exclude"`` (EMMA's GCD evaluation:
            left out of the rate and counted as ``n_excluded``) or ``"absent"`` (counted as
            "celebrity not present", i.e. erased for EA and lost for RA).
    """

    name = "gcd"
    version = "2"
    detect_only = ("threshold", "aliases", "no_face")
    NO_FACE = ("exclude", "absent")
    default_weights = "gcd_celebrity"

    def __init__(
        self,
        weights: str | os.PathLike[str] | None = "gcd_celebrity",
        threshold: float = 0.0,
        margin: float = 0.2,
        face_size: int = 224,
        face_detector: FaceDetector | None = None,
        max_faces: int = 16,
        aliases: dict[str, str] | None = None,
        device: str = "cpu",
        batch_size: int = 16,
        no_face: str = "exclude",
    ) -> None:
        if no_face not in self.NO_FACE:
            raise ConfigError(f"gcd no_face={no_face!r}; valid: {', '.join(self.NO_FACE)}")
        super().__init__(weights, threshold, aliases, device, batch_size)
        self.no_face = no_face
        self.margin = float(margin)
        self.face_size = int(face_size)
        self.face_detector = face_detector
        self.max_faces = int(max_faces)

    @property
    def labels(self) -> Sequence[str]:
        return GCD_LABELS

    @property
    def raw_labels(self) -> Sequence[str]:
        return GCD_RAW_LABELS

    def _file(self, suffix: str) -> str:
        assert self.resolved is not None
        for key, path in self.resolved.paths.items():
            if key.replace(os.sep, "/").endswith(suffix):
                return str(path)
        raise FileNotFoundError(f"GCD weights lack {suffix} (have: {sorted(self.resolved.paths)})")

    def build_model(self) -> nn.Module:
        detector, recognizer = MTCNN(), GCDRecognizer(len(GCD_RAW_LABELS))
        if self.resolved is not None:
            state = load_torch_checkpoint(self._file("best_model_states.pkl"), self.resolved)
            state = state.get("model_state", state)
            recognizer.load_state_dict(state, strict=True)
            if self.face_detector is None:
                detector.load_npy(*(self._file(f"face_detection/det{i}.npy") for i in (1, 2, 3)))
        return GCDNet(detector, recognizer)

    def face_crops(self, image: np.ndarray) -> list[np.ndarray]:
        """Face crops (uint8 RGB, with margin) of one uint8 ``(H, W, 3)`` image."""
        detect = self.face_detector or self.model.detector.detect
        boxes = np.asarray(detect(image), dtype=np.float64)
        boxes = boxes.reshape(len(boxes), -1) if boxes.size else np.zeros((0, 4))
        if boxes.shape[1] >= 5:
            boxes = boxes[np.argsort(-boxes[:, 4], kind="stable")]
        h, w = image.shape[:2]
        crops = []
        for x1, y1, x2, y2 in boxes[: self.max_faces, :4]:
            ym, xm = int((y2 - y1) * self.margin), int((x2 - x1) * self.margin)
            bx1, by1 = int(max(x1 - xm / 2, 0)), int(max(y1 - ym / 2, 0))
            bx2, by2 = int(min(x2 + xm / 2, w)), int(min(y2 + ym / 2, h))
            if bx2 > bx1 and by2 > by1:
                crops.append(image[by1:by2, bx1:bx2])
        return crops

    def _faces_tensor(self, crops: Sequence[np.ndarray]) -> torch.Tensor:
        faces = [
            torch.from_numpy(np.ascontiguousarray(c)).permute(2, 0, 1)[None].float() / 255.0 for c in crops
        ]
        return torch.cat(
            [
                F.interpolate(
                    f,
                    size=(self.face_size, self.face_size),
                    mode="bilinear",
                    antialias=True,
                    align_corners=False,
                ).clamp(0, 1)
                for f in faces
            ]
        )

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        images = check_images(images)
        recognizer = self.model.recognizer
        rows = []
        for img in to_uint8_hwc(images):
            crops = self.face_crops(img)
            if not crops:
                rows.append(torch.zeros(len(GCD_RAW_LABELS)))
                continue
            faces = self._faces_tensor(crops)
            probs = torch.cat(
                [
                    recognizer(faces[i : i + self.batch_size].to(self.device))[0].float().cpu()
                    for i in range(0, len(faces), self.batch_size)
                ]
            )
            rows.append(aggregate_faces(probs))
        return torch.stack(rows) if rows else torch.zeros(0, len(GCD_RAW_LABELS))

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        idx = self.label_index(concept)
        has_face = probs.sum(dim=1) > 0
        return has_face & (probs.argmax(dim=1) == idx) & (probs[:, idx] >= self.threshold)

    def excluded(self, probs: torch.Tensor) -> torch.Tensor | None:
        """Images without a detected face (all-zero rows), when ``no_face="exclude"``."""
        return probs.sum(dim=1) == 0 if self.no_face == "exclude" else None

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "no_face": self.no_face,
            "margin": self.margin,
            "face_size": self.face_size,
            "face_detector": "mtcnn" if self.face_detector is None else repr(self.face_detector),
        }
