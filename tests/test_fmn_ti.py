"""FMN's textual-inversion stage (``use_ti``, on in the reference's configs/attn.yaml) on the
tiny random pipeline: it trains only the new token vectors, lowers the diffusion loss on the
concept's images, is deterministic, and the attention stage then re-steers those tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from emma.errors import ConfigError
from emma.methods._common import cpu_generator, encode_text, generate_latents, training_scheduler
from emma.methods.fmn import ForgetMeNotMethod, TIPrompt, encode_learned, ti_loss
from emma.pipelines import fingerprint
from emma.validate import InvalidConfigError, validate_overrides


def fmn(**kw) -> ForgetMeNotMethod:
    args = dict(num_images=2, max_train_steps=2, sample_steps=2, learning_rate=1e-3, use_ti=True,
                max_train_steps_ti=5, progress=False)
    return ForgetMeNotMethod(**{**args, **kw})


@pytest.fixture(scope="module")
def latents(base):
    return generate_latents(base, ["a photo of circle"] * 2, [1, 2], num_inference_steps=2, guidance_scale=7.5)


def test_inversion_trains_only_the_new_vectors(pipe, latents):
    unet = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    text = {k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    m = fmn(max_train_steps_ti=10)
    gen = cpu_generator(0)
    init = m.initial_vectors(pipe, "circle", gen)
    prompt = TIPrompt(pipe.tokenizer, "a photo of {}", 4)
    vectors, losses = m.invert(pipe, prompt, latents, init, gen)
    assert all(torch.equal(v, unet[k]) for k, v in pipe.unet.state_dict().items())
    assert all(torch.equal(v, text[k]) for k, v in pipe.text_encoder.state_dict().items())
    assert vectors.shape == init.shape == (4, pipe.text_encoder.config.hidden_size)
    assert not torch.equal(vectors, init) and len(losses) == 10
    # slot 0 starts as the concept's word ("circle" is one word piece), slots 1-3 as N(0, 1)
    word = pipe.tokenizer("circle", add_special_tokens=False).input_ids
    assert len(word) == 1
    assert torch.equal(init[0], pipe.text_encoder.get_input_embeddings().weight[word[0]].detach())
    assert init[1:].norm(dim=-1).min() > 4.0  # ~sqrt(32) for noise of sigma 1; word rows ~0.1
    # clip_ti_decay: every step moves each norm 10% (100 * lr) of the way to 0.4
    assert vectors[1:].norm(dim=-1).max() < init[1:].norm(dim=-1).min() * 0.9**10 + 0.45


def test_whole_erase_leaves_tokenizer_and_text_encoder_alone(base, pipe):
    fmn().erase(pipe, ["circle"], seed=0)
    assert len(pipe.tokenizer) == len(base.tokenizer)
    assert fingerprint(pipe, ("text_encoder", "vae")) == fingerprint(base, ("text_encoder", "vae"))
    assert fingerprint(pipe, ("unet",)) != fingerprint(base, ("unet",))


def test_inversion_lowers_the_diffusion_loss(base, latents):
    # The random UNet barely reads its prompt; scaled-up cross-attention outputs make the
    # prompt matter, so that what the learned tokens say is visible in the loss.
    pipe = copy.deepcopy(base)
    with torch.no_grad():
        for name, p in pipe.unet.named_parameters():
            if ".attn2.to_out.0.weight" in name:
                p.mul_(20)
    sched = training_scheduler(pipe)
    g = torch.Generator().manual_seed(123)
    x0 = latents.repeat(8, 1, 1, 1)  # fixed noise and timesteps: 16 draws over both images
    noise = torch.randn(x0.shape, generator=g)
    t = torch.randint(0, 1000, (len(x0),), generator=g)
    prompt = TIPrompt(pipe.tokenizer, "a photo of {}", 4)

    def loss(v: torch.Tensor) -> float:
        with torch.no_grad():
            return ti_loss(pipe, prompt, v, x0, noise, t, sched).item()

    m = fmn(learning_rate_ti=1e-2, max_train_steps_ti=50)
    gen = cpu_generator(0)
    init = m.initial_vectors(pipe, "circle", gen)
    vectors, _ = m.invert(pipe, prompt, latents, init, gen)
    before, after = loss(init), loss(vectors)
    controls = [loss(torch.nn.functional.normalize(torch.randn(4, init.shape[1], generator=g), dim=-1) * 0.4)
                for _ in range(4)]  # random vectors of the learned ones' norm
    assert before == pytest.approx(1.1097, abs=5e-3)
    assert after < before - 0.02  # measured 1.1097 -> 1.0721
    assert after < min(controls) - 0.02  # controls 1.106-1.121


def test_inversion_is_deterministic(base):
    runs = []
    for seed in (0, 0, 1):
        m = fmn()
        m.erase(copy.deepcopy(base), ["circle"], seed=seed)
        runs.append(m.last_run["ti_vectors"])
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_attention_stage_resteers_the_learned_tokens(pipe):
    m = fmn()
    m.erase(pipe, ["circle", "star"], seed=0)
    run = m.last_run
    # "a photo of {}": [start, a, photo, of, <s1>..<s4>, end, padding...]
    expected = torch.zeros(pipe.tokenizer.model_max_length, dtype=torch.bool)
    expected[4:9] = True  # the four learned tokens and the pooled end token
    assert run["positions"].shape == (2, pipe.tokenizer.model_max_length)
    assert torch.equal(run["positions"][0], expected) and torch.equal(run["positions"][1], expected)
    assert len(run["ti_losses"]) == 2 and all(len(x) == 5 for x in run["ti_losses"])
    assert run["ti_vectors"].shape == (2, 4, pipe.text_encoder.config.hidden_size)
    assert len(run["attn_losses"]) == 2
    # the hidden states the attention stage prompts with read the learned vectors
    prompt = TIPrompt(pipe.tokenizer, "a photo of {}", 4)
    with torch.no_grad():
        learned = encode_learned(pipe.text_encoder, prompt, run["ti_vectors"])
        other = encode_learned(pipe.text_encoder, prompt, torch.zeros_like(run["ti_vectors"]))
    assert not torch.allclose(learned[:, 4:8], other[:, 4:8])
    assert torch.equal(learned[:, :4], other[:, :4])  # causal: the words before the slots are the same
    without = fmn(use_ti=False)
    without.erase(copy.deepcopy(pipe), ["circle"], seed=0)
    plain = torch.zeros_like(expected)
    plain[4:6] = True  # "circle" and the end token
    assert torch.equal(without.last_run["positions"][0], plain)
    assert "ti_vectors" not in without.last_run


def test_pooler_off_resteers_the_learned_tokens_only(pipe):
    m = fmn(use_pooler=False, max_train_steps_ti=1, max_train_steps=1)
    m.erase(pipe, ["circle"], seed=0)
    assert m.last_run["positions"][0].nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_learned_prompt_encodes_like_the_tokenizer_around_the_slot(base):
    prompt = TIPrompt(base.tokenizer, "a star in {} style", 2)
    ids = base.tokenizer("a star in x x style", padding="max_length",
                         max_length=base.tokenizer.model_max_length).input_ids
    x = base.tokenizer("x", add_special_tokens=False).input_ids[0]
    got = prompt.ids.tolist()
    slots = prompt.slots.nonzero().flatten().tolist()
    assert slots == [4, 5] and prompt.end == 7
    assert [g if i not in slots else x for i, g in enumerate(got)] == ids
    # with a word's own embedding in the slots, the prompt encodes as the word does
    table = base.text_encoder.get_input_embeddings().weight.detach()
    with torch.no_grad():
        learned = encode_learned(base.text_encoder, prompt, table[[x, x]][None])
    assert torch.allclose(learned, encode_text(base, ["a star in x x style"]), atol=1e-6)


@pytest.mark.parametrize("kw, words", [
    (dict(max_train_steps_ti=-1), ["max_train_steps_ti=-1", ">= 1"]),
    (dict(num_tokens_ti=0), ["num_tokens_ti=0", ">= 1"]),
    (dict(learning_rate_ti=0.0), ["learning_rate_ti=0.0", "> 0"]),
    (dict(weight_decay_ti=float("nan")), ["weight_decay_ti=nan", "finite"]),
    (dict(initializer_ti="elon"), ["initializer_ti='elon'", "valid: concept, random"]),
])
def test_bad_ti_settings_are_one_line_config_errors(kw, words):
    with pytest.raises(ConfigError) as err:
        fmn(**kw)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


@pytest.mark.parametrize("override, words", [
    ("method.max_train_steps_ti=-1", ["method.max_train_steps_ti=-1", "[1,"]),
    ("method.learning_rate_ti=-0.001", ["method.learning_rate_ti=-0.001", "(0.0, inf)"]),
    ("method.max_train_step_ti=5", ["method.max_train_step_ti=5", "did you mean 'max_train_steps_ti'"]),
])
def test_bad_ti_overrides_are_refused_before_a_run(override, words):
    with pytest.raises(InvalidConfigError) as err:
        validate_overrides(["model=sd14", "model.device=cpu", "domain=object", "method=fmn", override])
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_too_long_learned_prompt_is_a_config_error(base):
    with pytest.raises(ConfigError, match="tokens long; the text encoder reads at most 77"):
        TIPrompt(base.tokenizer, "a photo of {}", 80)
