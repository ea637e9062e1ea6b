"""``emma.config.to_python``: the one conversion of config values (what Hydra passes to
constructors) into plain Python."""

from __future__ import annotations

from omegaconf import OmegaConf

from emma.config import to_python


def test_containers_become_plain_and_resolved():
    cfg = OmegaConf.create({"a": 2, "b": "${a}", "c": [1, {"d": "${a}"}]})
    out = to_python(cfg)
    assert out == {"a": 2, "b": 2, "c": [1, {"d": 2}]}
    assert type(out) is dict and type(out["c"]) is list and type(out["c"][1]) is dict
    assert to_python(cfg.c) == [1, {"d": 2}] and type(to_python(cfg.c)) is list


def test_containers_inside_plain_ones_and_tuples_are_converted():
    cfg = OmegaConf.create({"x": ["p", "q"]})
    out = to_python({"k": cfg, "t": ("a", "b")})
    assert out == {"k": {"x": ["p", "q"]}, "t": ["a", "b"]}
    assert type(out["k"]) is dict and type(out["t"]) is list


def test_other_values_are_returned_unchanged():
    marker = object()
    for value in (None, 3, 0.5, "s", marker):
        assert to_python(value) is value
