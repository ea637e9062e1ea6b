"""Real architectures with random weights: shapes, checkpoint formats, preprocessing, decisions.

Where a checkpoint's published size is known (git-LFS pointers of the EMMA repository), the
architecture's tensor bytes are checked against it, which ties the re-implementation to the
real file without downloading it.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("YOLO_OFFLINE", "1")

import numpy as np
import pytest
import torch

from emma.weights import REGISTRY

REPO = Path(__file__).resolve().parents[1]


def _state_bytes(module: torch.nn.Module) -> int:
    return sum(v.numel() * v.element_size() for k, v in module.state_dict().items()
               if not k.endswith("num_batches_tracked"))  # fmt: skip


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# ML-Decoder


@pytest.fixture(scope="module")
def ml_decoder():
    from classifiers.ml_decoder import ml_decoder_tresnet_l

    torch.manual_seed(0)
    return ml_decoder_tresnet_l().eval()


def _to_reference_naming(model) -> dict[str, torch.Tensor]:
    """The model's weights under the ML-Decoder repository's names (InPlaceABN layout).

    Written from the reference layout: ``conv2d_ABN`` is ``Sequential(Conv2d, InPlaceABN)``;
    a strided 3x3 conv with anti-aliasing is ``Sequential(conv2d_ABN, AntiAlias)``; the
    shortcut is ``Sequential([AvgPool2d,] conv2d_ABN)``; InPlaceABN stores ``|w| + eps`` at
    inference, so its raw weight is ``w - eps`` for positive ``w``; it keeps no batch counter.
    """
    aa_convs = {name for name, m in model.named_modules() if name.endswith("conv2") and
                not isinstance(getattr(m, "aa", torch.nn.Identity()), torch.nn.Identity)}  # fmt: skip
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("num_batches_tracked"):
            continue
        if not k.startswith("backbone."):
            out[k] = v
            continue
        k = k[len("backbone.") :]
        m = re.match(r"(.*conv\d)\.(conv|bn)\.(.*)", k)
        if m:
            base, part, rest = m.groups()
            idx = {"conv": "0", "bn": "1"}[part]
            k = f"{base}.0.{idx}.{rest}" if f"backbone.{base}" in aa_convs else f"{base}.{idx}.{rest}"
            if part == "bn" and rest == "weight":
                v = v - 1e-5
        m = re.match(r"(.*downsample\.\d)\.(conv|bn)\.(.*)", k)
        if m:
            base, part, rest = m.groups()
            k = f"{base}.{ {'conv': '0', 'bn': '1'}[part] }.{rest}"
            if part == "bn" and rest == "weight":
                v = v - 1e-5
        out[k] = v
    return out


def test_ml_decoder_matches_the_model_zoo_checkpoint_size(ml_decoder):
    size = REGISTRY["ml_decoder_tresnet_l_coco"].files[0].size
    assert abs(size - _state_bytes(ml_decoder)) / size < 0.005  # rest: pickle framing, idx_to_class
    sd = ml_decoder.state_dict()
    assert sd["head.decoder.duplicate_pooling"].shape == (80, 768, 1)
    assert sd["head.decoder.query_embed.weight"].shape == (80, 768)
    assert sd["head.decoder.embed_standart.weight"].shape == (768, 2048)


def test_ml_decoder_loads_reference_named_checkpoints_strictly(ml_decoder, tmp_path):
    from classifiers.ml_decoder import COCO_LABELS, MLDecoderClassifier, convert_ml_decoder_state_dict

    with torch.no_grad():  # positive BN weights, so InPlaceABN's |w| + eps inverts exactly
        for name, p in ml_decoder.named_parameters():
            if name.endswith("bn.weight"):
                p.copy_(torch.rand(p.shape, generator=_gen(1)) + 0.5)
    ref = _to_reference_naming(ml_decoder)
    for key in ("body.conv1.0.weight", "body.layer1.0.conv1.0.weight", "body.layer1.0.downsample.0.0.weight",
                "body.layer2.0.conv2.0.0.weight", "body.layer2.0.conv2.0.1.running_var",
                "body.layer2.0.downsample.1.1.bias", "body.layer3.22.conv3.1.weight",
                "head.decoder.layers.0.multihead_attn.in_proj_weight"):  # fmt: skip
        assert key in ref, key
    converted = convert_ml_decoder_state_dict({"model": ref}, ml_decoder)
    for k, v in ml_decoder.state_dict().items():
        assert torch.allclose(converted[k].float(), v.float(), atol=1e-6), k

    path = tmp_path / "tresnet_l_COCO__448_90_0.pth"
    idx_to_class = {str(i): c for i, c in enumerate(COCO_LABELS)}
    torch.save({"model": ref, "idx_to_class": idx_to_class}, path)
    clf = MLDecoderClassifier(weights=path, image_size=64)
    x = torch.rand(2, 3, 64, 64, generator=_gen(2))
    with torch.no_grad():
        expected = torch.sigmoid(ml_decoder(x))
    assert torch.allclose(clf.predict(x), expected, atol=1e-5)
    assert clf.labels == COCO_LABELS and clf.weights_hash() is not None


def test_ml_decoder_group_fc_and_prediction_shape(ml_decoder):
    from classifiers.ml_decoder import MLDecoderClassifier, MLDecoderHead

    head = MLDecoderHead(num_classes=10, in_features=16, num_of_groups=4, decoder_embedding=8).eval()
    assert head.decoder.duplicate_factor == 3  # ceil(10 / 4)
    feats = torch.randn(2, 16, 3, 3, generator=_gen(3))
    d = head.decoder
    with torch.no_grad():
        memory = torch.relu(d.embed_standart(feats.flatten(2).transpose(1, 2))).transpose(0, 1)
        h = d.query_embed.weight.unsqueeze(1).expand(-1, 2, -1)
        h = d.layers[0](h, memory).transpose(0, 1)
        ref = torch.zeros(2, 12)
        for q in range(4):  # query q produces classes 3q .. 3q+2
            for j in range(3):
                ref[:, 3 * q + j] = h[:, q] @ d.duplicate_pooling[q, :, j]
        ref = ref[:, :10] + d.duplicate_pooling_bias
        assert torch.allclose(head(feats), ref, atol=1e-5)

    clf = MLDecoderClassifier(weights=None, image_size=64)
    clf._model = ml_decoder
    p = clf.predict(torch.rand(3, 3, 50, 70, generator=_gen(4)))
    assert p.shape == (3, 80) and bool(((p > 0) & (p < 1)).all())


# --------------------------------------------------------------------------------------------
# GCD


def test_gcd_recognizer_is_giphys_resnet_center_loss():
    from classifiers.gcd import GCDRecognizer

    torch.manual_seed(0)
    rec = GCDRecognizer().eval()
    sd = rec.state_dict()
    assert sd["model.stem.0.weight"].shape == (64, 3, 7, 7)  # resnet50.conv1
    assert "model.stem.4.0.conv1.weight" in sd  # resnet50.layer1 is the stem's 5th child
    assert sd["model.fc1.weight"].shape == (256, 2048) and sd["model.fc2.weight"].shape == (2306, 256)
    assert sd["center_loss_criterion.centers"].shape == (2306, 256)
    # best_model_states.pkl = model_state + Adam's two moments of every parameter
    params = sum(p.numel() * p.element_size() for p in rec.parameters())
    size = REGISTRY["gcd_celebrity"].files[0].size
    assert abs(size - (_state_bytes(rec) + 2 * params)) / size < 0.002
    probs, emb = rec(torch.rand(2, 3, 224, 224, generator=_gen(5)))
    assert probs.shape == (2, 2306) and emb.shape == (2, 256)
    assert torch.allclose(probs.sum(1), torch.ones(2), atol=1e-5)


def test_gcd_loads_a_giphy_checkpoint_and_a_detector(tmp_path):
    from classifiers.gcd import MTCNN, GCDClassifier, GCDRecognizer

    torch.manual_seed(1)
    rec, det = GCDRecognizer().eval(), MTCNN()
    (tmp_path / "face_recognition").mkdir()
    (tmp_path / "face_detection").mkdir()
    torch.save({"model_state": rec.state_dict()}, tmp_path / "face_recognition" / "best_model_states.pkl")
    for i, net in enumerate((det.pnet, det.rnet, det.onet), start=1):
        np.save(tmp_path / "face_detection" / f"det{i}.npy", _to_facenet_npy(net), allow_pickle=True)
    clf = GCDClassifier(weights=tmp_path)
    for (k, v), (k2, v2) in zip(
        clf.model.recognizer.state_dict().items(), rec.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2)
    for a, b in ((clf.model.detector.onet, det.onet), (clf.model.detector.pnet, det.pnet)):
        for (k, v), v2 in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.allclose(v, v2), k


def _to_facenet_npy(net: torch.nn.Module) -> dict:
    """A facenet ``det*.npy`` dict (TF layouts: HWIO kernels, (in, out) dense) for ``net``."""
    out: dict = {}
    for name, module in net.named_children():
        layer = name.replace("_", "-")
        if isinstance(module, torch.nn.PReLU):
            out[layer] = {"alpha": module.weight.detach().numpy().copy()}
        elif isinstance(module, torch.nn.Conv2d):
            out[layer] = {"weights": module.weight.detach().permute(2, 3, 1, 0).numpy().copy(),
                          "biases": module.bias.detach().numpy().copy()}  # fmt: skip
        elif isinstance(module, torch.nn.Linear):
            out[layer] = {
                "weights": module.weight.detach().T.numpy().copy(),
                "biases": module.bias.detach().numpy(),
            }
    return out


def test_mtcnn_npy_layout_is_tensorflows():
    """A TF (NHWC, HWIO) convolution and dense layer, computed by hand, equal the loaded nets."""
    from classifiers.gcd import RNet, mtcnn_state_dict_from_npy

    rng = np.random.default_rng(0)
    net = RNet()
    data = _to_facenet_npy(net)
    data["conv1"]["weights"] = rng.normal(size=(3, 3, 3, 28)).astype(np.float32)
    data["conv4"]["weights"] = rng.normal(size=(576, 128)).astype(np.float32) * 0.05
    net.load_state_dict(mtcnn_state_dict_from_npy(data, net))
    x = rng.normal(size=(1, 24, 24, 3)).astype(np.float32)  # NHWC
    conv = net.conv1(torch.from_numpy(x).permute(0, 3, 1, 2))
    y, xx, o = 5, 7, 11
    by_hand = (x[0, y : y + 3, xx : xx + 3, :] * data["conv1"]["weights"][:, :, :, o]).sum() + data["conv1"][
        "biases"
    ][o]
    assert conv[0, o, y, xx].item() == pytest.approx(float(by_hand), abs=1e-4)
    fmap = rng.normal(size=(1, 3, 3, 64)).astype(np.float32)  # NHWC map before the dense layer
    dense = net.conv4(torch.from_numpy(fmap).permute(0, 3, 1, 2))
    expected = fmap.reshape(1, -1) @ data["conv4"]["weights"] + data["conv4"]["biases"]
    assert np.allclose(dense.detach().numpy(), expected, atol=1e-4)
    with pytest.raises(KeyError, match="does not fit"):
        bad = dict(
            data, conv1={"weights": np.zeros((3, 3, 3, 5), np.float32), "biases": np.zeros(5, np.float32)}
        )
        mtcnn_state_dict_from_npy(bad, net)


@pytest.mark.parametrize("n", [21, 22, 23])
def test_tensorflow_same_max_pool(n):
    from classifiers.gcd import _max_pool_same

    x = torch.randn(1, 1, n, n, generator=_gen(n))
    out = _max_pool_same(x, 3, 2)
    m = -(-n // 2)  # TF SAME: ceil(n / s)
    assert out.shape[-1] == m
    total = max((m - 1) * 2 + 3 - n, 0)
    before = total // 2
    xp = torch.full((n + total, n + total), float("-inf"))
    xp[before : before + n, before : before + n] = x[0, 0]
    ref = torch.stack(
        [torch.stack([xp[2 * i : 2 * i + 3, 2 * j : 2 * j + 3].max() for j in range(m)]) for i in range(m)]
    )
    assert torch.equal(out[0, 0], ref)


def test_mtcnn_networks_and_pipeline_shapes():
    from classifiers.gcd import MTCNN, ONet, PNet, RNet

    reg, prob = PNet()(torch.rand(1, 3, 30, 40))
    assert reg.shape == (1, 4, 10, 15) and prob.shape == (1, 2, 10, 15)
    assert RNet()(torch.rand(2, 3, 24, 24))[1].shape == (2, 2)
    box, landmarks, prob = ONet()(torch.rand(2, 3, 48, 48))
    assert box.shape == (2, 4) and landmarks.shape == (2, 10) and prob.shape == (2, 2)

    det = MTCNN()  # force "face everywhere, no regression": exercises every stage
    with torch.no_grad():
        for cls, reg in ((det.pnet.conv4_1, det.pnet.conv4_2), (det.rnet.conv5_1, det.rnet.conv5_2),
                         (det.onet.conv6_1, det.onet.conv6_2)):  # fmt: skip
            cls.weight.zero_()
            cls.bias.copy_(torch.tensor([-20.0, 20.0]))
            reg.weight.zero_()
            reg.bias.zero_()
    img = (np.random.default_rng(0).random((60, 80, 3)) * 255).astype(np.uint8)
    boxes = det.detect(img)
    assert boxes.ndim == 2 and boxes.shape[1] == 5 and len(boxes) >= 1
    assert np.allclose(boxes[:, 4], 1.0)
    assert np.allclose(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])  # squared in stage 2


def test_nms_union_and_min():
    from classifiers.gcd import _nms

    boxes = np.array(
        [[0, 0, 9, 9, 0.9], [1, 1, 10, 10, 0.8], [0, 0, 4, 4, 0.95], [50, 50, 60, 60, 0.1]], float
    )
    # union IoU(0, 1) = 81 / 119 = 0.68; box 2 lies inside box 0: IoU 25 / 100, min-overlap 1
    assert _nms(boxes, 0.5, "union").tolist() == [2, 0, 3]
    assert _nms(boxes, 0.7, "union").tolist() == [2, 0, 1, 3]
    assert _nms(boxes, 0.7, "min").tolist() == [2, 1, 3]


def test_gcd_face_aggregation_and_decision():
    from classifiers.gcd import GCDClassifier, aggregate_faces

    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1]])
    agg = aggregate_faces(p)  # faces 0 and 2 (identity 0) outvote face 1
    ref = p[0] * p[2]
    assert torch.allclose(agg, ref / ref.sum())
    assert torch.equal(aggregate_faces(torch.zeros(0, 3)), torch.zeros(3))

    clf = GCDClassifier(weights=None)
    probs = torch.zeros(3, 2306)
    brad = clf.label_index("brad-pitt")
    probs[0, brad] = 0.9
    probs[0, 0] = 0.1
    probs[1, 0] = 1.0
    assert clf.detect(probs, "Brad Pitt").tolist() == [True, False, False]  # row 2: no face


def test_gcd_crops_faces_with_giphys_margin():
    from classifiers.gcd import GCDClassifier

    seen = []

    def detector(img):
        seen.append(img.shape)
        return np.array([[10.0, 20.0, 50.0, 70.0, 0.99]])

    clf = GCDClassifier(weights=None, face_detector=detector)
    img = np.arange(100 * 120 * 3, dtype=np.uint8).reshape(100, 120, 3)
    (crop,) = clf.face_crops(img)
    # margin 0.2: x by int(40 * 0.2) = 8 -> [6, 54), y by int(50 * 0.2) = 10 -> [15, 75)
    assert np.array_equal(crop, img[15:75, 6:54])
    seen.clear()
    torch.manual_seed(0)
    out = clf.predict(torch.rand(2, 3, 100, 120))
    assert seen == [(100, 120, 3)] * 2
    assert out.shape == (2, 2306) and torch.allclose(out.sum(1), torch.ones(2), atol=1e-4)


def test_numpy_only_unpickling_refuses_code(tmp_path):
    from classifiers._base import load_numpy_pickle

    good = tmp_path / "prompts.p"
    arr = np.arange(6, dtype=np.float16).reshape(2, 3)
    good.write_bytes(pickle.dumps(arr))
    assert np.array_equal(load_numpy_pickle(good), arr)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "evil.p"
    bad.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_numpy_pickle(bad)


# --------------------------------------------------------------------------------------------
# style ViT


def test_style_vit_architecture_and_checkpoint_format(tmp_path):
    from classifiers.style_vit import StyleViTClassifier, style_vit_model

    torch.manual_seed(0)
    model = style_vit_model().eval()
    size = REGISTRY["style_vit_unlearndiffatk"].files[0].size
    assert abs(size - _state_bytes(model)) / size < 0.001
    sd = model.state_dict()
    assert sd["classifier.weight"].shape == (129, 768)
    assert sd["vit.embeddings.position_embeddings"].shape == (1, 197, 768)  # 14 x 14 patches + CLS

    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path)  # a Trainer checkpoint's weights file is a plain state dict
    clf = StyleViTClassifier(weights=path)
    x = torch.rand(2, 3, 96, 80, generator=_gen(6))
    pixels = torch.nn.functional.interpolate(x, size=(224, 224), mode="bilinear", antialias=True)
    with torch.no_grad():
        expected = model(pixel_values=(pixels.clamp(0, 1) - 0.5) / 0.5).logits.softmax(-1)
    got = clf.predict(x)
    assert got.shape == (2, 129) and torch.allclose(got, expected, atol=1e-5)


# --------------------------------------------------------------------------------------------
# YOLO logos


def test_yolo_logo_architecture_and_ultralytics_checkpoints(tmp_path):
    pytest.importorskip("ultralytics")
    from classifiers.yolo_logo import LOGO_LABELS, YOLOLogoClassifier, yolo_classifier_model
    from emma.errors import ConfigError

    torch.manual_seed(0)
    model = yolo_classifier_model()
    n_params = sum(p.numel() for p in model.parameters())
    assert 5.3e6 < n_params < 5.6e6  # yolo11s-cls with a 30-way head
    names = list(reversed(LOGO_LABELS))  # checkpoint order differs from the shipped list
    model.names = dict(enumerate(names))
    path = tmp_path / "best.pt"
    torch.save({"model": model.half(), "train_args": {}}, path)  # Ultralytics' format

    clf = YOLOLogoClassifier(weights=path)
    assert list(clf.labels) == names  # labels come from the checkpoint
    x = torch.rand(2, 3, 120, 90, generator=_gen(7))
    p = clf.predict(x)
    assert p.shape == (2, 30) and torch.allclose(p.sum(1), torch.ones(2), atol=1e-3)
    forced = torch.zeros(1, 30)
    forced[0, clf.label_index("hotwheels")] = 1.0
    assert clf.labels[clf.label_index("hotwheels")] == "Hot Wheels"
    assert clf.detect(forced, "Hot Wheels").tolist() == [True]
    assert clf.detect(forced, "barbie").tolist() == [False]

    other = yolo_classifier_model(3)
    other.names = {0: "tench", 1: "goldfish", 2: "shark"}
    torch.save({"model": other}, tmp_path / "imagenet.pt")
    with pytest.raises(ConfigError, match="not a logo classifier"):
        YOLOLogoClassifier(weights=tmp_path / "imagenet.pt").predict(x)


def test_logo_dataset_builder(tmp_path):
    import importlib.util

    from PIL import Image

    spec = importlib.util.spec_from_file_location(
        "train_logo_classifier", REPO / "scripts" / "train_logo_classifier.py"
    )
    tlc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tlc)

    root = tmp_path / "LogoDet-3K"
    for cat, brand in (("Food", "McDonalds"), ("Sports", "Adidas SB")):
        d = root / cat / brand
        d.mkdir(parents=True)
        for k in range(5):
            Image.new("RGB", (64, 48), (k * 40, 0, 0)).save(d / f"{k}.jpg")
            (d / f"{k}.xml").write_text(
                "<annotation><object><name>x</name><bndbox><xmin>10</xmin><ymin>5</ymin>"
                "<xmax>40</xmax><ymax>35</ymax></bndbox></object></annotation>"
            )
    counts = tlc.build_dataset(root, tmp_path / "ds", brands=["McDonald's", "Adidas SB"], val_fraction=0.2)
    assert counts == {"McDonald's": {"train": 4, "val": 1}, "Adidas SB": {"train": 4, "val": 1}}
    crops = sorted((tmp_path / "ds" / "train" / "McDonald's").iterdir())
    assert len(crops) == 4
    with Image.open(crops[0]) as im:
        assert im.size == (36, 36)  # 30 x 30 box + 10% margin on each side
    with pytest.raises(SystemExit, match="lacks folders for: Barbie"):
        tlc.build_dataset(root, tmp_path / "ds2", brands=["Barbie"])


# --------------------------------------------------------------------------------------------
# CLIP: Q16 and zero-shot (ViT-B/32 keeps tests small; Q16's published prompts are 768-d = ViT-L/14)


@pytest.fixture(scope="module")
def clip_b32():
    from classifiers.clip_zero_shot import build_clip

    torch.manual_seed(0)
    return build_clip("ViT-B-32")


def test_q16_prompts_match_vit_l14_width():
    import open_clip

    assert open_clip.get_model_config("ViT-L-14")["embed_dim"] == 768


def test_q16_formula_and_prompt_file(clip_b32, tmp_path):
    from classifiers.clip_zero_shot import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from classifiers.q16 import Q16Classifier, Q16Net, load_q16_prompts

    prompts = np.random.default_rng(0).normal(size=(2, 512)).astype(np.float16)  # Q16 stores fp16
    path = tmp_path / "prompts.p"
    path.write_bytes(pickle.dumps(prompts))
    clf = Q16Classifier(weights=path, clip_weights=None, arch="ViT-B-32")
    clf._model = Q16Net(clip_b32, load_q16_prompts(path)).eval()  # the shared random CLIP
    x = torch.rand(3, 3, 224, 224, generator=_gen(8))
    got = clf.predict(x)
    with torch.no_grad():
        mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
        f = clip_b32.encode_image((x - mean) / std)
        f = f / f.norm(dim=-1, keepdim=True)
        t = torch.from_numpy(prompts.astype(np.float32))
        t = t / t.norm(dim=-1, keepdim=True)
        expected = (100 * f @ t.T).softmax(-1)
    assert torch.allclose(got, expected, atol=1e-5)
    assert clf.detect(got, "violence").tolist() == (expected[:, 1] >= 0.5).tolist()

    wide = tmp_path / "wide.p"
    wide.write_bytes(pickle.dumps(np.zeros((2, 768), np.float32)))
    with pytest.raises(ValueError, match="dimension 768"):
        Q16Classifier(weights=wide, clip_weights=None, arch="ViT-B-32").predict(x[:1])


def test_clip_zero_shot_rule_vocabulary_and_checkpoint(clip_b32, tmp_path):
    from classifiers.clip_zero_shot import CLIPZeroShotClassifier

    path = tmp_path / "open_clip_b32.pt"
    torch.save(clip_b32.state_dict(), path)
    clf = CLIPZeroShotClassifier(labels=None, weights=path, arch="ViT-B-32", templates=("a photo of {}.",))
    key0 = clf.cache_key()
    assert (
        clf.can_detect("circle")
        and clf.can_detect("brad-pitt")
        and list(clf.labels) == ["circle", "brad-pitt"]
    )
    assert clf.cache_key() != key0  # the label set is part of the cache key
    x = torch.rand(2, 3, 64, 64, generator=_gen(9))
    p = clf.predict(x)
    img = clf.embed_images(x)
    with torch.no_grad():
        ref_img = clip_b32.encode_image(clf.preprocess(x))
        ref_img = ref_img / ref_img.norm(dim=-1, keepdim=True)
    assert torch.allclose(img, ref_img, atol=1e-5)  # the saved checkpoint loaded faithfully
    txt = clf.text_features()
    scale = clip_b32.logit_scale.exp().clamp(max=100)
    assert torch.allclose(p, (scale * img @ txt.T).softmax(-1), atol=1e-5)
    assert clf.detect(p, "circle").tolist() == (p.argmax(1) == 0).tolist()

    fixed = CLIPZeroShotClassifier(labels=["cat", "dog"], weights=None, arch="ViT-B-32")
    assert not fixed.can_detect("horse")


# --------------------------------------------------------------------------------------------
# VLM judge


def test_vlm_verdict_parsing():
    from classifiers.vlm_judge import parse_verdict

    v = parse_verdict('```json\n{"present": true, "confidence": 0.93}\n```')
    assert v.present and v.confidence == pytest.approx(0.93) and v.score == pytest.approx(0.93)
    assert parse_verdict('{"present": "no", "confidence": 85}').confidence == pytest.approx(0.85)
    assert parse_verdict('{"present": false, "confidence": 0.99}').score == 0.0
    assert parse_verdict("Yes, there is a cat.").present
    bad = parse_verdict("I cannot tell.")
    assert not bad.parsed and bad.score == 0.0


def test_vlm_judge_accepts_present_at_confidence_08():
    from classifiers.vlm_judge import VLMJudgeClassifier

    replies = [
        '{"present": true, "confidence": 0.8}',
        '{"present": true, "confidence": 0.79}',
        '{"present": false, "confidence": 0.95}',
        '{"present": true, "confidence": 0.99}',
    ]

    class Scripted:
        def __init__(self):
            self.prompts = []

        def generate(self, image, prompt):
            self.prompts.append(prompt)
            return replies[len(self.prompts) - 1]

    backend = Scripted()
    clf = VLMJudgeClassifier(labels=["van-gogh"], backend=backend)
    x = torch.rand(4, 3, 16, 16, generator=_gen(10))
    p = clf.predict(x)
    assert p[:, 0].tolist() == pytest.approx([0.8, 0.79, 0.0, 0.99])
    assert clf.detect(p, "van-gogh").tolist() == [True, False, False, True]
    assert "van gogh" in backend.prompts[0]
    clf.predict(x)  # memoised by pixels: no new requests
    assert len(backend.prompts) == 4

    rnd = VLMJudgeClassifier(labels=["cat"], backend=None, seed=3)
    assert torch.equal(rnd.predict(x), VLMJudgeClassifier(labels=["cat"], backend=None, seed=3).predict(x))
